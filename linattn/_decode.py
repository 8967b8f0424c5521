"""The decoding fast path of :func:`linattn.linear_attention`: a few tokens after a state.

A decoder calls ``linear_attention(q, k, v, fm, causal=True, state=s, return_state=True)``
once per generated token, with ``L = 1``.  The general path spends most of such a call
in checks, broadcasting and dispatch that do not depend on ``L``; this path serves the
common case with a handful of exact tests (types, dtypes, shapes that already agree) and
one compiled kernel (:func:`linattn._dispatch.decode_kernel`), and caches what depends
only on the feature map.  Anything else (a broadcast, a mixed dtype, a wrong shape, an
unknown backend) is a reason of :func:`why_not` (``linattn._plan`` asks it), and the
general path runs: its checks give the errors, so an error reads the same whichever
path the call was meant for.

It applies to causal calls with a state, at most :data:`MAX_TOKENS` new tokens, NumPy
float32 or float64 arrays of one dtype, leading shapes equal to the state's, a
``key_mask`` of exactly ``q.shape[:-1]`` (or none), and the maps the fused CPU pass
takes (:func:`linattn._dispatch.fused_map`, and fitted maps), when the backend asked
for is ``"auto"`` or ``"numba"`` and ``linattn_numba`` imports.  Its results equal the
general path's bit for bit (the fused pass's products on the same features).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from linattn import _dispatch, fitted
from linattn.features import FeatureMap
from linattn.state import LinearAttentionState

__all__ = ["MAX_TOKENS", "map_constants", "step", "why_not"]

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
    projection: np.ndarray  # times sqrt(scale), contiguous, in the dtype (fitted: (0, d))
    consts: np.ndarray  # [scale / 2, log(m) / 2]
    fitted: bool  # a fitted map: its parameters, per batch shape (_fitted_operands)


#: Per (fingerprint, dtype): the map's constants, or None when the fused pass cannot take
#: it.  The fingerprint covers kind, scale, sizes, statistics and projection, everything
#: that decides either.
_MAPS: dict[tuple[str, np.dtype], _MapConstants | None] = {}


def map_constants(feature_map: FeatureMap, dtype: np.dtype) -> _MapConstants | None:
    key = (feature_map.fingerprint, dtype)
    if key not in _MAPS:
        if len(_MAPS) >= MAX_CACHED_MAPS:  # (maps redrawn during training: no leak)
            _MAPS.clear()
        entry = None
        scale, m = feature_map.scale, feature_map.num_features
        consts = np.array([0.5 * scale, 0.5 * np.log(m)], dtype=dtype)
        if feature_map.parameters is not None:
            projection = np.zeros((0, feature_map.head_dim), dtype)
            entry = _MapConstants(feature_map.head_dim, m, False, projection, consts, True)
        elif _dispatch.fused_map(feature_map) and not feature_map.needs_calibration:
            projection = np.sqrt(scale) * feature_map.projection
            entry = _MapConstants(
                feature_map.head_dim,
                m,
                feature_map.kind == "hyperbolic",
                np.ascontiguousarray(projection, dtype=dtype),
                consts,
                False,
            )
            entry.projection.flags.writeable = False
        _MAPS[key] = entry
    return _MAPS[key]


#: Per (fingerprint, dtype, batch shape): a fitted map's kernel operands (``step``).
_FITTED: dict[tuple[str, np.dtype, tuple[int, ...]], tuple[np.ndarray, np.ndarray]] = {}
#: Per (fingerprint, shape): whether a fitted map's heads meet inputs of that shape.
_MEETS: dict[tuple[str, tuple[int, ...]], bool] = {}


def _fitted_heads_meet(feature_map: FeatureMap, shape: tuple[int, ...]) -> bool:
    """A fitted map's parameters broadcast to inputs of ``shape`` (else the general path
    runs, and its checks raise the error)."""
    key = (feature_map.fingerprint, tuple(shape))
    if key not in _MEETS:
        if len(_MEETS) >= MAX_CACHED_MAPS:
            _MEETS.clear()
        assert feature_map.parameters is not None
        try:
            fitted.kernel_parameters(feature_map.parameters, tuple(shape))
        except ValueError:
            _MEETS[key] = False
        else:
            _MEETS[key] = True
    return _MEETS[key]


def _fitted_operands(
    feature_map: FeatureMap, shape: tuple[int, ...], dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray]:
    """A fitted map's ``(weights, biases)`` for inputs of ``shape``, as the kernel takes
    them (:func:`linattn._dispatch.fitted_decode_operands`), kept per batch shape."""
    key = (feature_map.fingerprint, dtype, tuple(shape[:-2]))
    if key not in _FITTED:
        if len(_FITTED) >= MAX_CACHED_MAPS:
            _FITTED.clear()
        _FITTED[key] = _dispatch.fitted_decode_operands(feature_map, shape, dtype)
    return _FITTED[key]


def _count(x: object) -> bool:
    """A non-negative Python or NumPy integer (not a bool)."""
    return not isinstance(x, bool) and isinstance(x, int | np.integer) and bool(x >= 0)


def why_not(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    feature_map: FeatureMap,
    key_mask: np.ndarray | None,
    state: LinearAttentionState,
    chunk_size: Any,
) -> str | None:
    """Why the decoding step cannot take these NumPy arrays, or ``None`` where it can.

    Exact tests only (types, dtypes, shapes that already agree): anything else goes to
    the general path, whose checks give the errors.

    Examples
    --------
    >>> import numpy as np
    >>> import linattn as la
    >>> fm = la.FeatureMap(8, 16, seed=0)
    >>> x = np.random.default_rng(0).normal(size=(2, 5, 8))
    >>> _, state = la.linear_attention(x, x, x, fm, causal=True, return_state=True)
    >>> t = x[:, -1:]
    >>> why_not(t, t, t, fm, None, state, None) is None
    True
    >>> why_not(t.astype(np.float32), t, t, fm, None, state, None)
    'q, k, v and the state are not of one float dtype'
    """
    kv, log_shift = state.kv, state.log_shift
    dtype = q.dtype
    if dtype not in _DTYPES or not (k.dtype == v.dtype == kv.dtype == log_shift.dtype == dtype):
        return "q, k, v and the state are not of one float dtype"
    shape = q.shape
    if len(shape) < 2 or not 1 <= shape[-2] <= MAX_TOKENS or k.shape != shape:
        return f"not 1 to {MAX_TOKENS} new tokens with k shaped like q"
    batch, value_dim = shape[:-2], v.shape[-1]
    if v.shape[:-1] != shape[:-1] or value_dim < 1:
        return "v not shaped like q"
    if key_mask is not None and (key_mask.dtype != np.bool_ or key_mask.shape != shape[:-1]):
        return "key_mask not a boolean array of q.shape[:-1]"
    constants = map_constants(feature_map, dtype)
    if constants is None or shape[-1] != constants.head_dim:
        return "a map the fused pass does not compute"
    if constants.fitted and not _fitted_heads_meet(feature_map, shape):
        return "a fitted map whose heads do not meet q"
    m = constants.num_features
    if (
        state.feature_map != feature_map.fingerprint
        or kv.shape != (*batch, m, value_dim + 1)
        or log_shift.shape != (*batch, m)
        or not _count(state.num_tokens)
        or not (chunk_size is None or (_count(chunk_size) and chunk_size != 0))
    ):
        return "a state or chunk_size that does not match the call as it is"
    return None


def step(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    feature_map: FeatureMap,
    key_mask: np.ndarray | None,
    state: LinearAttentionState,
    chunk_size: int | None,
) -> tuple[np.ndarray, LinearAttentionState]:
    """The outputs of a few tokens after ``state``, and the state after them, in one
    kernel call; for the arguments :func:`why_not` accepts."""
    constants = map_constants(feature_map, q.dtype)
    assert constants is not None
    kernel = _dispatch.decode_kernel()
    assert kernel is not None  # (the plan asked for it)
    out, kv, log_shift = kernel(
        q,
        k,
        v,
        key_mask,
        constants.projection,
        hyperbolic=constants.hyperbolic,
        scale=feature_map.scale,
        kv=state.kv,
        log_shift=state.log_shift,
        chunk_size=_dispatch.CPU_FORWARD_CHUNK_SIZE if chunk_size is None else chunk_size,
        consts=constants.consts,
        fitted=_fitted_operands(feature_map, q.shape, q.dtype) if constants.fitted else None,
    )
    return out, LinearAttentionState(
        kv=kv,
        log_shift=log_shift,
        feature_map=state.feature_map,
        num_tokens=state.num_tokens + q.shape[-2],
    )
