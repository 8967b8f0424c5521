"""The parts of hybrid attention: the exact keys (sinks, ``exact_key_mask``), the window
and the far keys; each computes its partial rows and their adjoint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from linattn import _dispatch, fitted
from linattn._adjoints import bidirectional_vjp, causal_vjp
from linattn._xp import Array, Namespace, array_device, constant
from linattn.fitted import add_cotangents
from linattn.hybrid.merge import (
    Band,
    Partial,
    banded_partial,
    blocked,
    softmax_backward,
    softmax_partial,
)

__all__ = ["ExactKeysPart", "FarPart", "Part", "WindowPart", "no_keys", "zero_rows"]


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
        dq, dk, dv = softmax_backward(
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
    kernel: Any = None  # the compiled window part the call's plan chose, or None

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
        return banded_partial(
            xp, self.q, keys, values, self.keep, self.span, self.scale, kernel=self.kernel
        )

    def backward(self, xp: Namespace, g: Array, partial: Partial) -> tuple[Array | None, ...]:
        calls = slice(self.first, self.first + self.q.shape[-2])  # the call's own keys
        keys, values = self.band(xp)
        if self.kernel is not None:  # (partial is this kernel's: rows() ran it)
            args = (self.q, keys, values, self.keep, self.span, self.scale)
            dq, dk, dv = self.kernel.banded_partial_backward(*args, partial[1], g)
            return dq, dk[..., calls, :], dv[..., calls, :]
        band = Band.of(xp, self.q, keys, values, self.keep, self.span)
        logits = xp.matmul(band.queries, xp.matrix_transpose(band.keys)) * self.scale
        g = blocked(xp, g, band.queries.shape[-3] * band.size, band.size, 0.0)
        dq, dk, dv = softmax_backward(
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
                    zero_rows(xp, (*batch, self.lag, k.shape[-1]), k),
                    zero_rows(xp, (*batch, self.lag, v.shape[-1]), v),
                    no_keys(xp, (*batch, self.lag), array_device(k)),
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
        if fm.parameters is not None:  # a g = 0 head has no far keys
            keep = xp.logical_and(keep, fitted.far_keys_on(xp, fm.parameters, k))
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
            _dispatch.scan_plan(q, self.feature_map, backend="array_api")
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
            values_aug = xp.concat([v, xp.ones_like(v[..., :1])], axis=-1)
            operands = (*self.features(xp, q, k, keep), values_aug)
            rows, kv, log_shift, log_scale = _dispatch.attend(
                xp, operands, kv, log_shift, causal=self.causal, chunk_size=self.chunk_size,
                plan=plan, return_log_scale=True,
            )  # fmt: skip
        # A row that saw no key holds nothing: its scale must not outweigh the others.
        log_scale = xp.where(rows[..., -1] == 0, constant(xp, -math.inf, log_scale), log_scale)
        if self.reverse:
            rows, log_scale = xp.flip(rows, axis=-2), xp.flip(log_scale, axis=-1)
        return (rows, log_scale), kv, log_shift

    def backward(
        self,
        xp: Namespace,
        g: Array,
        partial: Partial,
        parameters: dict[str, Any] | None = None,
    ) -> tuple[Array | None, ...]:
        """``parameters``: a dict that a fitted map's parameter cotangents are added to."""
        if self.reverse:
            g = xp.flip(g, axis=-2)
        q, k, v, keep = self.operands(xp)
        if parameters is not None and self.fused_backward:
            raise ValueError("parameter cotangents need a fitted map (no fused backward)")
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
            if parameters is not None:
                add_cotangents(parameters, fm.log_features_parameter_vjp(q, d_lq, role="query"))
                add_cotangents(parameters, fm.log_features_parameter_vjp(k, d_lk, role="key"))
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


def zero_rows(xp: Namespace, shape: tuple[int, ...], like: Array) -> Array:
    return xp.zeros(shape, dtype=like.dtype, device=array_device(like))


def no_keys(xp: Namespace, shape: tuple[int, ...], device: Any) -> Array:
    return xp.zeros(shape, dtype=xp.bool, device=device)
