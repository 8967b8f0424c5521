"""Argument checks for the attention front door: one place, run before any computation.

Every error names the argument, what was expected and what was given.  Compiled
kernels are only reached after these checks pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from linattn._xp import Array, Namespace, device_of, float_dtype, namespace_of

__all__ = [
    "AttentionInputs",
    "broadcast_shapes",
    "check_attention_inputs",
    "check_chunk_size",
    "check_key_mask",
    "check_map_scale",
    "check_query_mask",
    "check_scale",
    "check_state_options",
    "check_statistics_for_causal",
    "key_mask_batch_shape",
]


@dataclass(frozen=True)
class AttentionInputs:
    """Validated inputs: their namespace, device, dtypes and the broadcast batch shape."""

    xp: Namespace
    device: Any
    dtype: Any  # the result's dtype
    batch_shape: tuple[int, ...]
    query_length: int
    key_length: int
    query_head_dim: int
    value_dim: int


def broadcast_shapes(named: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    """NumPy broadcasting of the named leading shapes, with an error naming all of them."""
    try:
        return tuple(int(n) for n in np.broadcast_shapes(*named.values()))
    except ValueError:
        listing = ", ".join(f"{name} {shape}" for name, shape in named.items())
        raise ValueError(
            f"leading (batch) dimensions must broadcast together; got {listing}"
        ) from None


def check_chunk_size(chunk_size: object, default: int | None = None) -> int:
    """``chunk_size`` as an int; ``None`` is ``default`` (where the caller has one)."""
    if chunk_size is None and default is not None:
        return default
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int | np.integer):
        raise TypeError(f"chunk_size must be a positive integer or None; got {chunk_size!r}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer or None; got {chunk_size}")
    return int(chunk_size)


def check_scale(scale: object, head_dim: int) -> float:
    """The softmax scale as a float: ``scale`` if a positive finite number, else ``1/sqrt(d)``."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if (
        isinstance(scale, bool | np.bool_)
        or not isinstance(scale, int | float | np.floating | np.integer)
        or not (math.isfinite(scale) and scale > 0)
    ):
        raise ValueError(f"scale must be a positive finite number; got {scale!r}")
    return float(scale)


#: How far a ``scale`` given beside a feature map may be from the map's own: a few float32
#: rounding steps (``1/sqrt(d)`` rounded to float32 and back is the same scale).
SCALE_TOLERANCE = 1e-6


def check_map_scale(scale: object, map_scale: float) -> float:
    """The map's ``scale``: ``scale`` may be None or the map's own, to within
    :data:`SCALE_TOLERANCE` (relative); anything else names both.

    Examples
    --------
    >>> import numpy as np
    >>> check_map_scale(np.float32(0.125), 0.125) == check_map_scale(None, 0.125) == 0.125
    True
    >>> check_map_scale(float(np.float32(8**-0.5)), 8**-0.5) == 8**-0.5
    True
    """
    if scale is None:
        return map_scale
    value = check_scale(scale, 1)
    if not math.isclose(value, map_scale, rel_tol=SCALE_TOLERANCE):
        raise ValueError(
            f"scale is the feature map's ({map_scale}) when one is given; got {scale!r}"
        )
    return map_scale


def key_mask_batch_shape(key_mask: Array, k: Array) -> tuple[int, ...]:
    """The batch shape of ``key_mask`` broadcast against ``k``'s (``ValueError`` naming both)."""
    return broadcast_shapes({"key_mask": tuple(key_mask.shape[:-1]), "k": tuple(k.shape[:-2])})


def check_key_mask(
    xp: Namespace, key_mask: Array, key_length: int, *, k: Array, q: Array | None = None
) -> None:
    """``key_mask`` is boolean, ``(key_length,)`` or with exactly ``k.ndim - 1`` axes.

    The rank rule exists because masks broadcast right-aligned against ``k``'s batch axes:
    a ``(B, L)`` mask for ``(B, H, L, d)`` keys would be read as a mask over *heads*
    (wrong answers when ``B == H``); such a mask must be given as ``(B, 1, L)``.
    """
    if key_mask.dtype != xp.bool:
        raise TypeError(f"key_mask must be a boolean array; got dtype {key_mask.dtype}")
    if key_mask.ndim < 1 or key_mask.shape[-1] != key_length:
        raise ValueError(
            f"key_mask must have shape (..., {key_length}) to match the key length; "
            f"got shape {tuple(key_mask.shape)}"
        )
    if key_mask.ndim not in (1, k.ndim - 1):
        queries = "" if q is None else f" and q shape {tuple(q.shape)}"
        hint = (
            " (for a (batch, length) mask of (batch, heads, length, d) keys, pass "
            "key_mask[:, None, :])"
            if key_mask.ndim == 2 and k.ndim == 4
            else ""
        )
        raise ValueError(
            f"key_mask must have shape ({key_length},) or exactly {k.ndim - 1} axes "
            f"(k.ndim - 1, its leading axes broadcasting with the batch axes); got "
            f"key_mask shape {tuple(key_mask.shape)} for k shape {tuple(k.shape)}"
            f"{queries}{hint}"
        )


def check_query_mask(xp: Namespace, query_mask: Array, q: Array) -> None:
    """``query_mask`` is boolean, ``(L_q,)`` or ``q.ndim - 1`` axes broadcasting with ``q``'s."""
    if query_mask.dtype != xp.bool:
        raise TypeError(f"query_mask must be a boolean array; got dtype {query_mask.dtype}")
    length = q.shape[-2]
    if query_mask.ndim not in (1, q.ndim - 1) or query_mask.shape[-1] != length:
        raise ValueError(
            f"query_mask must have shape ({length},) or {q.ndim - 1} axes ending in "
            f"{length} (q.ndim - 1); got query_mask shape {tuple(query_mask.shape)} for q "
            f"shape {tuple(q.shape)}"
        )
    broadcast_shapes({"query_mask": tuple(query_mask.shape[:-1]), "q": tuple(q.shape[:-2])})


def check_attention_inputs(
    q: Array,
    k: Array,
    v: Array,
    *,
    key_mask: Array | None,
    causal: bool,
    head_dim: int | None,
    extra: dict[str, Array] | None = None,
) -> AttentionInputs:
    """Check q, k, v (and key_mask) and return what the computation needs to know."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False; got {causal!r}")
    arrays = {"q": q, "k": k, "v": v, "key_mask": key_mask, **(extra or {})}
    xp = namespace_of(arrays, optional=("key_mask",))
    device = device_of(**arrays)
    for name, x in (("q", q), ("k", k), ("v", v)):
        float_dtype(xp, name, x)
        if x.ndim < 2:
            raise ValueError(
                f"{name} must have at least 2 dimensions (..., length, features); "
                f"got shape {tuple(x.shape)}"
            )
        if x.shape[-2] == 0:
            raise ValueError(f"{name} must have at least one position; got shape {tuple(x.shape)}")
        if x.shape[-1] == 0:
            raise ValueError(f"{name} must have at least one feature; got shape {tuple(x.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q and k must have the same head dimension; got q shape {tuple(q.shape)} "
            f"and k shape {tuple(k.shape)}"
        )
    if head_dim is not None and q.shape[-1] != head_dim:
        raise ValueError(
            f"q and k must have head dimension {head_dim} to match feature_map.head_dim; "
            f"got {q.shape[-1]}"
        )
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"k and v must have the same length; got k shape {tuple(k.shape)} and "
            f"v shape {tuple(v.shape)}"
        )
    if causal and q.shape[-2] != k.shape[-2]:
        raise ValueError(
            "causal attention needs queries and keys of the same length; got q length "
            f"{q.shape[-2]} and k length {k.shape[-2]}"
        )
    leading = {"q": tuple(q.shape[:-2]), "k": tuple(k.shape[:-2]), "v": tuple(v.shape[:-2])}
    if key_mask is not None:
        check_key_mask(xp, key_mask, k.shape[-2], k=k, q=q)
        leading["key_mask"] = tuple(key_mask.shape[:-1])
    batch_shape = broadcast_shapes(leading)
    dtype = xp.result_type(q.dtype, k.dtype, v.dtype)
    return AttentionInputs(
        xp=xp,
        device=device,
        dtype=dtype,
        batch_shape=batch_shape,
        query_length=int(q.shape[-2]),
        key_length=int(k.shape[-2]),
        query_head_dim=int(q.shape[-1]),
        value_dim=int(v.shape[-1]),
    )


def check_state_options(causal: bool, state: object, return_state: object) -> None:
    """``return_state`` is a bool; ``state`` and ``return_state`` only with ``causal``."""
    if not isinstance(return_state, bool):
        raise TypeError(f"return_state must be True or False; got {return_state!r}")
    if not causal and (state is not None or return_state):
        raise ValueError(
            "state and return_state need causal=True (bidirectional attention has no "
            f"running state); got state={'given' if state is not None else None}, "
            f"return_state={return_state}"
        )


def check_statistics_for_causal(kind: str, needs_calibration: bool, causal: bool) -> None:
    """Causal attention needs a map's statistics fixed in advance."""
    if causal and needs_calibration:
        raise ValueError(
            f"causal attention needs the {kind!r} feature map's query/key "
            "statistics fixed in advance (statistics over the whole sequence would let "
            "later tokens change earlier outputs): expected a map from "
            "feature_map.calibrate(q, k) or with_statistics(...), got an uncalibrated one"
        )
