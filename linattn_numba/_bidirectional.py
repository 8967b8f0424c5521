"""Fused bidirectional FAVOR+ on the CPU: features, attention and normalisation in two passes.

The algorithm is that of ``linattn.causal.bidirectional`` (``linattn.state.absorb_keys``
then ``linattn.causal.readout``), computed block by block so that no ``L x m`` array
exists:

1. every block of keys is absorbed into the stabilised state ``(S, mu)``:
   ``mu' = max(mu, max_j l(k_j))``, ``S' = exp(mu - mu') S + exp(l(K) - mu')^T [V | 1]``
   (``linattn_numba.cpu._absorb``; the per-feature maximum over all keys is reached
   block by block, each block rescaling the sum so far);
2. every block of queries is read out: ``u_t = exp(l(q_t) + mu - F_t)``,
   ``F_t = max_r (l(q_t) + mu)_r``, ``O_t = u_t S``, normalised ``O_t[:d_v] / O_t[d_v]``
   (zeros where the denominator is 0: the query sees no key).

The log-features ``l(x)`` of the ``"positive"`` and ``"hyperbolic"`` kinds are computed
in the kernel, :data:`linattn_numba.cpu.FEATURE_BLOCK` tokens at a time, so memory above
inputs and outputs is ``O(FEATURE_BLOCK m)`` per thread; the queries' per-row offset
``s |q_t|^2 / 2 + log(m) / 2`` is never computed (``F_t`` absorbs it), each denominator is
summed with its row's exponentials, and the state products run ``d_v`` wide (``phi^T V``
and ``u S[:, :d_v]``), the ones column as sums.

The backward pass (:func:`favor_bidirectional_backward`) gives the gradients of the
normalised outputs with respect to ``q``, ``k`` and ``v``, every stabiliser (``mu``,
``F``) held constant: exact, because numerator and denominator share every shift (the
module docstring of :mod:`linattn_numba.cpu`).  With ``A_t = [g_t / D_t, -(g_t . o_t) /
D_t]`` the cotangent of the unnormalised row: ``d l(q_t) = u_t * (A_t S^T)``,
``dS = sum_t u_t^T A_t``, ``d l(k_j) = phi_j * ([v_j | 1] dS^T)``, ``d[v_j | 1] = phi_j dS``
with ``phi_j = exp(l(k_j) - mu)``, then through the features: ``dx = d_proj P - s x
sum_r d l_r`` (``P`` the projection times ``sqrt(s)``).

Batch x heads run on Numba's thread pool (serial twins for small work, forked children
and unsafe thread pools: :mod:`linattn_numba._machinery`); BLAS is pinned to one thread
while a kernel runs.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import prange

from linattn_numba import _hybrid, _machinery
from linattn_numba.cpu import (
    FEATURE_BLOCK,
    _flat,
    _half_norm,
    _log_features,
    _running_max,
    _safe_shift,
    _shift_between,
    _without_empty_rows,
    fast_exp,
    typed,
)

__all__ = ["favor_bidirectional", "favor_bidirectional_backward"]

_jit = _machinery.jit


# -- blocks -----------------------------------------------------------------------------


@_jit()
def _key_block(k, v, mask, projection, consts, hyperbolic, proj, lk, va):
    """Key log-features ``lk`` and ``va = [v | 1]`` of one block; a masked key gets
    ``-inf`` features and zero values (no features, no padding values)."""
    n = lk.shape[0]
    dv = v.shape[1]
    m = lk.shape[1]
    _log_features(k, projection, consts, hyperbolic, proj, lk)
    for i in range(n):
        for e in range(dv):
            va[i, e] = v[i, e]
        va[i, dv] = 1
        if not mask[i]:
            for r in range(m):
                lk[i, r] = -np.inf
            for e in range(dv):
                va[i, e] = 0


#: Lanes of the per-row maximum in :func:`_query_block`: a running maximum per lane is
#: an elementwise ``max`` that vectorises (a scalar ``max`` reduction over floats does
#: not without fast-math flags that assume no NaN); measured 2.4x faster, m = 256.
LANES = 16


@_jit()
def _project(x, projection, hyperbolic, proj, out):
    """``out = +-(sqrt(s) x) W^T``: the log-features without their per-row offset
    ``s |x|^2 / 2 + log(m) / 2`` (``proj`` is scratch for the hyperbolic kind)."""
    rows = projection.shape[0]
    if not hyperbolic:
        np.dot(x, projection.T, out)
        return
    np.dot(x, projection.T, proj)
    for i in range(x.shape[0]):
        for r in range(rows):
            out[i, r] = proj[i, r]
            out[i, rows + r] = -proj[i, r]


@_jit(fastmath=frozenset({"contract", "reassoc"}))
def _exp_row(u, i, f, z):
    """``u[i] = exp(u[i] - f)`` in place; returns ``u[i] . z`` (summed in any order)."""
    total = u[i, 0] - u[i, 0]
    for r in range(u.shape[1]):
        p = fast_exp(u[i, r] - f)
        u[i, r] = p
        total += p * z[r]
    return total


@_jit()
def _query_factors(u, ms, lanes, z, den, tops):
    """``u_t = exp(u_t + ms - F_t)`` in place (``F_t`` the row's maximum, 0 where not
    finite, into ``tops``) and ``den_t = u_t . z``; ``lanes`` is scratch of
    :data:`LANES` entries."""
    n, m = u.shape
    zero = ms[0] - ms[0]
    whole = m - m % LANES
    for i in range(n):
        row = u[i]
        for r in range(m):
            row[r] += ms[r]
        lanes[:] = row[0]
        for r0 in range(0, whole, LANES):
            for lane in range(LANES):
                x = row[r0 + lane]
                lanes[lane] = x if x > lanes[lane] else lanes[lane]
        f = lanes[0]
        for lane in range(1, LANES):
            if lanes[lane] > f:
                f = lanes[lane]
        for r in range(whole, m):
            if row[r] > f:
                f = row[r]
        if not np.isfinite(f):
            f = zero
        tops[i] = f
        den[i] = _exp_row(u, i, f, z)


@_jit()
def _query_block(x, projection, consts, hyperbolic, proj, ms, lanes, z, u, den, scale):
    """``u_t = exp(l(q_t) + ms - F_t)`` of one block of queries into ``u``, their
    denominators ``den_t = u_t . z`` (``z = S[:, d_v]``) and log-scales ``scale_t``: the
    true ``[num | den]`` is ``exp(scale_t) [u_t S]``.

    ``F_t = max_r (l(q_t) + ms)_r`` absorbs ``l``'s per-row offset ``o_t = s |q_t|^2 / 2
    + log(m) / 2``, so that is not subtracted from the projection, only from the scale
    (``scale_t = F_t - o_t``).  A row whose ``s |x|^2 / 2`` overflows has no features
    (``l = -inf``): ``u_t = 0``.
    """
    root_half_scale = np.sqrt(consts[0])
    _project(x, projection, hyperbolic, proj, u)
    _query_factors(u, ms, lanes, z, den, scale)
    for i in range(u.shape[0]):
        half_norm = _half_norm(x[i], root_half_scale)
        scale[i] -= half_norm + consts[1]
        if half_norm == np.inf:
            for r in range(u.shape[1]):
                u[i, r] = 0
            den[i] = 0


@_jit()
def _key_factors(lk, ms):
    """``phi_j = exp(l(k_j) - ms)`` in place of ``lk``: the keys as the final state holds them."""
    n, m = lk.shape
    for j in range(n):
        for r in range(m):
            lk[j, r] = fast_exp(lk[j, r] - ms[r])


@_jit()
def _features_vjp(x, d_log, projection, consts, hyperbolic, d_proj, dx):
    """``dx`` from the cotangent ``d_log`` of :func:`linattn_numba.cpu._log_features`.

    ``l(x) = +-P x - s |x|^2 / 2 - c``: ``dx = (d_+ - d_-) P - s x sum_r d_r``; rows
    whose ``s |x|^2 / 2`` overflows have constant (``-inf``) features: ``dx = 0``.
    """
    n = x.shape[0]
    rows = projection.shape[0]
    width = d_log.shape[1]
    d = x.shape[1]
    root_half_scale = np.sqrt(consts[0])
    scale = consts[0] + consts[0]  # (2 * x would be float64)
    if hyperbolic:
        for i in range(n):
            for r in range(rows):
                d_proj[i, r] = d_log[i, r] - d_log[i, rows + r]
        np.dot(d_proj, projection, dx)
    else:
        np.dot(d_log, projection, dx)
    for i in range(n):
        if _half_norm(x[i], root_half_scale) == np.inf:
            for e in range(d):
                dx[i, e] = 0
            continue
        total = d_log[i, 0] - d_log[i, 0]
        for r in range(width):
            total += d_log[i, r]
        weight = scale * total
        for e in range(d):
            dx[i, e] -= weight * x[i, e]


@_jit()
def _normalise_rows(block, den, out):
    """``out = block / den`` row by row; zeros where the denominator is 0."""
    dv = out.shape[1]
    for i in range(out.shape[0]):
        if den[i] != 0:
            for e in range(dv):
                out[i, e] = block[i, e] / den[i]
        else:
            for e in range(dv):
                out[i, e] = den[i]


# -- passes -----------------------------------------------------------------------------


@_jit()
def _workspace(span, m, rows, hyperbolic, width, dtype):
    """Per worker: projection scratch, two feature blocks, two value-width blocks, six
    vectors (shifts, sums, :data:`LANES` scratch) and an ``m x (d_v + 1)`` product."""
    return (
        np.empty((span if hyperbolic else 0, rows), dtype),
        np.empty((2, span, m), dtype),
        np.empty((2, span, width), dtype),
        np.empty((6, max(m, span, LANES)), dtype),
        np.empty((m, width), dtype),
    )


@_jit()
def _key_log_features(x, mask, projection, consts, hyperbolic, proj, lk):
    """``lk = l(k)`` of one block of keys (:func:`linattn_numba.cpu._log_features`), ``-inf``
    rows for masked keys."""
    _log_features(x, projection, consts, hyperbolic, proj, lk)
    for j in range(lk.shape[0]):
        if not mask[j]:
            for r in range(lk.shape[1]):
                lk[j, r] = -np.inf


@_jit(fastmath=frozenset({"contract", "reassoc"}))
def _exp_rows(lk, shift, sums):
    """``lk = exp(lk - shift)`` in place (one array: aliased arguments would not
    vectorise), and ``sums`` its column sums, summed in any order."""
    sums[:] = 0
    for j in range(lk.shape[0]):
        row = lk[j]
        for r in range(lk.shape[1]):
            p = fast_exp(row[r] - shift[r])
            row[r] = p
            sums[r] += p


@_jit()
def _absorb_all(k, v, mask, projection, consts, hyperbolic, kv, mu, work):
    """Pass 1 of one head: every key block into ``(kv, mu)``.

    Per block: ``mu' = max(mu, max_j l(k_j))``, ``phi = exp(l(K) - mu')``, and ``S' =
    exp(mu - mu') S + phi^T [V | 1]`` as ``phi^T V`` (``d_v`` columns: ``d_v + 1`` runs
    as slowly as 80 in BLAS, measured) and ``phi``'s column sums.
    """
    proj, feats, blocks, vecs, product = work
    m, dv = mu.shape[0], v.shape[1]
    ms, top, shift, decay, sums = vecs[0][:m], vecs[1][:m], vecs[2][:m], vecs[3][:m], vecs[4][:m]
    span = feats.shape[1]
    values = blocks[0].reshape(-1)[: span * dv].reshape((span, dv))
    numerators = product.reshape(-1)[: m * dv].reshape((m, dv))
    for s0 in range(0, k.shape[0], span):
        s1 = min(s0 + span, k.shape[0])
        n = s1 - s0
        lk = feats[0][:n]
        _safe_shift(mu, ms)
        _key_log_features(k[s0:s1], mask[s0:s1], projection, consts, hyperbolic, proj[:n], lk)
        _running_max(lk, mu, top)
        _shift_between(mu, top, ms, shift, decay)
        _exp_rows(lk, shift, sums)
        every = True
        for j in range(s0, s1):
            every = every and mask[j]
        block_values = v[s0:s1]
        if not every:  # masked keys' values zeroed: nothing they hold (NaN) reaches S
            block_values = values[:n]
            for j in range(n):
                for e in range(dv):
                    block_values[j, e] = v[s0 + j, e] if mask[s0 + j] else 0
        np.dot(lk.T, block_values, numerators)
        for r in range(m):
            scale = decay[r]
            mu[r] = top[r]
            for e in range(dv):
                kv[r, e] = scale * kv[r, e] + numerators[r, e]
            kv[r, dv] = scale * kv[r, dv] + sums[r]


@_jit()
def _split_state(kv, numerators, z):
    """``numerators = S[:, :d_v]`` (contiguous, for BLAS) and ``z = S[:, d_v]``."""
    dv = numerators.shape[1]
    for r in range(kv.shape[0]):
        for e in range(dv):
            numerators[r, e] = kv[r, e]
        z[r] = kv[r, dv]


@_jit()
def _merge_sinks(q, t, sinks, sink_values, visible, window_consts, far, far_scale, work, out):
    """``out[t]``: query ``t``'s far row ``exp(far_scale) far`` (``[num | den]``) merged
    with its exact sinks (:func:`linattn_numba._hybrid._exact_rows` with no window)."""
    scratch, row, later, recent, recent_values, keep = work
    top = _hybrid._exact_rows(
        q, q, sink_values, recent, recent_values, keep, sinks, sink_values, visible, t, -1, 0,
        window_consts, scratch, row[0],
    )  # fmt: skip
    _hybrid._merge_into(
        far, 0, far_scale, later, 0, typed(-np.inf, far_scale), row, 0, row[0, out.shape[1]], top,
        window_consts[0], out, t,
    )  # fmt: skip


@_machinery.Variants
def _forward(
    q, k, v, mask, projection, consts, hyperbolic, kv, mu, out, lse, sinks, sink_values,
    visible, window_consts,
):  # fmt: skip
    """All heads; ``lse`` (``(batch, L)``, or ``(batch, 0)`` to skip it) gets the log of
    each row's true denominator over the feature-map keys, ``-inf`` where the row sees
    none.  Sinks (``(batch, S, d)`` keys, their values, ``visible`` ``(batch, L, S)``) are
    attended exactly and merged per query (``S = 0``: none)."""
    batch, length, d = q.shape
    m, width = kv.shape[1], kv.shape[2]
    dv = width - 1
    count = sinks.shape[1]
    span = min(FEATURE_BLOCK, max(length, k.shape[1], 1))
    for b in prange(batch):
        work = _workspace(span, m, projection.shape[0], hyperbolic, width, q.dtype)
        proj, feats, blocks, vecs, product = work
        _absorb_all(k[b], v[b], mask[b], projection, consts, hyperbolic, kv[b], mu[b], work)
        ms, z, den, lanes = vecs[0][:m], vecs[1][:m], vecs[2][:span], vecs[5][:LANES]
        scale = vecs[3][:span]
        numerators = product.reshape(-1)[: m * dv].reshape((m, dv))
        block = blocks[0].reshape(-1)[: span * dv].reshape((span, dv))
        far = blocks[1][:1]
        sink_work = (
            np.empty(count, q.dtype), np.empty((1, width), q.dtype), np.zeros((1, width), q.dtype),
            np.empty((0, d), q.dtype), np.empty((0, dv), q.dtype), mask[b],
        )  # fmt: skip
        _safe_shift(mu[b], ms)
        _split_state(kv[b], numerators, z)
        for s0 in range(0, length, span):
            s1 = min(s0 + span, length)
            n = s1 - s0
            u = feats[0][:n]
            _query_block(q[b][s0:s1], projection, consts, hyperbolic, proj[:n], ms, lanes, z,
                         u, den[:n], scale[:n])  # fmt: skip
            np.dot(u, numerators, block[:n])
            if lse.shape[1]:  # log(0) = -inf: a row that sees no key; NaN stays NaN
                for i in range(n):
                    lse[b, s0 + i] = np.log(den[i]) + scale[i]
            if count == 0:
                _normalise_rows(block[:n], den[:n], out[b][s0:s1])
                continue
            for i in range(n):
                for e in range(dv):
                    far[0, e] = block[i, e]
                far[0, dv] = den[i]
                _merge_sinks(q[b], s0 + i, sinks[b], sink_values[b], visible[b], window_consts,
                             far, scale[i], sink_work, out[b])  # fmt: skip


@_jit()
def _query_cotangents(u, kv, out, grad, d_aug):
    """``A_t = [g_t / D_t, -(g_t . o_t) / D_t]``, ``D_t = u_t . S[:, d_v]``; 0 where
    ``D_t = 0`` (a query that sees no key outputs zeros whatever the inputs)."""
    n, m = u.shape
    dv = out.shape[1]
    for i in range(n):
        den = u[i, 0] * kv[0, dv]
        for r in range(1, m):
            den += u[i, r] * kv[r, dv]
        if den == 0:
            for e in range(dv + 1):
                d_aug[i, e] = 0
            continue
        paired = grad[i, 0] - grad[i, 0]
        for e in range(dv):
            d_aug[i, e] = grad[i, e] / den
            paired += grad[i, e] * out[i, e]
        d_aug[i, dv] = -paired / den


@_machinery.Variants
def _backward(q, k, v, mask, projection, consts, hyperbolic, kv, mu, out, grad, dq, dk, dv):
    batch, length, _ = q.shape
    m, width = kv.shape[1], kv.shape[2]
    rows = projection.shape[0]
    span = min(FEATURE_BLOCK, max(length, k.shape[1], 1))
    for b in prange(batch):
        proj, feats, blocks, vecs, product = _workspace(span, m, rows, hyperbolic, width, q.dtype)
        d_state = np.zeros((m, width), q.dtype)
        ms, z, lanes = vecs[0][:m], vecs[1][:m], vecs[5][:LANES]
        _safe_shift(mu[b], ms)
        z[:] = kv[b][:, width - 1]
        # Queries: d l(q) = u * (A S^T), dS = u^T A.
        for s0 in range(0, length, span):
            s1 = min(s0 + span, length)
            n = s1 - s0
            u, d_aug, du = feats[0][:n], blocks[0][:n], feats[1][:n]
            _query_block(q[b][s0:s1], projection, consts, hyperbolic, proj[:n], ms, lanes, z,
                         u, vecs[2][:n], vecs[3][:n])  # fmt: skip
            _query_cotangents(u, kv[b], out[b][s0:s1], grad[b][s0:s1], d_aug)
            np.dot(d_aug, kv[b].T, du)
            np.dot(u.T, d_aug, product)
            d_state += product
            du *= u
            _features_vjp(q[b][s0:s1], du, projection, consts, hyperbolic, proj[:n],
                          dq[b][s0:s1])  # fmt: skip
        # Keys: d l(k) = phi * ([V|1] dS^T), d[V|1] = phi dS.
        for s0 in range(0, k.shape[1], span):
            s1 = min(s0 + span, k.shape[1])
            n = s1 - s0
            phi, va, d_va, dphi = feats[0][:n], blocks[0][:n], blocks[1][:n], feats[1][:n]
            _key_block(k[b][s0:s1], v[b][s0:s1], mask[b][s0:s1], projection, consts,
                       hyperbolic, proj[:n], phi, va)  # fmt: skip
            _key_factors(phi, ms)
            np.dot(va, d_state.T, dphi)
            np.dot(phi, d_state, d_va)
            dphi *= phi
            dv[b][s0:s1] = d_va[:, : width - 1]
            _features_vjp(k[b][s0:s1], dphi, projection, consts, hyperbolic, proj[:n],
                          dk[b][s0:s1])  # fmt: skip


# -- checks and entry points --------------------------------------------------------------


class _Call:
    """One checked call: flattened, contiguous operands in the compute dtype."""

    def __init__(
        self,
        q: Any,
        k: Any,
        v: Any,
        projection: Any,
        hyperbolic: object,
        scale: object,
        key_mask: Any,
    ) -> None:
        arrays = {"q": q, "k": k, "v": v, "projection": projection}
        if key_mask is not None:
            arrays["key_mask"] = key_mask
        for name, x in arrays.items():
            if not isinstance(x, np.ndarray):
                raise TypeError(
                    f"{name} must be a numpy.ndarray; got {type(x).__module__}.{type(x).__name__}"
                )
        for name in ("q", "k", "v", "projection"):
            if not np.issubdtype(arrays[name].dtype, np.floating):
                raise TypeError(f"{name} must have a floating dtype; got {arrays[name].dtype}")
        if key_mask is not None and key_mask.dtype != np.bool_:
            raise TypeError(f"key_mask must have dtype bool; got {key_mask.dtype}")
        if not isinstance(hyperbolic, bool | np.bool_):
            raise TypeError(f"hyperbolic must be True or False; got {hyperbolic!r}")
        if isinstance(scale, bool) or not isinstance(scale, int | float | np.floating):
            raise TypeError(f"scale must be a positive float; got {scale!r}")
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"scale must be a positive float; got {scale!r}")
        for name in ("q", "k", "v"):
            if arrays[name].ndim < 2:
                raise ValueError(
                    f"{name} must have shape (*batch, L, d); got {arrays[name].shape}"
                )
        if projection.ndim != 2 or projection.shape[1] != q.shape[-1]:
            raise ValueError(
                f"projection must have shape (rows, {q.shape[-1]}) to match q {q.shape}; "
                f"got {projection.shape}"
            )
        if k.shape[-1] != q.shape[-1]:
            raise ValueError(f"k must have shape (..., {q.shape[-1]}) like q; got {k.shape}")
        length, key_length = q.shape[-2], k.shape[-2]
        if v.shape[-2] != key_length:
            raise ValueError(
                f"v must have shape (..., {key_length}, d_v) to match k {k.shape}; got {v.shape}"
            )
        if key_mask is not None and (key_mask.ndim < 1 or key_mask.shape[-1] != key_length):
            raise ValueError(
                f"key_mask must have shape (..., {key_length}) to match k {k.shape}; "
                f"got {key_mask.shape}"
            )
        shapes = [q.shape[:-2], k.shape[:-2], v.shape[:-2]]
        shapes += [] if key_mask is None else [key_mask.shape[:-1]]
        try:
            batch = np.broadcast_shapes(*shapes)
        except ValueError:
            raise ValueError(
                "the batch axes of q, k, v (and key_mask) must broadcast; got "
                f"q {q.shape}, k {k.shape}, v {v.shape}"
                + ("" if key_mask is None else f", key_mask {key_mask.shape}")
            ) from None
        self.dtype = np.dtype(np.float64) if q.dtype == np.float64 else np.dtype(np.float32)
        self.batch, self.n = batch, math.prod(batch)
        self.length, self.dv, self.d = length, v.shape[-1], q.shape[-1]
        self.m = projection.shape[0] * (2 if hyperbolic else 1)
        self.hyperbolic = bool(hyperbolic)

        def flat(x: np.ndarray, tail: tuple[int, ...], dtype: Any) -> np.ndarray:
            return _flat(np.broadcast_to(x, (*batch, *tail)), (self.n, *tail), dtype)

        self.q = flat(q, (length, self.d), self.dtype)
        self.k = flat(k, (key_length, self.d), self.dtype)
        self.v = flat(v, (key_length, self.dv), self.dtype)
        mask = np.ones(key_length, bool) if key_mask is None else key_mask
        self.mask = flat(mask, (key_length,), None)
        self.consts = np.array([0.5 * scale, 0.5 * np.log(self.m)], dtype=self.dtype)
        self.projection = np.ascontiguousarray(np.sqrt(scale) * projection, dtype=self.dtype)
        tokens = max(length, key_length)
        self.variant = _machinery.choose_variant(self.n, tokens, self.m * (self.dv + 1))

    def operands(self) -> tuple[Any, ...]:
        return (self.q, self.k, self.v, self.mask, self.projection, self.consts, self.hyperbolic)

    def sinks(self, sinks: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The checked, flattened ``(keys, values, visible)`` of exact keys (none: empty)."""
        if sinks is None:
            return (
                np.zeros((self.n, 0, self.d), self.dtype),
                np.zeros((self.n, 0, self.dv), self.dtype),
                np.zeros((self.n, self.length, 0), np.bool_),
            )
        if not isinstance(sinks, tuple) or len(sinks) != 3:
            raise TypeError(f"sinks must be a tuple (keys, values, visible); got {sinks!r}")
        keys, values, visible = sinks
        for name, x in (("sink keys", keys), ("sink values", values), ("visible", visible)):
            if not isinstance(x, np.ndarray):
                raise TypeError(
                    f"{name} must be a numpy.ndarray; got {type(x).__module__}.{type(x).__name__}"
                )
        if visible.dtype != np.bool_:
            raise TypeError(f"visible must have dtype bool; got {visible.dtype}")
        count = keys.shape[-2] if keys.ndim >= 2 else -1
        expected = {
            "sink keys": (keys, (count, self.d)),
            "sink values": (values, (count, self.dv)),
            "visible": (visible, (self.length, count)),
        }
        for name, (x, tail) in expected.items():
            if x.ndim < 2 or tuple(x.shape[-2:]) != tail:
                raise ValueError(f"{name} must have shape (*batch, {tail[0]}, {tail[1]}); "
                                 f"got {x.shape}")  # fmt: skip
        return (
            self.shaped(keys, count, self.d),
            self.shaped(values, count, self.dv),
            _flat(np.broadcast_to(visible, (*self.batch, self.length, count)),
                  (self.n, self.length, count), None),
        )  # fmt: skip

    def shaped(self, x: np.ndarray, *tail: int) -> np.ndarray:
        """A checked flat array ``(n, *tail)`` in the compute dtype, C-contiguous."""
        return _flat(np.broadcast_to(x, (*self.batch, *tail)), (self.n, *tail), self.dtype)

    def check(self, name: str, x: Any, tail: tuple[int, ...]) -> np.ndarray:
        if not isinstance(x, np.ndarray):
            raise TypeError(
                f"{name} must be a numpy.ndarray; got {type(x).__module__}.{type(x).__name__}"
            )
        expected = (*self.batch, *tail)
        if tuple(x.shape) != expected:
            raise ValueError(f"{name} must have shape {expected}; got {tuple(x.shape)}")
        return self.shaped(x, *tail)


def favor_bidirectional(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    projection: np.ndarray,
    *,
    hyperbolic: bool,
    scale: float,
    key_mask: np.ndarray | None = None,
    return_log_normaliser: bool = False,
    sinks: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
) -> tuple[np.ndarray, ...]:
    """Bidirectional FAVOR+ in two compiled passes, features included: no ``L x m`` array.

    The same results, up to rounding, as ``FeatureMap.signed_log_features`` followed by
    ``linattn.causal.bidirectional`` and ``linattn.causal.normalise`` for the
    ``"positive"`` and ``"hyperbolic"`` kinds (unrebalanced, no statistics).

    Parameters
    ----------
    q : ndarray, shape ``(*batch, L_q, d)``
    k, v : ndarrays, shapes ``(*batch, L_k, d)`` and ``(*batch, L_k, d_v)``
        Batch axes broadcast; cast to the compute dtype (float64 stays, else float32).
    projection : ndarray, shape ``(rows, d)``
        The feature map's projection (``m = rows``, or ``2 rows`` for ``hyperbolic``).
    hyperbolic : bool
        The ``"hyperbolic"`` kind (features ``exp(+-w.x)``) rather than ``"positive"``.
    scale : float
        The softmax scale.
    key_mask : bool ndarray, shape ``(*batch, L_k)``, optional
        True for keys that take part; a query that sees no key gets zeros.
    return_log_normaliser : bool, default False
        Also return each row's log-denominator ``log sum_j phi(q_t) . phi(k_j)``
        (``(*batch, L_q)``, ``-inf`` where the query sees no key): what merging these
        rows with other partials needs (over the feature-map keys alone).
    sinks : (keys, values, visible), optional
        Keys attended exactly, ``(*batch, S, d)``, their values ``(*batch, S, d_v)`` and
        ``visible`` ``(*batch, L_q, S)`` (bool): each query's exact weights
        ``exp(scale q . k)`` are merged with its feature-map row as online softmax does
        (keep them out of ``key_mask``: a key in both counts twice).

    Returns
    -------
    (outputs, kv, log_shift) or (outputs, kv, log_shift, log_normaliser)
        Normalised outputs ``(*batch, L_q, d_v)`` and the state after every key,
        ``(*batch, m, d_v + 1)`` and ``(*batch, m)`` (what the backward takes).

    Examples
    --------
    >>> import numpy as np
    >>> x = np.zeros((1, 3, 2)); v = np.arange(6.0).reshape(1, 3, 2)
    >>> out, kv, mu = favor_bidirectional(x, x, v, np.eye(2), hyperbolic=False, scale=1.0)
    >>> out[0]  # equal features: every query gets the mean value
    array([[2., 3.],
           [2., 3.],
           [2., 3.]])
    """
    call = _Call(q, k, v, projection, hyperbolic, scale, key_mask)
    kv = np.zeros((call.n, call.m, call.dv + 1), call.dtype)
    mu = np.full((call.n, call.m), -np.inf, call.dtype)
    out = np.empty((call.n, call.length, call.dv), call.dtype)
    if not isinstance(return_log_normaliser, bool | np.bool_):
        raise TypeError(
            f"return_log_normaliser must be True or False; got {return_log_normaliser!r}"
        )
    lse = np.empty((call.n, call.length if return_log_normaliser else 0), call.dtype)
    exact = call.sinks(sinks)
    window_consts = np.array([0.0, -np.inf, scale], dtype=call.dtype)
    with _machinery.single_threaded_blas():
        _forward.run(call.variant, *call.operands(), kv, mu, out, lse, *exact, window_consts)
    batch = call.batch
    results = (
        out.reshape((*batch, call.length, call.dv)),
        kv.reshape((*batch, call.m, call.dv + 1)),
        mu.reshape((*batch, call.m)),
    )
    if return_log_normaliser:
        return (*results, lse.reshape((*batch, call.length)))
    return results


def favor_bidirectional_backward(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    projection: np.ndarray,
    kv: np.ndarray,
    log_shift: np.ndarray,
    outputs: np.ndarray,
    grad_output: np.ndarray,
    *,
    hyperbolic: bool,
    scale: float,
    key_mask: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gradients ``(dq, dk, dv)`` of ``sum(grad_output * outputs)`` for
    :func:`favor_bidirectional`, given its results ``(outputs, kv, log_shift)``.

    Stabilisers are held constant (exact for the normalised outputs).  Gradients have
    the broadcast batch shape ``(*batch, L, d)`` in the compute dtype (sum over
    broadcast axes yourself).  Masked keys get zero gradients.

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.normal(size=(1, 4, 2)) for _ in range(3))
    >>> w, g = rng.normal(size=(3, 2)), rng.normal(size=(1, 4, 2))
    >>> out, kv, mu = favor_bidirectional(q, k, v, w, hyperbolic=False, scale=0.5)
    >>> dq, dk, dv = favor_bidirectional_backward(
    ...     q, k, v, w, kv, mu, out, g, hyperbolic=False, scale=0.5)
    >>> v2 = v.copy(); v2[0, 1, 0] += 1e-6
    >>> out2, _, _ = favor_bidirectional(q, k, v2, w, hyperbolic=False, scale=0.5)
    >>> bool(abs((g * (out2 - out)).sum() / 1e-6 - dv[0, 1, 0]) < 1e-5)
    True
    """
    call = _Call(q, k, v, projection, hyperbolic, scale, key_mask)
    state = call.check("kv", kv, (call.m, call.dv + 1))
    mu = call.check("log_shift", log_shift, (call.m,))
    state = _without_empty_rows(state.copy(), mu)
    out = call.check("outputs", outputs, (call.length, call.dv))
    grad = call.check("grad_output", grad_output, (call.length, call.dv))
    dq, dk, dv = (np.empty(x.shape, call.dtype) for x in (call.q, call.k, call.v))
    with _machinery.single_threaded_blas():
        _backward.run(call.variant, *call.operands(), state, mu, out, grad, dq, dk, dv)
    batch = call.batch
    return (
        dq.reshape((*batch, *dq.shape[1:])),
        dk.reshape((*batch, *dk.shape[1:])),
        dv.reshape((*batch, *dv.shape[1:])),
    )
