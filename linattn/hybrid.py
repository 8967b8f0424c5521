"""Exact attention where the mass concentrates, random features for the rest.

Attention in pretrained models puts most of its mass on a few neighbours and on a few
"sink" keys (the first tokens, ``[CLS]``, ``[SEP]``); random features spread their
variance over every key alike.  The hybrid (``docs/algorithm.md``, section 17) gives
each key to exactly one *part*:

* the **window**: keys within ``w`` positions (causal ``t - w < j <= t``,
  bidirectional ``|t - j| < w``), exact weights ``exp(s q.k)``;
* the **exact keys**: the first ``sink_keys`` positions, and in bidirectional attention
  the keys of ``exact_key_mask``, exact weights for every query (causal: ``j <= t``);
* the **far keys**: everything else, estimated by the feature map's random features
  (none: exact sliding-window attention).

No estimate is ever subtracted.  Each part yields a stabilised partial
``(P, c)``: unnormalised ``[numerator | denominator]`` rows ``P`` whose unstabilised
value is ``exp(c) P``; :func:`merge` adds them as online softmax does.  The far keys of
causal attention are the causal pass on keys *lagged* by ``w`` (query ``t`` reads the
state of keys ``j <= t - w``); bidirectional attention adds a reverse lagged pass
(``j >= t + w``).  A causal state carries the random-feature state of the keys that
left the window, the last ``w`` keys and values, and the sink keys, so that a sequence
fed whole, in pieces or one token at a time gives the same outputs, and a decoding step
costs ``O(m d + (w + s) d)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import array_api_compat
import numpy as np

from linattn import _dispatch
from linattn import causal as causal_path
from linattn._xp import Array, Namespace, constant, from_host, safe_shift

__all__ = ["ExactParts", "banded_partial", "check_exact_parts", "merge", "softmax_partial"]

#: Queries per block of the banded (window) part: at least the band's width, so that a
#: block's keys are its own block and the next; 32 keeps tiny windows from making
#: thousands of tiny products.
MIN_BAND_BLOCK = 32

Partial = tuple[Array, Array]  # (P, c): [numerator | denominator] rows and their log-scale


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


def _positive_int(name: str, value: object, *, allow_zero: bool) -> int:
    low = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
        expected = "a non-negative integer" if allow_zero else "a positive integer or None"
        raise ValueError(f"{name} must be {expected}; got {value!r}")
    return int(value)


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


def softmax_partial(xp: Namespace, logits: Array, visible: Array, values: Array) -> Partial:
    """Exact weights ``exp(logits)`` over the visible keys, as a stabilised partial.

    Invisible keys are *selected* away (a NaN or infinite logit of a later or masked key
    never reaches a row); a row that sees no key has log-scale ``-inf``.
    """
    logits = xp.where(visible, logits, constant(xp, -math.inf, logits))
    top = xp.max(logits, axis=-1)
    weights = xp.exp(logits - safe_shift(xp, top)[..., None])  # exp(-inf) = 0 where hidden
    rows = xp.concat(
        [xp.matmul(weights, values), xp.sum(weights, axis=-1, keepdims=True)], axis=-1
    )
    return rows, top


def merge(xp: Namespace, parts: list[Partial]) -> Array:
    """``sum_i exp(c_i - c*) P_i`` with ``c* = max_i c_i``: the rows of all parts at one scale."""
    if len(parts) == 1:
        return parts[0][0]
    top = parts[0][1]
    for _, scale in parts[1:]:
        top = xp.maximum(top, scale)
    top = safe_shift(xp, top)
    total = None
    for rows, scale in parts:
        term = xp.exp(scale - top)[..., None] * rows
        total = term if total is None else total + term
    return total


def banded_partial(
    xp: Namespace,
    q: Array,
    keys: Array,
    values: Array,
    keep: Array,
    span: int,
    scale: float,
) -> Partial:
    """Query ``i`` against ``keys[i + 1 .. i + span]`` exactly: the window part.

    ``keys`` (``(..., T + span, d)``) hold the band's keys in position order (the
    caller pads them), ``keep`` (``(..., T + span)``) which of them take part.  Blocks of
    ``B >= span`` queries see their own key block and the next (``(B, 2B)`` logits),
    so the cost is ``O(T B d)``, linear in ``T``.
    """
    length = q.shape[-2]
    size = max(span, MIN_BAND_BLOCK)
    count = -(-length // size)
    device = array_api_compat.device(q)

    def blocked(x: Array, total: int, fill: float | bool) -> Array:
        pad = total - x.shape[-2]
        if pad > 0:
            tail = xp.full((*x.shape[:-2], pad, x.shape[-1]), fill, dtype=x.dtype, device=device)
            x = xp.concat([x, tail], axis=-2)
        elif pad < 0:
            x = x[..., :total, :]
        return xp.reshape(x, (*x.shape[:-2], total // size, size, x.shape[-1]))

    def pairs(x: Array) -> Array:  # each block with the next: (..., N, 2B, .)
        return xp.concat([x[..., :count, :, :], x[..., 1:, :, :]], axis=-2)

    total = (count + 1) * size
    queries = blocked(q, count * size, 0.0)
    band_keys = pairs(blocked(keys[..., 1:, :], total, 0.0))
    band_values = pairs(blocked(values[..., 1:, :], total, 0.0))
    band_keep = pairs(blocked(keep[..., 1:, None], total, False))[..., 0]
    offsets = np.arange(2 * size)[None, :] - np.arange(size)[:, None]
    band = from_host(xp, (offsets >= 0) & (offsets < span), dtype=xp.bool, device=device)
    visible = xp.logical_and(band, band_keep[..., None, :])
    logits = xp.matmul(queries, xp.matrix_transpose(band_keys)) * scale
    rows, top = softmax_partial(xp, logits, visible, band_values)

    def tokens(x: Array) -> Array:
        x = xp.reshape(x, (*x.shape[:-3], count * size, x.shape[-1]))
        return x[..., :length, :]

    return tokens(rows), tokens(top[..., None])[..., 0]


def far_partial(
    xp: Namespace,
    q: Array,
    keys: Array,
    values: Array,
    keep: Array,
    feature_map: Any,
    statistics: Any,
    kv: Array,
    log_shift: Array,
    *,
    causal: bool,
    chunk_size: int,
    plan: _dispatch.Plan,
) -> tuple[Partial, Array, Array]:
    """The far keys by random features: ``((P, c), kv, log_shift)``.

    Causal: query ``t`` against keys ``0 .. t`` of ``keys`` (already lagged by the
    caller) and the incoming state.  Bidirectional: every query against every key.
    """
    log_phi_q, sign_q = feature_map.signed_log_features(q, role="query", statistics=statistics)
    log_phi_k, sign_k = feature_map.signed_log_features(keys, role="key", statistics=statistics)
    log_phi_k = xp.where(keep[..., None], log_phi_k, constant(xp, -math.inf, log_phi_k))
    batch = tuple(kv.shape[:-2])
    m = feature_map.num_features
    log_phi_q = xp.broadcast_to(log_phi_q, (*batch, q.shape[-2], m))
    log_phi_k = xp.broadcast_to(log_phi_k, (*batch, keys.shape[-2], m))
    if sign_q is not None:
        sign_q = xp.broadcast_to(sign_q, tuple(log_phi_q.shape))
    if sign_k is not None:
        sign_k = xp.broadcast_to(sign_k, tuple(log_phi_k.shape))
    values_aug = xp.concat([values, xp.ones_like(values[..., :1])], axis=-1)
    values_aug = xp.broadcast_to(values_aug, (*batch, *values_aug.shape[-2:]))
    if causal:
        rows, kv, log_shift, log_scale = causal_path.causal(
            xp,
            log_phi_q,
            sign_q,
            log_phi_k,
            sign_k,
            values_aug,
            kv,
            log_shift,
            chunk_size,
            tokens_per_pass=plan.tokens_per_pass,
            return_log_scale=True,
        )
    else:
        rows, log_scale = causal_path.bidirectional(
            xp,
            log_phi_q,
            sign_q,
            log_phi_k,
            sign_k,
            values_aug,
            kv,
            log_shift,
            return_log_scale=True,
        )
    # A row that saw no key holds nothing: its scale must not outweigh the others.
    empty = rows[..., -1] == 0
    log_scale = xp.where(empty, constant(xp, -math.inf, log_scale), log_scale)
    return (rows, log_scale), kv, log_shift


def _positions(xp: Namespace, start: Any, count: int, device: Any) -> Array:
    """Absolute positions ``start .. start + count - 1`` (``start`` an int or a 0-d array)."""
    offsets = xp.arange(count, device=device)
    if isinstance(start, int | np.integer):
        return offsets + int(start)
    return offsets + xp.astype(start, offsets.dtype)


def _zeros(xp: Namespace, shape: tuple[int, ...], like: Array) -> Array:
    return xp.zeros(shape, dtype=like.dtype, device=array_api_compat.device(like))


def _no_keys(xp: Namespace, shape: tuple[int, ...], device: Any) -> Array:
    return xp.zeros(shape, dtype=xp.bool, device=device)


def causal_attention(
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
) -> tuple[Array, dict[str, Any]]:
    """Causal hybrid attention: ``(rows, new state fields)``; inputs broadcast to one batch.

    Keys are indexed by absolute position ``n + i`` (``n = state.num_tokens``).  The
    extended keys ``E`` are the state's last ``w`` keys followed by this call's, so
    ``E[e]`` is position ``n - w + e``: query ``i`` has window ``E[i + 1 .. i + w]`` and
    far keys ``E[0 .. i]`` on top of the state (the causal pass over ``E[:T]``).
    """
    length, d, dv = q.shape[-2], q.shape[-1], v.shape[-1]
    batch = tuple(q.shape[:-2])
    device = array_api_compat.device(q)
    w, s = parts.lag, parts.sink_keys
    n = 0 if state is None else state.num_tokens
    recent = None if state is None else state.recent
    if recent is None:
        recent = (
            _zeros(xp, (*batch, w, d), q),
            _zeros(xp, (*batch, w, dv), q),
            _no_keys(xp, (*batch, w), device),
        )
    keys = xp.concat([xp.broadcast_to(recent[0], (*batch, w, d)), k], axis=-2)
    values = xp.concat([xp.broadcast_to(recent[1], (*batch, w, dv)), v], axis=-2)
    kept = xp.concat([xp.broadcast_to(recent[2], (*batch, w)), keep], axis=-1)
    not_sink = _positions(xp, n - w, w + length, device) >= s
    found: list[Partial] = []
    sinks = None
    if s:
        sinks = _updated_sinks(xp, state, k, v, keep, n, s)
        sink_k, sink_v, sink_keep = sinks
        seen = _positions(xp, 0, s, device)[None, :] <= _positions(xp, n, length, device)[:, None]
        visible = xp.logical_and(seen, sink_keep[..., None, :])
        logits = xp.matmul(q, xp.matrix_transpose(sink_k)) * scale
        found.append(softmax_partial(xp, logits, visible, sink_v))
    if w:
        window_keep = xp.logical_and(kept, not_sink)
        found.append(banded_partial(xp, q, keys, values, window_keep, w, scale))
    kv = log_shift = None
    if feature_map is not None:
        kv, log_shift = state_arrays(xp, state, feature_map, batch, dv, q)
        far_keep = xp.logical_and(kept[..., :length], not_sink[:length])
        part, kv, log_shift = far_partial(
            xp,
            q,
            keys[..., :length, :],
            values[..., :length, :],
            far_keep,
            feature_map,
            statistics,
            kv,
            log_shift,
            causal=True,
            chunk_size=chunk_size,
            plan=plan,
        )
        found.append(part)
    fields = {
        "kv": kv,
        "log_shift": log_shift,
        "recent": (keys[..., length:, :], values[..., length:, :], kept[..., length:])
        if w
        else None,
        "sinks": sinks,
    }
    return merge(xp, found), fields


def state_arrays(
    xp: Namespace, state: Any, feature_map: Any, batch: tuple[int, ...], dv: int, like: Array
) -> tuple[Array, Array]:
    """The far keys' ``(kv, log_shift)`` from ``state``, broadcast to ``batch``, or empty."""
    from linattn.state import empty_state

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
    device = array_api_compat.device(k)
    index = _positions(xp, 0, s, device)
    index = index - (int(n) if isinstance(n, int | np.integer) else xp.astype(n, index.dtype))
    arrived = xp.logical_and(index >= 0, index < length)
    take = xp.clip(index, 0, length - 1)
    new_k = xp.take(k, take, axis=-2)
    new_v = xp.take(v, take, axis=-2)
    new_keep = xp.take(keep, take, axis=-1)
    if state is None or state.sinks is None:
        old_k = _zeros(xp, (*batch, s, k.shape[-1]), k)
        old_v = _zeros(xp, (*batch, s, v.shape[-1]), v)
        old_keep = _no_keys(xp, (*batch, s), device)
    else:
        old_k, old_v, old_keep = state.sinks
    return (
        xp.where(arrived[:, None], new_k, old_k),
        xp.where(arrived[:, None], new_v, old_v),
        xp.where(arrived, new_keep, xp.broadcast_to(old_keep, (*batch, s))),
    )


def bidirectional_attention(
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
) -> Array:
    """Bidirectional hybrid attention, unnormalised rows; inputs broadcast to one batch.

    The far keys of a window are two lagged causal passes, forward (``j <= t - w``) and
    on the reversed sequence (``j >= t + w``): never one global state minus the window.
    """
    length, d, dv = q.shape[-2], q.shape[-1], v.shape[-1]
    batch = tuple(q.shape[:-2])
    device = array_api_compat.device(q)
    w, s = parts.lag, parts.sink_keys
    exact = _positions(xp, 0, length, device) < s
    if parts.exact_key_mask is not None:
        exact = xp.logical_or(exact, parts.exact_key_mask)
    exact = xp.broadcast_to(exact, (*batch, length))
    found: list[Partial] = []
    if s or parts.exact_key_mask is not None:
        found.append(
            _exact_keys_partial(xp, q, k, v, xp.logical_and(keep, exact), s, parts, scale)
        )
    rest = xp.logical_and(keep, xp.logical_not(exact))
    if w:
        keys = xp.concat(
            [_zeros(xp, (*batch, w, d), k), k, _zeros(xp, (*batch, w - 1, d), k)], axis=-2
        )
        values = xp.concat(
            [_zeros(xp, (*batch, w, dv), v), v, _zeros(xp, (*batch, w - 1, dv), v)], axis=-2
        )
        kept = xp.concat(
            [_no_keys(xp, (*batch, w), device), rest, _no_keys(xp, (*batch, w - 1), device)],
            axis=-1,
        )
        found.append(banded_partial(xp, q, keys, values, kept, 2 * w - 1, scale))
    if feature_map is not None:
        kv, log_shift = state_arrays(xp, None, feature_map, batch, dv, q)
        options = {"chunk_size": chunk_size, "plan": plan}
        if not w:
            part, _, _ = far_partial(
                xp, q, k, v, rest, feature_map, statistics, kv, log_shift, causal=False, **options
            )
            found.append(part)
        else:
            for reverse in (False, True):
                qs, ks, vs, ms = (
                    xp.flip(x, axis=-2) if reverse else x for x in (q, k, v, rest[..., None])
                )
                lagged_k = xp.concat([_zeros(xp, (*batch, w, d), k), ks], axis=-2)[..., :length, :]
                lagged_v = xp.concat([_zeros(xp, (*batch, w, dv), v), vs], axis=-2)[
                    ..., :length, :
                ]
                lagged_keep = xp.concat([_no_keys(xp, (*batch, w), device), ms[..., 0]], axis=-1)[
                    ..., :length
                ]
                (rows, log_scale), _, _ = far_partial(
                    xp,
                    qs,
                    lagged_k,
                    lagged_v,
                    lagged_keep,
                    feature_map,
                    statistics,
                    kv,
                    log_shift,
                    causal=True,
                    **options,
                )
                if reverse:
                    rows, log_scale = xp.flip(rows, axis=-2), xp.flip(log_scale, axis=-1)
                found.append((rows, log_scale))
    return merge(xp, found)


def _exact_keys_partial(
    xp: Namespace,
    q: Array,
    k: Array,
    v: Array,
    chosen: Array,
    s: int,
    parts: ExactParts,
    scale: float,
) -> Partial:
    """Every query against the exact keys (sinks, ``exact_key_mask``), gathered first.

    Sinks alone are the first ``s`` keys.  Otherwise each batch row's chosen keys are
    gathered (a one-hot product, portable and differentiable) into ``E`` slots, ``E``
    the largest count in the batch (every key while tracing, where counts are unknown).
    """
    if parts.exact_key_mask is None:
        keys, values, kept = k[..., :s, :], v[..., :s, :], chosen[..., :s]
    else:
        length = k.shape[-2]
        count = _static_count(xp, chosen, length)
        rank = xp.argsort(xp.astype(xp.logical_not(chosen), xp.int8), axis=-1, stable=True)
        rank = rank[..., :count]
        where_from = rank[..., :, None] == xp.arange(length, device=array_api_compat.device(k))
        select = xp.astype(where_from, k.dtype)  # (..., E, L)
        keys, values = xp.matmul(select, k), xp.matmul(select, v)
        kept = xp.any(xp.logical_and(where_from, chosen[..., None, :]), axis=-1)
    logits = xp.matmul(q, xp.matrix_transpose(keys)) * scale
    visible = xp.broadcast_to(kept[..., None, :], tuple(logits.shape))
    return softmax_partial(xp, logits, visible, values)


def _static_count(xp: Namespace, chosen: Array, length: int) -> int:
    """The largest number of chosen keys in a row, or ``length`` when it is not known."""
    from linattn.attention import _is_traced

    if _is_traced(chosen) or array_api_compat.is_dask_array(chosen):
        return length
    try:
        return max(1, int(xp.max(xp.sum(xp.astype(chosen, xp.int32), axis=-1))))
    except Exception:  # a tracing framework that cannot give the value (torch.compile)
        return length
