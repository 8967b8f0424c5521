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
from linattn._adjoints import bidirectional_vjp, causal_vjp, normalise_vjp
from linattn._xp import Array, Namespace, constant, from_host, is_traced, safe_shift
from linattn.state import empty_state

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
    so the cost is ``O(T B d)``, linear in ``T``.  NumPy arrays run the compiled kernel
    (``linattn_numba._window``) where it imports: the same contract, ``O(T span d)``.
    """
    kernel = _dispatch.window_kernel_for(q)
    if kernel is not None:
        return kernel.banded_partial(q, keys, values, keep, span, scale)
    band = Band.of(xp, q, keys, values, keep, span)
    logits = xp.matmul(band.queries, xp.matrix_transpose(band.keys)) * scale
    rows, top = softmax_partial(xp, logits, band.visible, band.values)
    return band.tokens(xp, rows), band.tokens(xp, top[..., None])[..., 0]


@dataclass(frozen=True)
class Band:
    """The window part's blocks: ``(..., N, B, .)`` queries, ``(..., N, 2B, .)`` keys."""

    queries: Array
    keys: Array
    values: Array
    visible: Array  # (..., N, B, 2B)
    length: int  # T
    key_length: int  # T + span
    size: int  # B

    @classmethod
    def of(
        cls, xp: Namespace, q: Array, keys: Array, values: Array, keep: Array, span: int
    ) -> Band:
        length = q.shape[-2]
        size = max(span, MIN_BAND_BLOCK)
        count = -(-length // size)
        total = (count + 1) * size
        device = array_api_compat.device(q)

        def pairs(x: Array) -> Array:  # each block with the next: (..., N, 2B, .)
            x = _blocked(xp, x, total, size, 0.0 if x.dtype != xp.bool else False)
            return xp.concat([x[..., :count, :, :], x[..., 1:, :, :]], axis=-2)

        offsets = np.arange(2 * size)[None, :] - np.arange(size)[:, None]
        band = from_host(xp, (offsets >= 0) & (offsets < span), dtype=xp.bool, device=device)
        band_keep = pairs(keep[..., 1:, None])[..., 0]
        return cls(
            queries=_blocked(xp, q, count * size, size, 0.0),
            keys=pairs(keys[..., 1:, :]),
            values=pairs(values[..., 1:, :]),
            visible=xp.logical_and(band, band_keep[..., None, :]),
            length=length,
            key_length=keys.shape[-2],
            size=size,
        )

    def tokens(self, xp: Namespace, x: Array) -> Array:
        """Query blocks ``(..., N, B, .)`` back to queries ``(..., T, .)``."""
        x = xp.reshape(x, (*x.shape[:-3], x.shape[-3] * x.shape[-2], x.shape[-1]))
        return x[..., : self.length, :]

    def key_tokens(self, xp: Namespace, x: Array) -> Array:
        """Cotangents of paired key blocks ``(..., N, 2B, .)`` back to ``(..., T + span, .)``.

        The adjoint of :meth:`of`'s pairing: block ``b`` collects its own first half and
        the second half of block ``b - 1``.
        """
        size = self.size
        zero = xp.zeros_like(x[..., :1, :size, :])
        first = xp.concat([x[..., :size, :], zero], axis=-3)
        second = xp.concat([zero, x[..., size:, :]], axis=-3)
        flat = self.tokens_of(xp, first + second)
        need = self.key_length - 1
        if flat.shape[-2] >= need:
            flat = flat[..., :need, :]
        else:
            pad = xp.zeros(
                (*flat.shape[:-2], need - flat.shape[-2], flat.shape[-1]),
                dtype=flat.dtype,
                device=array_api_compat.device(flat),
            )
            flat = xp.concat([flat, pad], axis=-2)
        return xp.concat([xp.zeros_like(flat[..., :1, :]), flat], axis=-2)

    @staticmethod
    def tokens_of(xp: Namespace, x: Array) -> Array:
        return xp.reshape(x, (*x.shape[:-3], x.shape[-3] * x.shape[-2], x.shape[-1]))


def _blocked(xp: Namespace, x: Array, total: int, size: int, fill: float | bool) -> Array:
    """Rows ``(..., n, .)`` padded with ``fill`` or cut to ``total``, as blocks of ``size``."""
    pad = total - x.shape[-2]
    if pad > 0:
        device = array_api_compat.device(x)
        tail = xp.full((*x.shape[:-2], pad, x.shape[-1]), fill, dtype=x.dtype, device=device)
        x = xp.concat([x, tail], axis=-2)
    elif pad < 0:
        x = x[..., :total, :]
    return xp.reshape(x, (*x.shape[:-2], total // size, size, x.shape[-1]))


class Part:
    """One part of the keys: its partial :meth:`rows`, and the adjoint :meth:`backward`.

    ``backward(g, partial)`` takes the cotangent of the part's rows (its log-scale held
    constant, as every stabiliser is: the merged output does not depend on it) and the
    ``partial`` :meth:`rows_for_backward` returned, and returns the cotangents
    ``(dq, dk, dv)`` of the call's (broadcast) inputs; ``None`` for none.
    """

    def rows(self, xp: Namespace) -> Partial:
        raise NotImplementedError

    def rows_for_backward(self, xp: Namespace) -> Partial:
        """The rows :meth:`backward` differentiates (their scale is the one it assumes)."""
        return self.rows(xp)

    def backward(self, xp: Namespace, g: Array, partial: Partial) -> tuple[Array | None, ...]:
        raise NotImplementedError


@dataclass(frozen=True)
class ExactKeysPart(Part):
    """Every query against a few gathered keys ``K = take(k)``, exact weights."""

    q: Array
    keys: Array  # (..., E, d)
    values: Array  # (..., E, d_v)
    visible: Array  # (..., T, E)
    scale: float
    scatter: Any  # cotangent of (keys or values) (..., E, .) -> that of k or v (..., L, .)

    def rows(self, xp: Namespace) -> Partial:
        logits = xp.matmul(self.q, xp.matrix_transpose(self.keys)) * self.scale
        return softmax_partial(xp, logits, self.visible, self.values)

    def backward(self, xp: Namespace, g: Array, partial: Partial) -> tuple[Array | None, ...]:
        logits = xp.matmul(self.q, xp.matrix_transpose(self.keys)) * self.scale
        dq, dk, dv = _softmax_backward(
            xp, self.q, self.keys, self.values, logits, self.visible, self.scale, g
        )
        return dq, self.scatter(dk), self.scatter(dv)


@dataclass(frozen=True)
class WindowPart(Part):
    """Query ``i`` against ``keys[i + 1 .. i + span]`` (:func:`banded_partial`), where the
    band's keys are ``before``, the call's ``k`` and ``after`` in position order."""

    q: Array
    k: Array  # the call's keys and values
    v: Array
    keep: Array  # (..., first + T + after): which of the band's keys take part
    span: int
    scale: float
    before: tuple[Array, Array]  # keys and values before the call's (``first`` rows)
    after: tuple[Array, Array] | None = None  # and after them (bidirectional padding)

    @property
    def first(self) -> int:
        """``keys[first + j]`` is key ``j`` of the call."""
        return int(self.before[0].shape[-2])

    def band(self, xp: Namespace) -> tuple[Array, Array]:
        """The band's keys ``(..., T + span, d)`` and values, in position order."""
        after = [] if self.after is None else [self.after]
        pieces = [self.before, (self.k, self.v), *after]
        keys = xp.concat(
            [xp.broadcast_to(p[0], (*self.k.shape[:-2], *p[0].shape[-2:])) for p in pieces],
            axis=-2,
        )
        values = xp.concat(
            [xp.broadcast_to(p[1], (*self.v.shape[:-2], *p[1].shape[-2:])) for p in pieces],
            axis=-2,
        )
        return keys, values

    def rows(self, xp: Namespace) -> Partial:
        keys, values = self.band(xp)
        return banded_partial(xp, self.q, keys, values, self.keep, self.span, self.scale)

    def backward(self, xp: Namespace, g: Array, partial: Partial) -> tuple[Array | None, ...]:
        calls = slice(self.first, self.first + self.q.shape[-2])  # the call's own keys
        keys, values = self.band(xp)
        kernel = _dispatch.window_kernel_for(self.q)
        if kernel is not None:  # (partial is this kernel's: rows() ran it)
            args = (self.q, keys, values, self.keep, self.span, self.scale)
            dq, dk, dv = kernel.banded_partial_backward(*args, partial[1], g)
            return dq, dk[..., calls, :], dv[..., calls, :]
        band = Band.of(xp, self.q, keys, values, self.keep, self.span)
        logits = xp.matmul(band.queries, xp.matrix_transpose(band.keys)) * self.scale
        g = _blocked(xp, g, band.queries.shape[-3] * band.size, band.size, 0.0)
        dq, dk, dv = _softmax_backward(
            xp, band.queries, band.keys, band.values, logits, band.visible, self.scale, g
        )
        dk, dv = (band.key_tokens(xp, x)[..., calls, :] for x in (dk, dv))
        return band.tokens(xp, dq), dk, dv


@dataclass(frozen=True)
class FarPart(Part):
    """The far keys by random features; causal parts see keys lagged by ``lag``.

    ``reverse`` runs the causal pass on the reversed sequence (keys ``j >= t + lag``).
    """

    q: Array
    k: Array  # the call's keys (unlagged, in order)
    v: Array
    keep: Array  # which of the call's keys are far keys
    feature_map: Any
    statistics: Any
    causal: bool
    lag: int
    reverse: bool
    chunk_size: int
    plan: _dispatch.Plan
    kv: Array
    log_shift: Array
    lead: tuple[Array, Array, Array] | None = None  # keys before the call (the window cache)

    def operands(self, xp: Namespace) -> tuple[Array, ...]:
        """Queries, the lagged keys, values and keep, reversed where asked."""
        q, k, v, keep = self.q, self.k, self.v, self.keep
        if self.reverse:
            q, k, v = (xp.flip(x, axis=-2) for x in (q, k, v))
            keep = xp.flip(keep, axis=-1)
        if self.causal and (self.lag or self.lead is not None):
            length, batch = q.shape[-2], tuple(q.shape[:-2])
            if self.lead is None:
                lead = (
                    _zeros(xp, (*batch, self.lag, k.shape[-1]), k),
                    _zeros(xp, (*batch, self.lag, v.shape[-1]), v),
                    _no_keys(xp, (*batch, self.lag), array_api_compat.device(k)),
                )
            else:
                lead = self.lead
            k = xp.concat([lead[0], k], axis=-2)[..., :length, :]
            v = xp.concat([lead[1], v], axis=-2)[..., :length, :]
            keep = xp.concat([lead[2], keep], axis=-1)[..., :length]
        return q, k, v, keep

    def features(self, xp: Namespace, q: Array, k: Array, keep: Array) -> tuple[Array, ...]:
        fm, stats = self.feature_map, self.statistics
        log_phi_q, sign_q = fm.signed_log_features(q, role="query", statistics=stats)
        log_phi_k, sign_k = fm.signed_log_features(k, role="key", statistics=stats)
        log_phi_k = xp.where(keep[..., None], log_phi_k, constant(xp, -math.inf, log_phi_k))
        return log_phi_q, sign_q, log_phi_k, sign_k

    def rows(self, xp: Namespace) -> Partial:
        return self.run(xp)[0]

    @property
    def fused_backward(self) -> bool:
        """Whether :meth:`backward` runs the fused causal backward (its rows ``[o | 1]``
        with the log-normaliser as their scale); else the portable pass's adjoint."""
        return self.causal and self.plan.fused and self.lead is None

    def rows_for_backward(self, xp: Namespace) -> Partial:
        # Each backward differentiates its own forward's rows: the fused pass's [o | 1]
        # and log-normaliser, or the portable pass's rows and scale.
        return self.run(xp, portable=not self.fused_backward)[0]

    def run(self, xp: Namespace, *, portable: bool = False) -> tuple[Partial, Array, Array]:
        """``((P, c), kv, log_shift)``: the partial and the state after the keys.

        Causal parts run on the plan's path: the fused CPU pass (its log-normaliser is the
        log-scale of rows ``[o | 1]``), a compiled kernel (which returns the log-scale on
        request), or the portable chunked pass.
        """
        q, k, v, keep = self.operands(xp)
        kv, log_shift = self.kv, self.log_shift
        plan = (
            _dispatch.causal_plan(q, self.feature_map, backend="array_api")
            if portable
            else self.plan
        )
        if self.causal and plan.fused:
            out, kv, log_shift, log_scale = _dispatch.fused_causal(
                q,
                k,
                v,
                self.feature_map,
                keep,
                kv,
                log_shift,
                chunk_size=self.chunk_size,
                return_log_normaliser=True,
            )
            rows = xp.concat([out, xp.ones_like(out[..., :1])], axis=-1)
        else:
            log_phi_q, sign_q, log_phi_k, sign_k = self.features(xp, q, k, keep)
            values_aug = xp.concat([v, xp.ones_like(v[..., :1])], axis=-1)
            if self.causal:
                rows, kv, log_shift, log_scale = _dispatch.causal(
                    xp,
                    log_phi_q,
                    sign_q,
                    log_phi_k,
                    sign_k,
                    values_aug,
                    kv,
                    log_shift,
                    chunk_size=self.chunk_size,
                    plan=plan,
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
        log_scale = xp.where(rows[..., -1] == 0, constant(xp, -math.inf, log_scale), log_scale)
        if self.reverse:
            rows, log_scale = xp.flip(rows, axis=-2), xp.flip(log_scale, axis=-1)
        return (rows, log_scale), kv, log_shift

    def backward(self, xp: Namespace, g: Array, partial: Partial) -> tuple[Array | None, ...]:
        if self.reverse:
            g = xp.flip(g, axis=-2)
        q, k, v, keep = self.operands(xp)
        if self.fused_backward:
            # Rows P = [o | 1] at scale c = lse stand for [num | den] = P exp(c): the
            # cotangent G of P (c held) is G[:d_v] of o and G[:d_v] . o + G[d_v] of lse.
            out = partial[0][..., :-1]
            if self.reverse:
                out = xp.flip(out, axis=-2)
            d_out = g[..., :-1]
            d_lse = xp.sum(d_out * out, axis=-1) + g[..., -1]
            dq, dk, dv = _dispatch.fused_causal_rows_vjp(
                q, k, v, self.feature_map, keep, out, d_out, d_lse, chunk_size=self.chunk_size
            )
        else:
            log_phi_q, sign_q, log_phi_k, sign_k = self.features(xp, q, k, keep)
            values_aug = xp.concat([v, xp.ones_like(v[..., :1])], axis=-1)
            operands = (log_phi_q, sign_q, log_phi_k, sign_k, values_aug, g)
            if self.causal:
                d_lq, d_lk, d_va = causal_vjp(xp, *operands, self.chunk_size)
            else:
                d_lq, d_lk, d_va = bidirectional_vjp(xp, *operands)
            fm, stats = self.feature_map, self.statistics
            dq = fm.log_features_vjp(q, d_lq, role="query", statistics=stats)
            dk = fm.log_features_vjp(k, d_lk, role="key", statistics=stats)
            dv = d_va[..., :-1]
        if self.causal and self.lag:  # lagged key i is the call's key i - lag
            length = q.shape[-2]
            dk, dv = (
                xp.concat([x[..., self.lag :, :], xp.zeros_like(x[..., : self.lag, :])], axis=-2)
                if self.lag < length
                else xp.zeros_like(x)
                for x in (dk, dv)
            )
        if self.reverse:
            dq, dk, dv = (xp.flip(x, axis=-2) for x in (dq, dk, dv))
        return dq, dk, dv


def _softmax_backward(
    xp: Namespace,
    q: Array,
    keys: Array,
    values: Array,
    logits: Array,
    visible: Array,
    scale: float,
    g: Array,
) -> tuple[Array, Array, Array]:
    """Adjoint of :func:`softmax_partial` on ``logits = scale q k^T`` (row max constant)."""
    logits = xp.where(visible, logits, constant(xp, -math.inf, logits))
    top = safe_shift(xp, xp.max(logits, axis=-1))
    weights = xp.exp(logits - top[..., None])
    g_num, g_den = g[..., :-1], g[..., -1:]
    d_weights = xp.matmul(g_num, xp.matrix_transpose(values)) + g_den
    d_logits = d_weights * weights * scale
    t = xp.matrix_transpose
    return (
        xp.matmul(d_logits, keys),
        xp.matmul(t(d_logits), q),
        xp.matmul(t(weights), g_num),
    )


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


def _pad_keys(xp: Namespace, x: Array, before: int, after: int) -> Array:
    """``x`` with ``before`` and ``after`` zero rows (``False`` for a keep array)."""
    if x.dtype == xp.bool:
        shape = tuple(x.shape[:-1])
        device = array_api_compat.device(x)
        pieces = [_no_keys(xp, (*shape, before), device), x, _no_keys(xp, (*shape, after), device)]
        return xp.concat([p for p in pieces if p.shape[-1]], axis=-1)
    shape = tuple(x.shape[:-2])
    pieces = [
        _zeros(xp, (*shape, before, x.shape[-1]), x),
        x,
        _zeros(xp, (*shape, after, x.shape[-1]), x),
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
        found.append(WindowPart(q, k, v, kept, w, scale, before=(lead[0], lead[1])))
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


def _sink_arrays(
    xp: Namespace, sinks: list[ExactKeysPart], part: FarPart, batch: tuple[int, ...]
) -> tuple[Array, Array, Array]:
    """The sink keys, values and ``visible`` of the one-pass kernels, broadcast to
    ``batch`` (no sinks: empty arrays)."""
    if sinks:
        (sink,) = sinks
        arrays = (sink.keys, sink.values, sink.visible)
    else:
        d, dv, length = part.q.shape[-1], part.v.shape[-1], part.q.shape[-2]
        arrays = (
            _zeros(xp, (*batch, 0, d), part.q),
            _zeros(xp, (*batch, 0, dv), part.q),
            _no_keys(xp, (*batch, length, 0), None),
        )
    return tuple(xp.broadcast_to(x, (*batch, *x.shape[-2:])) for x in arrays)


def fused_causal_parts(xp: Namespace, found: list[Part]) -> tuple[Array, dict[str, Any]]:
    """Causal window, sinks and fused far keys in one pass (:mod:`linattn_numba._hybrid`):
    the far part, at most one window and one sink part (``linattn._plan`` chose it)."""
    (part,) = [p for p in found if isinstance(p, FarPart)]
    window = [p for p in found if isinstance(p, WindowPart)]
    sinks = [p for p in found if isinstance(p, ExactKeysPart)]
    kernel = _dispatch.hybrid_kernel_for(part.q)
    batch = tuple(part.q.shape[:-2])
    dv = part.v.shape[-1]
    if window:
        (band,) = window
        (recent, recent_values), keep, span = band.before, band.keep, band.span
    else:  # no window: no cache, the far keys are the call's own
        keep, span = part.operands(xp)[3], 0
        recent, recent_values = (_zeros(xp, (*batch, 0, x.shape[-1]), x) for x in (part.k, part.v))
    projection, hyperbolic = _dispatch.fused_map_arrays(part.feature_map)
    m = part.feature_map.num_features
    out, kv, log_shift = kernel.causal_forward(
        part.q,
        *(xp.broadcast_to(x, (*batch, *x.shape[-2:])) for x in (part.k, part.v)),
        xp.broadcast_to(keep, (*batch, keep.shape[-1])),
        *(xp.broadcast_to(x, (*batch, *x.shape[-2:])) for x in (recent, recent_values)),
        span,
        part.feature_map.scale,
        *_sink_arrays(xp, sinks, part, batch),
        projection,
        hyperbolic=hyperbolic,
        kv=xp.broadcast_to(part.kv, (*batch, m, dv + 1)),
        log_shift=xp.broadcast_to(part.log_shift, (*batch, m)),
        chunk_size=part.chunk_size,
    )
    return out, {"kv": kv, "log_shift": log_shift}


def fused_bidirectional_parts(xp: Namespace, found: list[Part]) -> Array:
    """Bidirectional window, sinks and both fused far parts in one pass
    (:func:`linattn_numba._hybrid.bidirectional_forward`; ``linattn._plan`` chose it)."""
    part = next(p for p in found if isinstance(p, FarPart))
    sinks = [p for p in found if isinstance(p, ExactKeysPart)]
    kernel = _dispatch.hybrid_kernel_for(part.q)
    batch = tuple(part.q.shape[:-2])
    length = part.q.shape[-2]
    projection, hyperbolic = _dispatch.fused_map_arrays(part.feature_map)
    return kernel.bidirectional_forward(
        part.q,
        *(xp.broadcast_to(x, (*batch, *x.shape[-2:])) for x in (part.k, part.v)),
        xp.broadcast_to(part.keep, (*batch, length)),
        part.lag,
        part.feature_map.scale,
        *_sink_arrays(xp, sinks, part, batch),
        projection,
        hyperbolic=hyperbolic,
        chunk_size=part.chunk_size,
    )


def fused_global_parts(xp: Namespace, found: list[Part]) -> Array:
    """Bidirectional sinks (or ``exact_key_mask``'s keys) without a window, and the far
    keys as one global state, in the fused bidirectional pass, which merges the exact
    keys per query (:func:`linattn._dispatch.fused_global`; ``linattn._plan`` chose it)."""
    (part,) = [p for p in found if isinstance(p, FarPart)]
    sinks = [p for p in found if isinstance(p, ExactKeysPart)]
    batch = tuple(part.q.shape[:-2])
    sink_arrays = _sink_arrays(xp, sinks, part, batch)
    return _dispatch.fused_global(part.q, part.k, part.v, part.feature_map, part.keep, sink_arrays)


def hybrid_rows(xp: Namespace, found: list[Part]) -> tuple[Array, dict[str, Any]]:
    """Merged rows of all parts, and the far part's state (``kv``, ``log_shift``)."""
    partials, state = [], {}
    for part in found:
        if isinstance(part, FarPart) and part.causal and not part.reverse:
            partial, kv, log_shift = part.run(xp)
            state = {"kv": kv, "log_shift": log_shift}
        else:
            partial = part.rows(xp)
        partials.append(partial)
    return merge(xp, partials), state


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
    device = array_api_compat.device(k)
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
    device = array_api_compat.device(q)
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
            _zeros(xp, (*x.shape[:-2], rows, x.shape[-1]), x)
            for x in (k, v)
            for rows in (w, w - 1)
        ]
        found.append(
            WindowPart(
                q, k, v, _pad_keys(xp, rest, w, w - 1), 2 * w - 1, scale,
                before=(zeros[0], zeros[2]), after=(zeros[1], zeros[3]),
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
    where_from = rank[..., :, None] == xp.arange(length, device=array_api_compat.device(k))
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
    if is_traced(chosen) or array_api_compat.is_dask_array(chosen):
        return length
    try:
        return max(1, int(xp.max(xp.sum(xp.astype(chosen, xp.int32), axis=-1))))
    except Exception:  # a tracing framework that cannot give the value (torch.compile)
        return length


def parts_vjp(
    xp: Namespace, found: list[Part], grad: Array
) -> tuple[Array | None, Array | None, Array | None]:
    """Cotangents ``(dq, dk, dv)`` of the broadcast inputs from that of the output.

    The merge's scales and every part's stabilisers are held constant: the output is
    invariant to them (numerator and denominator share them), so this is exact.
    """
    partials = [part.rows_for_backward(xp) for part in found]
    g_rows = normalise_vjp(xp, merge(xp, partials), grad)
    top = partials[0][1]
    for _, scale in partials[1:]:
        top = xp.maximum(top, scale)
    top = safe_shift(xp, top)
    totals: list[Array | None] = [None, None, None]
    for part, partial in zip(found, partials, strict=True):
        scale = partial[1]
        grads = part.backward(xp, xp.exp(scale - top)[..., None] * g_rows, partial)
        for i, g in enumerate(grads):
            if g is not None:
                totals[i] = g if totals[i] is None else totals[i] + g
    return totals[0], totals[1], totals[2]
