"""The parts of one call: the exact parts asked for, checked (:func:`check_exact_parts`),
and the parts built for causal (:func:`causal_parts`, with the new state's caches) and
bidirectional attention (:func:`bidirectional_parts`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from linattn import _dispatch
from linattn._xp import Array, Namespace, array_device, is_dask_array, is_traced
from linattn.hybrid.parts import ExactKeysPart, FarPart, Part, WindowPart, no_keys, zero_rows
from linattn.state import empty_state

__all__ = [
    "ExactParts",
    "bidirectional_parts",
    "causal_parts",
    "check_counts",
    "check_exact_parts",
    "state_arrays",
]


@dataclass(frozen=True)
class ExactParts:
    """The exact parts a call asked for (``window``, ``sink_keys``, ``exact_key_mask``)."""

    window: int | None
    sink_keys: int
    exact_key_mask: Array | None

    @property
    def lag(self) -> int:
        """How far the far keys lag their queries: the window (0 without one)."""
        return self.window or 0

    def within(self, length: int) -> ExactParts:
        """The same attention for a call of ``length`` keys and no state: a window or
        sinks beyond them cover them all (``window=10**6`` on 10 tokens padded its
        band to a million keys: 58 TiB)."""
        window = None if self.window is None else min(self.window, length)
        return ExactParts(window, min(self.sink_keys, length), self.exact_key_mask)


def _positive_int(name: str, value: object, *, allow_zero: bool) -> int:
    low = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
        expected = "a non-negative integer" if allow_zero else "a positive integer or None"
        raise ValueError(f"{name} must be {expected}; got {value!r}")
    return int(value)


def check_counts(window: object, sink_keys: object) -> None:
    """``window`` a positive integer or None, ``sink_keys`` a non-negative integer (what
    every path, compiled ones included, must be given)."""
    if window is not None:
        _positive_int("window", window, allow_zero=False)
    if sink_keys != 0:
        _positive_int("sink_keys", sink_keys, allow_zero=True)


def check_exact_parts(
    window: object,
    sink_keys: object,
    exact_key_mask: Array | None,
    *,
    xp: Namespace,
    causal: bool,
    state: Any,
    query_length: int,
    key_length: int,
    k: Array,
) -> ExactParts | None:
    """The exact parts asked for, checked; ``None`` when none is (plain linear attention)."""
    w = None if window is None else _positive_int("window", window, allow_zero=False)
    s = _positive_int("sink_keys", sink_keys, allow_zero=True)
    if exact_key_mask is not None:
        if causal or state is not None:
            raise ValueError(
                "exact_key_mask is for bidirectional attention (a causal query's exact keys "
                "are its window and the sinks); got it with "
                f"causal={causal}, state={'given' if state is not None else None}"
            )
        if exact_key_mask.dtype != xp.bool:
            raise TypeError(
                f"exact_key_mask must be a boolean array; got dtype {exact_key_mask.dtype}"
            )
        if exact_key_mask.ndim not in (1, k.ndim - 1) or exact_key_mask.shape[-1] != key_length:
            raise ValueError(
                f"exact_key_mask must have shape ({key_length},) or {k.ndim - 1} axes "
                f"ending in {key_length} (like key_mask); got shape "
                f"{tuple(exact_key_mask.shape)} for k shape {tuple(k.shape)}"
            )
    if w is None and s == 0 and exact_key_mask is None:
        if state is not None and (state.window is not None or state.sink_keys):
            raise ValueError(_continuation_error(state, None, 0))
        return None
    if query_length != key_length and state is None:
        raise ValueError(
            "window and sink_keys need queries and keys of the same length (positions are "
            f"shared), or a causal state; got q length {query_length} and k length "
            f"{key_length}"
        )
    if state is not None and (state.window != w or state.sink_keys != s):
        raise ValueError(_continuation_error(state, w, s))
    return ExactParts(w, s, exact_key_mask)


def _continuation_error(state: Any, window: int | None, sink_keys: int) -> str:
    return (
        f"state was made with window={state.window}, sink_keys={state.sink_keys}; a "
        f"sequence must continue with the same options, got window={window}, "
        f"sink_keys={sink_keys}"
    )


def _positions(xp: Namespace, start: Any, count: int, device: Any) -> Array:
    """Absolute positions ``start .. start + count - 1`` (``start`` an int or a 0-d array)."""
    offsets = xp.arange(count, device=device)
    if isinstance(start, int | np.integer):
        return offsets + int(start)
    return offsets + xp.astype(start, offsets.dtype)


def _pad_keys(xp: Namespace, x: Array, before: int, after: int) -> Array:
    """``x`` with ``before`` and ``after`` zero rows (``False`` for a keep array)."""
    if x.dtype == xp.bool:
        shape = tuple(x.shape[:-1])
        device = array_device(x)
        pieces = [no_keys(xp, (*shape, before), device), x, no_keys(xp, (*shape, after), device)]
        return xp.concat([p for p in pieces if p.shape[-1]], axis=-1)
    shape = tuple(x.shape[:-2])
    pieces = [
        zero_rows(xp, (*shape, before, x.shape[-1]), x),
        x,
        zero_rows(xp, (*shape, after, x.shape[-1]), x),
    ]
    return xp.concat([p for p in pieces if p.shape[-2]], axis=-2)


def _scatter_first(xp: Namespace, length: int) -> Any:
    """The adjoint of taking the first rows of ``length`` (padded): cut or pad the cotangent."""

    def adjoint(d: Array) -> Array:
        rows = d.shape[-2]
        return d[..., :length, :] if rows >= length else _pad_keys(xp, d, 0, length - rows)

    return adjoint


def causal_parts(
    xp: Namespace,
    q: Array,
    k: Array,
    v: Array,
    keep: Array,
    parts: ExactParts,
    feature_map: Any,
    state: Any,
    *,
    scale: float,
    statistics: Any,
    chunk_size: int,
    plan: _dispatch.Plan,
) -> tuple[list[Part], dict[str, Any]]:
    """The parts of causal hybrid attention and the new state's exact caches.

    Keys are indexed by absolute position ``n + i`` (``n = state.num_tokens``).  The
    extended keys ``E`` are the state's last ``w`` keys followed by this call's, so
    ``E[e]`` is position ``n - w + e``: query ``i`` has window ``E[i + 1 .. i + w]`` and
    far keys ``E[0 .. i]`` on top of the state (the causal pass over ``E[:T]``).
    """
    length, d, dv = q.shape[-2], q.shape[-1], v.shape[-1]
    batch = tuple(q.shape[:-2])
    device = array_device(q)
    w, s = parts.lag, parts.sink_keys
    n = 0 if state is None else state.num_tokens
    recent = None if state is None else state.recent
    if recent is None:
        recent = (
            zero_rows(xp, (*batch, w, d), q),
            zero_rows(xp, (*batch, w, dv), q),
            no_keys(xp, (*batch, w), device),
        )
    lead = (
        xp.broadcast_to(recent[0], (*batch, w, d)),
        xp.broadcast_to(recent[1], (*batch, w, dv)),
        xp.broadcast_to(recent[2], (*batch, w)),
    )
    not_sink = _positions(xp, n - w, w + length, device) >= s
    kept = xp.logical_and(xp.concat([lead[2], keep], axis=-1), not_sink)
    found: list[Part] = []
    sinks = None
    if s:
        sinks = _updated_sinks(xp, state, k, v, keep, n, s)
        seen = _positions(xp, 0, s, device)[None, :] <= _positions(xp, n, length, device)[:, None]
        visible = xp.logical_and(seen, sinks[2][..., None, :])
        # Without a state the sinks are the call's first keys (and take their gradients).
        scatter = _scatter_first(xp, length) if state is None else _no_gradient
        found.append(ExactKeysPart(q, sinks[0], sinks[1], visible, scale, scatter))
    if w:
        found.append(
            WindowPart(
                q, k, v, kept, w, scale, before=(lead[0], lead[1]),
                kernel=_dispatch.window_kernel_for(q, plan.backend),
            )
        )  # fmt: skip
    fields: dict[str, Any] = {"kv": None, "log_shift": None, "sinks": sinks, "recent": None}
    if w:  # the last w keys of the cache followed by the call's
        fields["recent"] = (
            _last_rows(xp, lead[0], k, w),
            _last_rows(xp, lead[1], v, w),
            xp.concat([lead[2], keep], axis=-1)[..., length:],
        )
    if feature_map is not None:
        kv, log_shift = state_arrays(xp, state, feature_map, batch, dv, q)
        far = FarPart(
            q,
            k,
            v,
            xp.logical_and(keep, not_sink[w:]),
            feature_map,
            statistics,
            causal=True,
            lag=w,
            reverse=False,
            chunk_size=chunk_size,
            plan=plan,
            kv=kv,
            log_shift=log_shift,
            lead=None if state is None else (lead[0], lead[1], kept[..., :w]),
        )
        found.append(far)
    return found, fields


def _last_rows(xp: Namespace, lead: Array, x: Array, count: int) -> Array:
    """The last ``count`` rows of ``lead`` followed by ``x`` (a view where ``x`` has them)."""
    length = x.shape[-2]
    if length >= count:
        return x[..., length - count :, :]
    return xp.concat([lead[..., length:, :], x], axis=-2)


def _no_gradient(d: Array) -> None:
    """Sinks from a state: no cotangent reaches this call's inputs (no VJP with a state)."""
    return None


def state_arrays(
    xp: Namespace, state: Any, feature_map: Any, batch: tuple[int, ...], dv: int, like: Array
) -> tuple[Array, Array]:
    """The far keys' ``(kv, log_shift)`` from ``state``, broadcast to ``batch``, or empty."""
    m = feature_map.num_features
    if state is None:
        return empty_state(xp, batch, m, dv, like)
    return (
        xp.broadcast_to(state.kv, (*batch, m, dv + 1)),
        xp.broadcast_to(state.log_shift, (*batch, m)),
    )


def _updated_sinks(
    xp: Namespace, state: Any, k: Array, v: Array, keep: Array, n: Any, s: int
) -> tuple[Array, Array, Array]:
    """Keys, values and keep of positions ``0 .. s - 1`` after this call's tokens.

    Written with selections and a gather, not slices by ``n``: under ``jax.jit`` the
    state's ``num_tokens`` is a traced value.
    """
    batch, length = tuple(k.shape[:-2]), k.shape[-2]
    device = array_device(k)
    index = _positions(xp, 0, s, device)
    index = index - (int(n) if isinstance(n, int | np.integer) else xp.astype(n, index.dtype))
    arrived = xp.logical_and(index >= 0, index < length)
    take = xp.clip(index, 0, length - 1)
    new_k = xp.take(k, take, axis=-2)
    new_v = xp.take(v, take, axis=-2)
    new_keep = xp.take(keep, take, axis=-1)
    if state is None:  # the call's first keys, as they are (and their gradients)
        n = min(s, length)  # (slices stay within bounds: the array API leaves others open)
        return tuple(
            _pad_keys(xp, x, 0, s - n) for x in (k[..., :n, :], v[..., :n, :], keep[..., :n])
        )
    if state.sinks is None:
        old_k = zero_rows(xp, (*batch, s, k.shape[-1]), k)
        old_v = zero_rows(xp, (*batch, s, v.shape[-1]), v)
        old_keep = no_keys(xp, (*batch, s), device)
    else:
        old_k, old_v, old_keep = state.sinks
    return (
        xp.where(arrived[:, None], new_k, old_k),
        xp.where(arrived[:, None], new_v, old_v),
        xp.where(arrived, new_keep, xp.broadcast_to(old_keep, (*batch, s))),
    )


def bidirectional_parts(
    xp: Namespace,
    q: Array,
    k: Array,
    v: Array,
    keep: Array,
    parts: ExactParts,
    feature_map: Any,
    *,
    scale: float,
    statistics: Any,
    chunk_size: int,
    plan: _dispatch.Plan,
) -> list[Part]:
    """The parts of bidirectional hybrid attention; inputs broadcast to one batch.

    The far keys of a window are two lagged causal passes, forward (``j <= t - w``) and
    on the reversed sequence (``j >= t + w``): never one global state minus the window.
    """
    length = q.shape[-2]
    batch = tuple(q.shape[:-2])
    device = array_device(q)
    w, s = parts.lag, parts.sink_keys
    exact = _positions(xp, 0, length, device) < s
    if parts.exact_key_mask is not None:
        exact = xp.logical_or(exact, parts.exact_key_mask)
    exact = xp.broadcast_to(exact, (*batch, length))
    found: list[Part] = []
    if s or parts.exact_key_mask is not None:
        found.append(_exact_keys_part(xp, q, k, v, xp.logical_and(keep, exact), s, parts, scale))
    rest = xp.logical_and(keep, xp.logical_not(exact))
    if w:
        zeros = [
            zero_rows(xp, (*x.shape[:-2], rows, x.shape[-1]), x)
            for x in (k, v)
            for rows in (w, w - 1)
        ]
        found.append(
            WindowPart(
                q, k, v, _pad_keys(xp, rest, w, w - 1), 2 * w - 1, scale,
                before=(zeros[0], zeros[2]), after=(zeros[1], zeros[3]),
                kernel=_dispatch.window_kernel_for(q, plan.backend),
            )
        )  # fmt: skip
    if feature_map is not None:
        kv, log_shift = state_arrays(xp, None, feature_map, batch, v.shape[-1], q)
        for reverse in (False, True) if w else (False,):
            found.append(
                FarPart(
                    q,
                    k,
                    v,
                    rest,
                    feature_map,
                    statistics,
                    causal=bool(w),
                    lag=w,
                    reverse=reverse,
                    chunk_size=chunk_size,
                    plan=plan,
                    kv=kv,
                    log_shift=log_shift,
                )
            )
    return found


def _exact_keys_part(
    xp: Namespace,
    q: Array,
    k: Array,
    v: Array,
    chosen: Array,
    s: int,
    parts: ExactParts,
    scale: float,
) -> Part:
    """Every query against the exact keys (sinks, ``exact_key_mask``), gathered first.

    Sinks alone are the first ``s`` keys.  Otherwise each batch row's chosen keys are
    gathered (a one-hot product, portable and differentiable) into ``E`` slots, ``E``
    the largest count in the batch (every key while tracing, where counts are unknown).
    """
    length = k.shape[-2]
    if parts.exact_key_mask is None:
        s = min(s, length)
        visible = xp.broadcast_to(chosen[..., None, :s], (*chosen.shape[:-1], length, s))
        return ExactKeysPart(
            q, k[..., :s, :], v[..., :s, :], visible, scale, _scatter_first(xp, length)
        )
    count = _static_count(xp, chosen, length)
    rank = xp.argsort(xp.astype(xp.logical_not(chosen), xp.int8), axis=-1, stable=True)
    rank = rank[..., :count]
    where_from = rank[..., :, None] == xp.arange(length, device=array_device(k))
    select = xp.astype(where_from, k.dtype)  # (..., E, L)
    kept = xp.any(xp.logical_and(where_from, chosen[..., None, :]), axis=-1)
    visible = xp.broadcast_to(kept[..., None, :], (*kept.shape[:-1], length, count))
    return ExactKeysPart(
        q,
        xp.matmul(select, k),
        xp.matmul(select, v),
        visible,
        scale,
        lambda d: xp.matmul(xp.matrix_transpose(select), d),
    )


def _static_count(xp: Namespace, chosen: Array, length: int) -> int:
    """The largest number of chosen keys in a row, or ``length`` when it is not known."""
    if is_traced(chosen) or is_dask_array(chosen):
        return length
    try:
        return max(1, int(xp.max(xp.sum(xp.astype(chosen, xp.int32), axis=-1))))
    except Exception:  # a tracing framework that cannot give the value (torch.compile)
        return length
