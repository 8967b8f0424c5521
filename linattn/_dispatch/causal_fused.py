"""The fused causal passes: features, causal attention and normalisation in one
compiled pass (:func:`fused_causal`, NumPy arrays and torch CPU tensors), and their
backward (:func:`fused_causal_vjp`, :func:`fused_causal_rows_vjp`)."""

from __future__ import annotations

from typing import Any

from linattn._dispatch.common import (
    broadcast_batch,
    empty_shift,
    fitted_kernel_arrays,
    fused_map_arrays,
    library_of,
    torch_projection,
    zeros_state,
)
from linattn._xp import Array
from linattn.features import FeatureMap

__all__ = [
    "fused_causal",
    "fused_causal_backward",
    "fused_causal_rows_vjp",
    "fused_causal_vjp",
]


def fused_causal(
    q: Array,
    k: Array,
    v: Array,
    feature_map: FeatureMap,
    key_mask: Array | None,
    kv: Array,
    log_shift: Array,
    *,
    chunk_size: int,
    return_log_normaliser: bool = False,
) -> tuple[Array, ...]:
    """Features, causal attention and normalisation in one compiled pass (``plan.fused``).

    Returns ``(outputs, kv, log_shift)`` with outputs normalised, in the compute dtype
    (and each output's log-normaliser when asked, for merging partials); it never holds
    an ``L x m`` feature array (the path for long sequences).  Torch CPU tensors run
    the same kernel through ``linattn::causal_fused_forward`` and differentiate through
    ``linattn::causal_fused_backward`` (outputs, final state and log-normaliser).  A
    fitted map's features are computed in the pass too, for NumPy arrays
    (:func:`fitted_kernel_arrays`; ``linattn._plan`` sends nothing else).
    """
    if feature_map.parameters is not None:
        from linattn_numba import cpu

        batch = broadcast_batch(q, k, v, key_mask, kv.shape[:-2], log_shift.shape[:-1])
        empty, fitted = fitted_kernel_arrays(feature_map, (*batch, *q.shape[-2:]), q.dtype)
        return cpu.favor_causal(
            q, k, v, empty, hyperbolic=False, scale=feature_map.scale, key_mask=key_mask,
            kv=kv, log_shift=log_shift, chunk_size=chunk_size,
            return_log_normaliser=return_log_normaliser, fitted=fitted,
        )  # fmt: skip
    assert feature_map.projection is not None
    if library_of(q) == "torch":
        import torch

        from linattn_numba import torch_ops as _torch

        # float64, as NumPy's pass scales it
        projection = torch_projection(feature_map.projection, torch.float64)
        hyperbolic = feature_map.kind == "hyperbolic"
        results = _torch.causal_fused(
            q, k, v, projection, key_mask, kv, log_shift, hyperbolic, feature_map.scale,
            chunk_size,
        )  # fmt: skip
        return results if return_log_normaliser else results[:3]
    from linattn_numba import cpu

    return cpu.favor_causal(
        q,
        k,
        v,
        feature_map.projection,
        hyperbolic=feature_map.kind == "hyperbolic",
        scale=feature_map.scale,
        key_mask=key_mask,
        kv=kv,
        log_shift=log_shift,
        chunk_size=chunk_size,
        return_log_normaliser=return_log_normaliser,
    )


def fused_causal_vjp(
    q: Array,
    k: Array,
    v: Array,
    feature_map: FeatureMap,
    key_mask: Array | None,
    grad_output: Array,
    *,
    chunk_size: int,
) -> tuple[Array, Array, Array]:
    """``(dq, dk, dv)`` of causal attention (no incoming state) by the fused forward and
    backward passes (``plan.fused``; :mod:`linattn_numba.cpu.fused_causal`): no ``L x m``
    array; over the broadcast batch shape, in the compute dtype.  Torch CPU tensors are
    read as NumPy views and the results wrapped without copies.

    Examples
    --------
    >>> import numpy as np
    >>> import linattn as la
    >>> x, g = np.zeros((1, 4, 8)), np.ones((1, 4, 8))  # equal features: running means
    >>> dq, dk, dv = fused_causal_vjp(x, x, x, la.FeatureMap(8, 16), None, g, chunk_size=2)
    >>> dv[0, :, 0].round(4).tolist()  # value t reaches outputs s >= t, weight 1 / (s + 1)
    [2.0833, 1.0833, 0.5833, 0.25]
    """
    return fused_causal_backward(
        q, k, v, feature_map, key_mask, None, grad_output, None, chunk_size=chunk_size
    )


def fused_causal_rows_vjp(
    q: Array,
    k: Array,
    v: Array,
    feature_map: FeatureMap,
    key_mask: Array | None,
    outputs: Array,
    grad_output: Array,
    grad_log_normaliser: Array,
    *,
    chunk_size: int,
) -> tuple[Array, Array, Array]:
    """``(dq, dk, dv)`` of the fused causal pass's normalised ``outputs`` and
    log-normaliser (from :func:`fused_causal`, no incoming state) for their cotangents:
    the fused backward alone (no forward), as the hybrid's far parts need it.

    Examples
    --------
    >>> import numpy as np
    >>> import linattn as la
    >>> x, g = np.zeros((1, 4, 8)), np.ones((1, 4, 8))
    >>> fm = la.FeatureMap(8, 16)
    >>> out, *_ = fused_causal(x, x, x, fm, None, np.zeros((1, 16, 9)),
    ...     np.full((1, 16), -np.inf), chunk_size=2)
    >>> dv = fused_causal_rows_vjp(x, x, x, fm, None, out, g, np.zeros((1, 4)), chunk_size=2)[2]
    >>> dv[0, :, 0].round(4).tolist()  # as fused_causal_vjp's
    [2.0833, 1.0833, 0.5833, 0.25]
    """
    return fused_causal_backward(
        q, k, v, feature_map, key_mask, outputs, grad_output, grad_log_normaliser,
        chunk_size=chunk_size,
    )  # fmt: skip


def fused_causal_backward(
    q: Array,
    k: Array,
    v: Array,
    feature_map: FeatureMap,
    key_mask: Array | None,
    outputs: Array | None,
    grad_output: Array,
    grad_log_normaliser: Array | None,
    *,
    chunk_size: int,
) -> tuple[Array, Array, Array]:
    """The fused backward from an empty state; ``outputs=None`` runs the forward first."""
    from linattn_numba.cpu import fused_causal, fused_causal_backward

    arrays: tuple[Any, ...] = (q, k, v, key_mask, outputs, grad_output, grad_log_normaliser)
    torch_in = library_of(q) == "torch"
    if torch_in:
        arrays = tuple(None if x is None else x.detach().numpy() for x in arrays)
    q, k, v, key_mask, outputs, grad_output, grad_log_normaliser = arrays
    projection, hyperbolic = fused_map_arrays(feature_map)
    batch = broadcast_batch(q, k, v, key_mask)
    m, dv = feature_map.num_features, v.shape[-1]
    dtype = grad_output.dtype
    kv = zeros_state(batch, m, dv, dtype)
    log_shift = empty_shift(batch, m, dtype)
    options: dict[str, Any] = {"hyperbolic": hyperbolic, "scale": feature_map.scale}
    options.update(key_mask=key_mask, chunk_size=chunk_size)
    if outputs is None:
        outputs, _, _, _ = fused_causal.forward(q, k, v, projection, kv, log_shift, **options)
    grads: tuple[Any, ...] = fused_causal_backward.backward(
        q, k, v, projection, kv, log_shift, outputs, grad_output, **options,
        grad_log_normaliser=grad_log_normaliser,
    )  # fmt: skip
    if torch_in:
        import torch

        grads = tuple(torch.from_numpy(g) for g in grads)
    return grads[0], grads[1], grads[2]
