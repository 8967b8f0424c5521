"""The decoding fast path of :func:`linattn.linear_attention`: a few tokens after a state.

A decoder calls ``linear_attention(q, k, v, fm, causal=True, state=s, return_state=True)``
once per generated token, with ``L = 1``.  The general path spends most of such a call
in checks, broadcasting and dispatch that do not depend on ``L``; this path serves the
common case with a handful of exact tests (types, dtypes, shapes that already agree) and
one compiled kernel (:func:`linattn_numba._decode.decode_step`), and caches what depends
only on the feature map.  Anything else (a broadcast, a mixed dtype, a wrong shape, an
unknown backend) returns ``None``, and the general path runs: its checks give the
errors, so an error reads the same whichever path the call was meant for.

It applies to causal calls with a state, at most :data:`MAX_TOKENS` new tokens, NumPy
float32 or float64 arrays of one dtype, leading shapes equal to the state's, a
``key_mask`` of exactly ``q.shape[:-1]`` (or none), and the maps the fused CPU pass
takes (:func:`linattn._dispatch.fused_map`), when the backend asked for is ``"auto"``
or ``"numba"`` and ``linattn_numba`` imports.  Its results equal the general path's
bit for bit (the fused pass's products on the same features).
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import numpy as np

from linattn import _dispatch
from linattn.features import FeatureMap
from linattn.state import LinearAttentionState

__all__ = ["MAX_TOKENS", "decode"]

#: The most new tokens per call that take this path: beyond, the general path's fixed
#: costs are small next to the work (one chunk of 16 tokens costs about as much as its
#: checks).
MAX_TOKENS = 16

#: Feature maps whose constants are kept (a projection copy each); beyond, the cache restarts.
MAX_CACHED_MAPS = 32

_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


class _MapConstants(NamedTuple):
    """What the kernel needs from a feature map, in one dtype."""

    head_dim: int
    num_features: int
    hyperbolic: bool
    projection: np.ndarray  # times sqrt(scale), contiguous, in the dtype
    consts: np.ndarray  # [scale / 2, log(m) / 2]


#: Per (fingerprint, dtype): the map's constants, or None when the fused pass cannot take
#: it.  The fingerprint covers kind, scale, sizes, statistics and projection, everything
#: that decides either.
_MAPS: dict[tuple[str, np.dtype], _MapConstants | None] = {}
_KERNEL: list[Any] = []


def _map_constants(feature_map: FeatureMap, dtype: np.dtype) -> _MapConstants | None:
    key = (feature_map.fingerprint, dtype)
    if key not in _MAPS:
        if len(_MAPS) >= MAX_CACHED_MAPS:  # (maps redrawn during training: no leak)
            _MAPS.clear()
        entry = None
        if _dispatch.fused_map(feature_map) and not feature_map.needs_calibration:
            scale = feature_map.scale
            projection = np.sqrt(scale) * feature_map.projection
            entry = _MapConstants(
                feature_map.head_dim,
                feature_map.num_features,
                feature_map.kind == "hyperbolic",
                np.ascontiguousarray(projection, dtype=dtype),
                np.array([0.5 * scale, 0.5 * np.log(feature_map.num_features)], dtype=dtype),
            )
            entry.projection.flags.writeable = False
        _MAPS[key] = entry
    return _MAPS[key]


def _kernel() -> Any:
    """:func:`linattn_numba._decode.decode_step`, or None where numba is missing."""
    if not _KERNEL:
        try:
            from linattn_numba import _decode as compiled
        except ImportError:
            _KERNEL.append(None)
        else:
            _KERNEL.append(compiled.decode_step)
    return _KERNEL[0]


def _count(x: object) -> bool:
    """A non-negative Python or NumPy integer (not a bool)."""
    return not isinstance(x, bool) and isinstance(x, int | np.integer) and bool(x >= 0)


def decode(
    q: Any,
    k: Any,
    v: Any,
    feature_map: Any,
    *,
    causal: Any,
    key_mask: Any,
    state: Any,
    return_state: Any,
    chunk_size: Any,
    backend: Any,
) -> Any:
    """``linear_attention``'s result for a few tokens after a state, or ``None``.

    Takes :func:`linattn.linear_attention`'s arguments; ``None`` means "not this
    path" (the general path then runs and raises any error).

    Examples
    --------
    >>> import numpy as np
    >>> import linattn as la
    >>> fm = la.FeatureMap(8, 16, seed=0)
    >>> x = np.random.default_rng(0).normal(size=(2, 5, 8))
    >>> _, state = la.linear_attention(x, x, x, fm, causal=True, return_state=True)
    >>> t = x[:, -1:]
    >>> out, after = decode(t, t, t, fm, causal=True, key_mask=None, state=state,
    ...     return_state=True, chunk_size=64, backend=None)
    >>> out.shape, after.num_tokens
    ((2, 1, 8), 6)
    >>> decode(t, t, t, fm, causal=True, key_mask=None, state=state,
    ...     return_state=True, chunk_size=64, backend="array_api") is None
    True
    """
    if (
        causal is not True
        or not isinstance(state, LinearAttentionState)
        or state.window is not None
        or state.sink_keys
        or not isinstance(feature_map, FeatureMap)
        or not (return_state is True or return_state is False)
        or not (type(q) is np.ndarray and type(k) is np.ndarray and type(v) is np.ndarray)
    ):
        return None
    kv, log_shift = state.kv, state.log_shift
    dtype = q.dtype
    if (
        type(kv) is not np.ndarray
        or type(log_shift) is not np.ndarray
        or dtype not in _DTYPES
        or not (k.dtype == v.dtype == kv.dtype == log_shift.dtype == dtype)
    ):
        return None
    shape = q.shape
    if len(shape) < 2 or not 1 <= shape[-2] <= MAX_TOKENS or k.shape != shape:
        return None
    batch, length = shape[:-2], shape[-2]
    value_dim = v.shape[-1]
    if v.shape[:-1] != shape[:-1] or value_dim < 1:
        return None
    if key_mask is not None and (
        type(key_mask) is not np.ndarray
        or key_mask.dtype != np.bool_
        or key_mask.shape != shape[:-1]
    ):
        return None
    constants = _map_constants(feature_map, dtype)
    if constants is None or shape[-1] != constants.head_dim:
        return None
    m = constants.num_features
    if (
        state.feature_map != feature_map.fingerprint
        or kv.shape != (*batch, m, value_dim + 1)
        or log_shift.shape != (*batch, m)
        or not _count(state.num_tokens)
        or not (chunk_size is None or (_count(chunk_size) and chunk_size != 0))
    ):
        return None
    if backend is None:
        backend = os.environ.get(_dispatch.ENVIRONMENT_VARIABLE, "auto")
    if backend not in ("auto", "numba") or (step := _kernel()) is None:
        return None
    out, kv, log_shift = step(
        q,
        k,
        v,
        key_mask,
        constants.projection,
        hyperbolic=constants.hyperbolic,
        scale=feature_map.scale,
        kv=kv,
        log_shift=log_shift,
        chunk_size=_dispatch.CPU_FORWARD_CHUNK_SIZE if chunk_size is None else chunk_size,
        consts=constants.consts,
    )
    if not return_state:
        return out
    return out, LinearAttentionState(
        kv=kv,
        log_shift=log_shift,
        feature_map=state.feature_map,
        num_tokens=state.num_tokens + length,
    )
