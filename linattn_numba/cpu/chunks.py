"""Chunk primitives of the chunked causal scan: shifts, running maxima, chunk products.

Per chunk of ``C`` tokens, with the state ``(S, mu)`` from earlier chunks (the module
docstring of :mod:`linattn_numba.cpu.causal` states the algorithm): the queries' and keys'
shifts (:func:`chunk_shifts`), the running maximum of the keys' log-features
(:func:`running_max`), the shift between two states (:func:`shift_between`), the keys'
features (:func:`key_features`), the absorption of a chunk into the state
(:func:`absorb`), the forward of one chunk (:func:`chunk_forward`) and its backward
(:func:`chunk_backward`), and the workspaces they run in.  Used by the causal, fused
causal, hybrid and decoding passes.
"""

from __future__ import annotations

import numpy as np

from linattn_numba import _machinery
from linattn_numba.cpu.scalars import fast_exp, larger, safe_shift, typed

__all__ = [
    "absorb",
    "backward_workspace",
    "chunk_backward",
    "chunk_backward_factors",
    "chunk_backward_grads",
    "chunk_forward",
    "chunk_shifts",
    "chunk_workspace",
    "key_features",
    "mask_later_keys",
    "rescue_rows",
    "running_max",
    "shift_between",
]

_jit = _machinery.jit


@_jit()
def _term(x, i, r, shift, negate):
    """``x[i, r] - shift[r]`` if ``negate`` else ``x[i, r] + shift[r]``, in ``x``'s dtype."""
    return x[i, r] - shift[r] if negate else x[i, r] + shift[r]


@_jit()
def _shifted_row_max(x, i, shift, negate):
    """``max_r (x[i, r] -+ shift[r])`` (``-`` if ``negate``), as the loop ``f = first;
    if v > f: f = v`` computes it (values after the first that are NaN are passed over; a
    NaN first value of a lane stays).

    Eight independent running maxima: one compare-and-select chain over ``m`` features
    runs at its latency (measured 16.8 against 6.1 us for 64 rows of 256, one thread).
    The sign is a flag, not a factor: an integer ``+-1`` times a float32 shift is float64
    arithmetic in Numba (measured 27 against 18 us for two blocks of 64 x 256).
    """
    m = x.shape[1]
    if m < 8:
        top = _term(x, i, 0, shift, negate)
        for r in range(1, m):
            top = larger(_term(x, i, r, shift, negate), top)
        return top
    a0, a1 = _term(x, i, 0, shift, negate), _term(x, i, 1, shift, negate)
    a2, a3 = _term(x, i, 2, shift, negate), _term(x, i, 3, shift, negate)
    a4, a5 = _term(x, i, 4, shift, negate), _term(x, i, 5, shift, negate)
    a6, a7 = _term(x, i, 6, shift, negate), _term(x, i, 7, shift, negate)
    full = m - m % 8
    for r in range(8, full, 8):
        a0 = larger(_term(x, i, r, shift, negate), a0)
        a1 = larger(_term(x, i, r + 1, shift, negate), a1)
        a2 = larger(_term(x, i, r + 2, shift, negate), a2)
        a3 = larger(_term(x, i, r + 3, shift, negate), a3)
        a4 = larger(_term(x, i, r + 4, shift, negate), a4)
        a5 = larger(_term(x, i, r + 5, shift, negate), a5)
        a6 = larger(_term(x, i, r + 6, shift, negate), a6)
        a7 = larger(_term(x, i, r + 7, shift, negate), a7)
    for r in range(full, m):
        a0 = larger(_term(x, i, r, shift, negate), a0)
    a0, a2, a4, a6 = larger(a1, a0), larger(a3, a2), larger(a5, a4), larger(a7, a6)
    return larger(larger(a4, a6), larger(a2, a0))


@_jit()
def chunk_shifts(lq, lk, ms, has_state, u, psi, g, run, w, weights, fq):
    """Queries ``u``, their shifts ``F`` (into ``fq``), keys ``psi``, ``G``, running ``R``,
    state weights ``w`` and the masked intra-chunk weights ``exp(G_j - R_t)`` (lower
    triangle) of one chunk."""
    c, m = lq.shape
    zero = ms[0] - ms[0]
    for i in range(c):
        f = _shifted_row_max(lq, i, ms, False)
        if not np.isfinite(f):
            f = zero
        fq[i] = f
        for r in range(m):
            u[i, r] = fast_exp(lq[i, r] + ms[r] - f)
    for j in range(c):
        gj = _shifted_row_max(lk, j, ms, True)
        g[j] = gj
        if not np.isfinite(gj):
            gj = zero
        for r in range(m):
            psi[j, r] = fast_exp(lk[j, r] - ms[r] - gj)
    best = zero if has_state else typed(-np.inf, zero)
    floor = best
    for i in range(c):
        if g[i] > best:
            best = g[i]
        run[i] = best if np.isfinite(best) else zero
        w[i] = fast_exp(floor - run[i]) if has_state else zero
    for i in range(c):
        top = run[i]  # (a local: loads inside the loops would stop vectorisation)
        for j in range(i + 1):
            weights[i, j] = fast_exp(g[j] - top)
        for j in range(i + 1, c):
            weights[i, j] = zero


@_jit()
def running_max(lk, mu, top):
    """``top = max(mu, max_j l(k_j))`` per feature (``np.maximum`` rows: it vectorises)."""
    top[:] = mu
    for j in range(lk.shape[0]):
        np.maximum(top, lk[j], top)


@_jit()
def shift_between(mu, top, ms, shift, decay):
    """Shifts of one chunk's key absorption, from ``mu`` before it to ``mu' = top`` after:
    ``shift = mu'`` where finite, else 0, and ``decay = exp(ms - shift)`` (0 where ``mu``
    has seen no key).  Returns whether ``mu`` had seen every feature."""
    zero = ms[0] - ms[0]
    full = True
    for r in range(mu.shape[0]):
        safe = top[r] if np.isfinite(top[r]) else zero
        if np.isfinite(mu[r]):
            decay[r] = fast_exp(ms[r] - safe)
        else:
            decay[r] = zero
            full = False
        shift[r] = safe
    return full


@_jit()
def key_features(lk, shift, decay, psi, g, reuse, phi):
    """``phi_j = exp(l(k_j) - shift)``, the keys as the state after the chunk holds them.

    With ``reuse`` (the state before the chunk had seen every feature), keys that raise
    no feature's maximum (``G_j <= 0``) take ``phi_j = psi_j exp(G_j) decay`` from the
    chunk's ``psi`` instead of new exponentials: every factor is at most 1, so it is
    exact up to rounding and underflows only where ``phi`` itself does.
    """
    c, m = lk.shape
    for j in range(c):
        if reuse and g[j] <= 0:
            key_scale = fast_exp(g[j])
            for r in range(m):
                phi[j, r] = psi[j, r] * key_scale * decay[r]
        else:
            for r in range(m):
                phi[j, r] = fast_exp(lk[j, r] - shift[r])


@_jit()
def absorb(lk, va, kv, mu, ms, phi, top, shift, decay, product, psi, g, reuse):
    """``(S, mu) <- (exp(ms - mu') S + exp(l(K) - mu')^T [V|1], mu')``; leaves ``phi``
    (:func:`key_features`; ``reuse`` needs the chunk's ``psi`` and ``G``)."""
    m = lk.shape[1]
    running_max(lk, mu, top)
    full = shift_between(mu, top, ms, shift, decay)
    key_features(lk, shift, decay, psi, g, reuse and full, phi)
    np.dot(phi.T, va, product)
    for r in range(m):
        scale = decay[r]
        mu[r] = top[r]
        for e in range(kv.shape[1]):
            kv[r, e] = scale * kv[r, e] + product[r, e]


@_jit()
def mask_later_keys(products, weights):
    """``products *= weights`` on and below the diagonal (keys ``j <= t``), ``0`` above.

    Selected, not multiplied by the zero weights: a later key whose features are NaN or
    inf (``inf * 0`` is NaN) must not reach an earlier query's output.
    """
    c = products.shape[0]
    for i in range(c):
        for j in range(i + 1):
            products[i, j] *= weights[i, j]
        for j in range(i + 1, c):
            products[i, j] = 0


@_jit()
def chunk_forward(
    lq, lk, va, kv, mu, block, work, square, vecs, state_out, product, scale_out, rescue_below
):  # fmt: skip
    """Unnormalised outputs of one chunk into ``block``; then ``(kv, mu)`` absorb its keys.

    ``scale_out`` gets each row's log-scale ``F_t + R_t`` (true ``[num | den]`` is
    ``exp(F_t + R_t)`` times the row) when it has the chunk's length; pass an empty
    array to skip it.  Rows whose denominator falls below ``rescue_below`` (0: never)
    are computed again by :func:`rescue_rows` (forward-only passes: a backward would
    recompute the shared shifts).
    """
    c, m = lq.shape
    d = va.shape[1]
    u, psi, phi = work[0][:c], work[1][:c], work[2][:c]
    weights = square[0][: c * c].reshape(c, c)
    intra = square[1][: c * c].reshape(c, c)
    ms, shift, decay, top = vecs[0][:m], vecs[1][:m], vecs[2][:m], vecs[6][:m]
    g, run, w, fq = vecs[3][:c], vecs[4][:c], vecs[5][:c], vecs[7][:c]
    has_state = safe_shift(mu, ms)
    chunk_shifts(lq, lk, ms, has_state, u, psi, g, run, w, weights, fq)
    if scale_out.shape[0] == c:
        for i in range(c):
            scale_out[i] = fq[i] + run[i]
    np.dot(u, psi.T, intra)
    mask_later_keys(intra, weights)
    np.dot(u, kv, state_out[:c])
    np.dot(intra, va, block)
    for i in range(c):
        weight = w[i]
        for e in range(d):
            block[i, e] += weight * state_out[i, e]
    if rescue_below > 0:
        rescue_rows(lq, lk, va, kv, ms, has_state, block, scale_out, rescue_below)
    absorb(lk, va, kv, mu, ms, phi, top, shift, decay, product, psi, g, True)


@_jit()
def rescue_rows(lq, lk, va, kv, ms, has_state, block, scale_out, below):
    """Rows of :func:`chunk_forward` whose denominator fell below ``below``, again, shifted
    by their own largest logit.

    The chunk's shifts are shared: ``R_t``, the keys' running maximum of ``G_j = max_r
    (l(k_j)_r - ms_r)``, is raised by a key whose features peak where the state holds
    nothing (``ms_r`` far below 0), whatever the query weighs there.  With sharply
    peaked fitted maps (weights x1e4 in float64) a row's every term then underflows
    and its keys were lost.  Here the row's shift is the largest of ``l(q_t)_r + ms_r +
    log S[r, d_v]`` (the state) and ``l(q_t)_r + l(k_j)_r`` (the chunk's keys ``j <=
    t``), so its largest term is 1: ``O(m d + t m)`` per rescued row, rare.
    """
    c, m = lq.shape
    d = va.shape[1]
    neg = typed(-np.inf, ms[0])
    for i in range(c):
        if not block[i, d - 1] < below:  # (NaN rows stay as they are)
            continue
        top = neg
        if has_state:
            for r in range(m):
                if kv[r, d - 1] > 0:
                    top = larger(lq[i, r] + ms[r] + np.log(kv[r, d - 1]), top)
        for j in range(i + 1):
            for r in range(m):
                top = larger(lq[i, r] + lk[j, r], top)
        if not np.isfinite(top):
            continue  # (no key: the row stays empty)
        for e in range(d):
            block[i, e] = 0
        if has_state:
            for r in range(m):
                if kv[r, d - 1] > 0:
                    f = fast_exp(lq[i, r] + ms[r] - top)
                    for e in range(d):
                        block[i, e] += f * kv[r, e]
        for j in range(i + 1):
            p = top - top
            for r in range(m):
                p += fast_exp(lq[i, r] + lk[j, r] - top)
            for e in range(d):
                block[i, e] += p * va[j, e]
        if scale_out.shape[0] == c:
            scale_out[i] = top


@_jit()
def chunk_workspace(chunk, m, d, dtype):
    return (
        np.empty((3, chunk, m), dtype),
        np.empty((2, chunk * chunk), dtype),
        np.empty((8, max(m, chunk)), dtype),
        np.empty((chunk, d), dtype),
        np.empty((m, d), dtype),
    )


@_jit()
def chunk_backward(
    lq, lk, va, dout, kv, mu, mu_next, ds, dlq, dlk, dva, rows, vecs, square, scaled, product
):
    """Gradients of one chunk given the states before (``kv``, ``mu``) and after
    (``mu_next``) it and ``dS`` after it; updates ``ds`` to ``dS`` before it."""
    chunk_backward_factors(lq, lk, mu, mu_next, rows, vecs, square)
    chunk_backward_grads(va, dout, kv, ds, dlq, dlk, dva, rows, vecs, square, scaled, product)


@_jit()
def chunk_backward_factors(lq, lk, mu, mu_next, rows, vecs, square):
    """The forward's factors of one chunk, as :func:`chunk_backward` needs them: ``u``,
    ``psi``, ``phi`` (``rows[0, 1, 4]``), the shifts and weights (``vecs``) and the
    masked ``intra = (u psi^T) * weights`` (``square[1]``; ``weights`` in ``square[0]``)."""
    c, m = lq.shape
    u, psi, phi = rows[0][:c], rows[1][:c], rows[4][:c]
    ms, decay, shift = vecs[0][:m], vecs[1][:m], vecs[2][:m]
    g, run, w, fq = vecs[3][:c], vecs[4][:c], vecs[5][:c], vecs[7][:c]
    weights = square[0][: c * c].reshape(c, c)
    intra = square[1][: c * c].reshape(c, c)
    has_state = safe_shift(mu, ms)
    chunk_shifts(lq, lk, ms, has_state, u, psi, g, run, w, weights, fq)
    full = shift_between(mu, mu_next, ms, shift, decay)
    key_features(lk, shift, decay, psi, g, full, phi)
    np.dot(u, psi.T, intra)
    mask_later_keys(intra, weights)


@_jit()
def chunk_backward_grads(va, dout, kv, ds, dlq, dlk, dva, rows, vecs, square, scaled, product):
    """The rest of :func:`chunk_backward`, after :func:`chunk_backward_factors`."""
    c, d = va.shape
    m = kv.shape[0]
    u, psi, du, dpsi, phi = rows[0][:c], rows[1][:c], rows[2][:c], rows[3][:c], rows[4][:c]
    decay = vecs[1][:m]
    w = vecs[5][:c]
    weights = square[0][: c * c].reshape(c, c)
    intra = square[1][: c * c].reshape(c, c)
    paired = square[2][: c * c].reshape(c, c)
    scaled = scaled[:c]
    np.dot(dout, va.T, paired)
    mask_later_keys(paired, weights)
    # d l(q) = u * (w dO S^T + P psi), P = (dO [V|1]^T) * weights
    np.dot(dout, kv.T, du)
    np.dot(paired, psi, dpsi)
    for i in range(c):
        weight = w[i]
        for r in range(m):
            dlq[i, r] = u[i, r] * (weight * du[i, r] + dpsi[i, r])
    # d l(k) = psi * (P^T u) + phi * ([V|1] dS^T)
    np.dot(paired.T, u, dpsi)
    np.dot(va, ds.T, du)
    for j in range(c):
        for r in range(m):
            dlk[j, r] = psi[j, r] * dpsi[j, r] + phi[j, r] * du[j, r]
    # d[V|1] = intra^T dO + phi dS
    np.dot(intra.T, dout, dva)
    np.dot(phi, ds, scaled)
    for j in range(c):
        for e in range(d):
            dva[j, e] += scaled[j, e]
    # dS_n = decay dS_{n+1} + u^T (w dO)
    for i in range(c):
        weight = w[i]
        for e in range(d):
            scaled[i, e] = weight * dout[i, e]
    np.dot(u.T, scaled, product)
    for r in range(m):
        scale = decay[r]
        for e in range(d):
            ds[r, e] = scale * ds[r, e] + product[r, e]


@_jit()
def backward_workspace(chunk, m, d, dtype):
    return (
        np.empty((5, chunk, m), dtype),
        np.empty((8, max(m, chunk)), dtype),
        np.empty((3, chunk * chunk), dtype),
        np.empty((chunk, d), dtype),
        np.empty((m, d), dtype),
    )
