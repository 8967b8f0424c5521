"""The fused bidirectional passes: features, state and readout block by block
(:func:`fused_bidirectional`), their backward (:func:`fused_bidirectional_vjp`), and
exact keys merged per query in the same pass (:func:`fused_global`)."""

from __future__ import annotations

from typing import Any

from linattn._dispatch.common import (
    broadcast_batch,
    fitted_kernel_arrays,
    fused_map_arrays,
    library_of,
    torch_projection,
)
from linattn._xp import Array
from linattn.features import FeatureMap

__all__ = ["fused_bidirectional", "fused_bidirectional_vjp", "fused_global"]


def fused_bidirectional(
    q: Array, k: Array, v: Array, feature_map: FeatureMap, key_mask: Array | None
) -> Array:
    """Normalised bidirectional attention in the fused CPU pass
    (:func:`linattn_numba.cpu.bidirectional.favor_bidirectional`): features, state and
    readout block by block, no ``L x m`` array; compute dtype.  A fitted map's features
    too, for NumPy arrays (the executors send nothing else)."""
    if feature_map.parameters is not None:
        from linattn_numba.cpu import bidirectional as _bidirectional

        batch = broadcast_batch(q, k, v, key_mask)
        empty, fitted = fitted_kernel_arrays(feature_map, (*batch, *q.shape[-2:]), q.dtype)
        out, _, _ = _bidirectional.favor_bidirectional(
            q, k, v, empty, hyperbolic=False, scale=feature_map.scale, key_mask=key_mask,
            fitted=fitted,
        )  # fmt: skip
        return out
    projection, hyperbolic = fused_map_arrays(feature_map)
    if library_of(q) == "torch":
        from linattn_numba import torch_ops as _torch

        projection = torch_projection(projection, q.dtype)
        return _torch.bidirectional(q, k, v, projection, key_mask, hyperbolic, feature_map.scale)
    from linattn_numba.cpu import bidirectional as _bidirectional

    out, _, _ = _bidirectional.favor_bidirectional(
        q, k, v, projection, hyperbolic=hyperbolic, scale=feature_map.scale, key_mask=key_mask
    )
    return out


def fused_bidirectional_vjp(
    q: Array,
    k: Array,
    v: Array,
    feature_map: FeatureMap,
    key_mask: Array | None,
    grad_output: Array,
    *,
    chunk_size: int | None = None,
) -> tuple[Array, Array, Array]:
    """``(dq, dk, dv)`` of bidirectional attention by the fused forward and backward
    passes (:func:`linattn_numba.cpu.bidirectional.favor_bidirectional_backward`); over
    the broadcast batch shape, compute dtype.  (``chunk_size`` is taken as every backward
    takes it, and unused: the passes go block by block.)"""
    from linattn_numba.cpu import bidirectional as _bidirectional

    arrays: tuple[Any, ...] = (q, k, v, key_mask, grad_output)
    torch_in = library_of(q) == "torch"
    if torch_in:  # (NumPy views of the CPU tensors; the results wrapped without copies)
        arrays = tuple(None if x is None else x.detach().numpy() for x in arrays)
    q, k, v, key_mask, grad_output = arrays
    projection, hyperbolic = fused_map_arrays(feature_map)
    options: dict[str, Any] = {"hyperbolic": hyperbolic, "scale": feature_map.scale}
    options["key_mask"] = key_mask
    out, kv, log_shift = _bidirectional.favor_bidirectional(q, k, v, projection, **options)
    grads: tuple[Any, ...] = _bidirectional.favor_bidirectional_backward(
        q, k, v, projection, kv, log_shift, out, grad_output, **options
    )
    if torch_in:
        import torch

        grads = tuple(torch.from_numpy(g) for g in grads)
    return grads[0], grads[1], grads[2]


def fused_global(
    q: Array,
    k: Array,
    v: Array,
    feature_map: FeatureMap,
    keep: Array,
    sinks: tuple[Array, Array, Array],
) -> Array:
    """Bidirectional attention with exact keys merged per query in the fused pass
    (:func:`linattn_numba.cpu.bidirectional.favor_bidirectional`); NumPy arrays."""
    from linattn_numba.cpu import bidirectional as _bidirectional

    projection, hyperbolic = fused_map_arrays(feature_map)
    out, _, _ = _bidirectional.favor_bidirectional(
        q, k, v, projection, hyperbolic=hyperbolic, scale=feature_map.scale, key_mask=keep,
        sinks=sinks,
    )  # fmt: skip
    return out
