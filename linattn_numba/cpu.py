"""Numba CPU kernels: the chunked, stabilised causal scan, forward and backward.

The algorithm and its stabilisers are exactly those of ``linattn.causal.causal``
(read its module docstring): per chunk of ``C`` tokens, with the state ``(S, mu)``
from earlier chunks and ``ms = mu`` where finite, else 0,

* queries ``u_t = exp(l(q_t) + ms - F_t)``, ``F_t = max_r (l(q_t) + ms)_r``;
* keys ``psi_j = exp(l(k_j) - ms - G_j)``, ``G_j = max_r (l(k_j) - ms)_r``;
* ``O_t = w_t u_t S + sum_{j<=t} (u_t . psi_j) exp(G_j - R_t) [v_j | 1]``, with
  ``R_t`` the running maximum of ``G`` (floored at 0 once the state holds a key)
  and ``w_t = exp(floor - R_t)``;
* then the chunk's keys are absorbed: ``mu' = max(mu, max_j l(k_j))``,
  ``S' = exp(ms - mu') S + exp(l(K) - mu')^T [V | 1]``.

Each batch x head runs on its own thread (``prange``; each parallel kernel also has a
serial twin, which :mod:`linattn_numba._machinery` picks for small work, forked children
and unsafe thread pools); the chunk products are
``np.dot`` calls on contiguous blocks (BLAS ``gemm`` from SciPy's OpenBLAS, pinned
to one thread while the kernel runs: measured 10x faster than letting BLAS threads
fight Numba's), and the exponentials use a vectorisable ``exp`` (:func:`fast_exp`,
within 2 ulp of the C library's, with exact ``0``, ``inf`` and ``nan``).

Entry points: :func:`numpy_forward` / :func:`numpy_backward` (the kernel contract
of ``linattn_numba``), :func:`causal_kernel` (NumPy, or torch CPU tensors with
autograd through the custom operators of ``_torch``) and :func:`favor_causal`, which also
computes the features and normalises chunk by chunk, so that no ``L x m`` array
exists (what long sequences need).

The backward pass treats every stabiliser (``mu``, ``F``, ``G``, ``R``) as a
constant.  This is exact for the normalised outputs ``O[:, :d_v] / O[:, d_v]`` (and
for any function of the state that is invariant to the shift, like later normalised
outputs), because numerator and denominator share every shift.  Chunk states are
recomputed forward, never rebuilt by subtraction (``docs/algorithm.md``, section 13): all of a
head's chunk states are kept when they fit in :data:`STORE_BYTES`, else ``sqrt(N)``
checkpoints are, and each segment is recomputed from its checkpoint.  Key features
are recomputed per chunk (mostly from ``psi``, see :func:`_key_features`), not
stored, and each worker thread reuses one set of buffers for all its heads.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.extending import intrinsic, overload

from linattn_numba import _contract, _machinery

__all__ = [
    "causal_backward_kernel",
    "causal_kernel",
    "fast_exp",
    "favor_causal",
    "numpy_backward",
    "numpy_forward",
    "status",
]


# Compile options, the parallel and serial twins of each parallel kernel, and which of
# them a call runs: all in linattn_numba._machinery.
_jit = _machinery.jit
_variants = _machinery.Variants
_single_threaded_blas = _machinery.single_threaded_blas


DTYPES = (np.dtype(np.float32), np.dtype(np.float64))

#: Per worker thread, the backward keeps every chunk's state up to this many bytes;
#: beyond, it keeps ``sqrt(N)`` checkpoints and recomputes (one more state pass).
STORE_BYTES = 48 * 2**20


def status() -> str:
    """``"available"``: numba imported, so the CPU kernels can run (compiled on first use)."""
    return "available"


# -- a vectorisable exp ---------------------------------------------------------------


@intrinsic
def _pow2(typingctx: Any, n: Any) -> Any:
    """``2**n`` for an integer-valued float ``n`` in the normal exponent range (bit assembly)."""
    if n not in (types.float32, types.float64):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        (x,) = args
        if n == types.float32:
            int_type, bias, shift = ir.IntType(32), 127, 23
        else:
            int_type, bias, shift = ir.IntType(64), 1023, 52
        bits = builder.add(builder.fptosi(x, int_type), ir.Constant(int_type, bias))
        return builder.bitcast(builder.shl(bits, ir.Constant(int_type, shift)), x.type)

    return n(n), codegen


_POW2: Any = _pow2  # (typed loosely: mypy cannot see an intrinsic's signature)


def _exp32(x):
    # Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2, then Taylor to degree 7.
    xc = min(max(x, np.float32(-104.0)), np.float32(89.0))
    n = np.floor(xc * np.float32(1.4426950408889634) + np.float32(0.5))
    r = xc - n * np.float32(0.693359375)
    r = r - n * np.float32(-2.12194440e-4)
    p = np.float32(1.0 / 5040.0)
    p = p * r + np.float32(1.0 / 720.0)
    p = p * r + np.float32(1.0 / 120.0)
    p = p * r + np.float32(1.0 / 24.0)
    p = p * r + np.float32(1.0 / 6.0)
    p = p * r + np.float32(0.5)
    p = p * r + np.float32(1.0)
    p = p * r + np.float32(1.0)
    # 2**n in two factors so that results in the subnormal range come out right.
    half = np.floor(n * np.float32(0.5))
    y = p * _POW2(half) * _POW2(n - half)
    return y if x == x else x


def _exp64(x):
    xc = min(max(x, -746.0), 710.0)
    n = np.floor(xc * 1.4426950408889634 + 0.5)
    r = xc - n * 6.93147180369123816490e-01
    r = r - n * 1.90821492927058770002e-10
    p = 1.0 / 479001600.0
    p = p * r + 1.0 / 39916800.0
    p = p * r + 1.0 / 3628800.0
    p = p * r + 1.0 / 362880.0
    p = p * r + 1.0 / 40320.0
    p = p * r + 1.0 / 5040.0
    p = p * r + 1.0 / 720.0
    p = p * r + 1.0 / 120.0
    p = p * r + 1.0 / 24.0
    p = p * r + 1.0 / 6.0
    p = p * r + 0.5
    p = p * r + 1.0
    p = p * r + 1.0
    half = np.floor(n * 0.5)
    y = p * _POW2(half) * _POW2(n - half)
    return y if x == x else x


def fast_exp(x):
    """``exp(x)`` for float32/float64 scalars inside ``@njit`` code (vectorises in loops)."""
    return math.exp(x)


@overload(fast_exp)
def _fast_exp_overload(x):
    if x == types.float32:
        return _exp32
    if x == types.float64:
        return _exp64
    return None


def typed(value, like):
    """``value`` in the float type of the scalar ``like``, inside ``@njit`` code.

    A Python literal there is float64 (or int64), and float32 arithmetic with it is
    float64: one ``-np.inf`` in a branch made a float32 kernel's exponentials float64.
    """
    return value


@overload(typed)
def _typed_overload(value, like):
    if like == types.float32:
        return lambda value, like: np.float32(value)
    if like == types.float64:
        return lambda value, like: np.float64(value)
    return None


# -- one chunk ------------------------------------------------------------------------


@_jit()
def _safe_shift(mu, ms):
    """``ms = mu`` where finite, else 0; returns whether the state holds any key."""
    has_state = False
    for r in range(mu.shape[0]):
        if np.isfinite(mu[r]):
            ms[r] = mu[r]
            has_state = True
        else:
            ms[r] = 0
    return has_state


@_jit()
def _larger(value, top):
    """``value`` where it is larger than ``top`` (a NaN never is), else ``top``."""
    return value if value > top else top


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
            top = _larger(_term(x, i, r, shift, negate), top)
        return top
    a0, a1 = _term(x, i, 0, shift, negate), _term(x, i, 1, shift, negate)
    a2, a3 = _term(x, i, 2, shift, negate), _term(x, i, 3, shift, negate)
    a4, a5 = _term(x, i, 4, shift, negate), _term(x, i, 5, shift, negate)
    a6, a7 = _term(x, i, 6, shift, negate), _term(x, i, 7, shift, negate)
    full = m - m % 8
    for r in range(8, full, 8):
        a0 = _larger(_term(x, i, r, shift, negate), a0)
        a1 = _larger(_term(x, i, r + 1, shift, negate), a1)
        a2 = _larger(_term(x, i, r + 2, shift, negate), a2)
        a3 = _larger(_term(x, i, r + 3, shift, negate), a3)
        a4 = _larger(_term(x, i, r + 4, shift, negate), a4)
        a5 = _larger(_term(x, i, r + 5, shift, negate), a5)
        a6 = _larger(_term(x, i, r + 6, shift, negate), a6)
        a7 = _larger(_term(x, i, r + 7, shift, negate), a7)
    for r in range(full, m):
        a0 = _larger(_term(x, i, r, shift, negate), a0)
    a0, a2, a4, a6 = _larger(a1, a0), _larger(a3, a2), _larger(a5, a4), _larger(a7, a6)
    return _larger(_larger(a4, a6), _larger(a2, a0))


@_jit()
def _chunk_shifts(lq, lk, ms, has_state, u, psi, g, run, w, weights, fq):
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
def _running_max(lk, mu, top):
    """``top = max(mu, max_j l(k_j))`` per feature (``np.maximum`` rows: it vectorises)."""
    top[:] = mu
    for j in range(lk.shape[0]):
        np.maximum(top, lk[j], top)


@_jit()
def _shift_between(mu, top, ms, shift, decay):
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
def _key_features(lk, shift, decay, psi, g, reuse, phi):
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
def _absorb(lk, va, kv, mu, ms, phi, top, shift, decay, product, psi, g, reuse):
    """``(S, mu) <- (exp(ms - mu') S + exp(l(K) - mu')^T [V|1], mu')``; leaves ``phi``
    (:func:`_key_features`; ``reuse`` needs the chunk's ``psi`` and ``G``)."""
    m = lk.shape[1]
    _running_max(lk, mu, top)
    full = _shift_between(mu, top, ms, shift, decay)
    _key_features(lk, shift, decay, psi, g, reuse and full, phi)
    np.dot(phi.T, va, product)
    for r in range(m):
        scale = decay[r]
        mu[r] = top[r]
        for e in range(kv.shape[1]):
            kv[r, e] = scale * kv[r, e] + product[r, e]


@_jit()
def _mask_later_keys(products, weights):
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
def _chunk_forward(lq, lk, va, kv, mu, block, work, square, vecs, state_out, product, scale_out):
    """Unnormalised outputs of one chunk into ``block``; then ``(kv, mu)`` absorb its keys.

    ``scale_out`` gets each row's log-scale ``F_t + R_t`` (true ``[num | den]`` is
    ``exp(F_t + R_t)`` times the row) when it has the chunk's length; pass an empty
    array to skip it.
    """
    c, m = lq.shape
    d = va.shape[1]
    u, psi, phi = work[0][:c], work[1][:c], work[2][:c]
    weights = square[0][: c * c].reshape(c, c)
    intra = square[1][: c * c].reshape(c, c)
    ms, shift, decay, top = vecs[0][:m], vecs[1][:m], vecs[2][:m], vecs[6][:m]
    g, run, w, fq = vecs[3][:c], vecs[4][:c], vecs[5][:c], vecs[7][:c]
    has_state = _safe_shift(mu, ms)
    _chunk_shifts(lq, lk, ms, has_state, u, psi, g, run, w, weights, fq)
    if scale_out.shape[0] == c:
        for i in range(c):
            scale_out[i] = fq[i] + run[i]
    np.dot(u, psi.T, intra)
    _mask_later_keys(intra, weights)
    np.dot(u, kv, state_out[:c])
    np.dot(intra, va, block)
    for i in range(c):
        weight = w[i]
        for e in range(d):
            block[i, e] += weight * state_out[i, e]
    _absorb(lk, va, kv, mu, ms, phi, top, shift, decay, product, psi, g, True)


@_jit()
def _workspace(chunk, m, d, dtype):
    return (
        np.empty((3, chunk, m), dtype),
        np.empty((2, chunk * chunk), dtype),
        np.empty((8, max(m, chunk)), dtype),
        np.empty((chunk, d), dtype),
        np.empty((m, d), dtype),
    )


@_variants
def _forward(lq, lk, va, kv, mu, chunk, out, log_scale):
    """All heads; ``log_scale`` is ``(batch, L)``, or ``(batch, 0)`` to skip it."""
    batch, length, m = lq.shape
    for b in prange(batch):
        work, square, vecs, state_out, product = _workspace(chunk, m, va.shape[2], lq.dtype)
        for t0 in range(0, length, chunk):
            t1 = min(t0 + chunk, length)
            _chunk_forward(
                lq[b][t0:t1], lk[b][t0:t1], va[b][t0:t1], kv[b], mu[b], out[b][t0:t1],
                work, square, vecs, state_out, product, log_scale[b][t0:t1],
            )  # fmt: skip


@_jit(fastmath=frozenset({"contract", "reassoc"}))
def _half_norm(x, root_half_scale):
    """``scale |x|^2 / 2`` of a row as ``sum((sqrt(scale / 2) x)**2)``: scaled before
    squaring, so that it overflows only where the result does; summed in any order (so
    that it vectorises)."""
    total = x[0] - x[0]
    for e in range(x.shape[0]):
        y = x[e] * root_half_scale
        total += y * y
    return total


@_jit()
def _log_features(x, projection, consts, hyperbolic, proj, out):
    """``FeatureMap.signed_log_features`` for "positive"/"hyperbolic" kinds, one block.

    ``projection`` is the feature map's, times ``sqrt(scale)``; ``consts = [scale / 2,
    log(m) / 2]`` in the compute dtype.  ``l(x) = +-(sqrt(scale) x) W^T - scale |x|^2 / 2
    - log(m) / 2``: the array-API formula, rounded differently (within a few ulp).
    Where ``scale |x|^2 / 2`` overflows, ``l(x)`` is below the float range: ``-inf``
    exactly (the projection may overflow too, and ``inf - inf`` would be NaN); NaN
    inputs stay NaN.  ``proj`` is scratch for the hyperbolic kind (the positive kind
    projects into ``out``).
    """
    c = x.shape[0]
    rows = projection.shape[0]
    width = out.shape[1]
    # locals, so that the loops vectorise
    root_half_scale, log_root_m = np.sqrt(consts[0]), consts[1]
    target = proj if hyperbolic else out
    np.dot(x, projection.T, target)
    for i in range(c):
        half_norm = _half_norm(x[i], root_half_scale)
        if half_norm == np.inf:
            for r in range(width):
                out[i, r] = -np.inf
            continue
        offset = half_norm + log_root_m
        if not hyperbolic:  # in place (through two names of one array: 85 vs 75 us a block)
            for r in range(rows):
                out[i, r] -= offset
            continue
        for r in range(rows):
            out[i, r] = target[i, r] - offset
            out[i, rows + r] = -target[i, r] - offset


#: The fused pass computes features for this many tokens at a time (whole chunks): the
#: projection is a ``(FEATURE_BLOCK x d) @ (d x m)`` product, which BLAS runs about twice
#: as fast as one chunk's ``(64 x d) @ (d x m)`` (measured, one thread, d = 64, m = 256).
FEATURE_BLOCK = 256


@_variants
def _forward_fused(q, k, v, mask, projection, consts, hyperbolic, kv, mu, chunk, out, lse):
    """Features, causal attention and normalisation per block: no ``L x m`` array anywhere.

    ``lse`` (``(batch, L)``, or ``(batch, 0)`` to skip it) gets the log of each row's true
    denominator, ``-inf`` where the row sees no key.
    """
    batch, length, _ = q.shape
    dv = v.shape[2]
    m = kv.shape[1]
    rows = projection.shape[0]
    dtype = q.dtype
    span = chunk * max(1, FEATURE_BLOCK // chunk)
    for b in prange(batch):
        work, square, vecs, state_out, product = _workspace(chunk, m, dv + 1, dtype)
        proj = np.empty((span if hyperbolic else 0, rows), dtype)
        lq = np.empty((span, m), dtype)
        lk = np.empty((span, m), dtype)
        va = np.empty((span, dv + 1), dtype)
        block = np.empty((chunk, dv + 1), dtype)
        for s0 in range(0, length, span):
            s1 = min(s0 + span, length)
            n = s1 - s0
            _log_features(q[b][s0:s1], projection, consts, hyperbolic, proj[:n], lq[:n])
            _log_features(k[b][s0:s1], projection, consts, hyperbolic, proj[:n], lk[:n])
            for i in range(n):
                for e in range(dv):
                    va[i, e] = v[b, s0 + i, e]
                va[i, dv] = 1
                if not mask[b, s0 + i]:  # a masked key: no features, no (padding) values
                    for r in range(m):
                        lk[i, r] = -np.inf
                    for e in range(dv):
                        va[i, e] = 0
            for t0 in range(0, n, chunk):
                t1 = min(t0 + chunk, n)
                c = t1 - t0
                scale = lse[b][s0 + t0 : s0 + t1]
                _chunk_forward(
                    lq[t0:t1], lk[t0:t1], va[t0:t1], kv[b], mu[b], block[:c],
                    work, square, vecs, state_out, product, scale,
                )  # fmt: skip
                for i in range(scale.shape[0]):
                    # log(0) = -inf: a row that sees no key; NaN stays NaN.
                    scale[i] = np.log(block[i, dv]) + scale[i]
                for i in range(c):
                    den = block[i, dv]
                    if den != 0:
                        for e in range(dv):
                            out[b, s0 + t0 + i, e] = block[i, e] / den
                    else:
                        for e in range(dv):
                            out[b, s0 + t0 + i, e] = den


# -- backward -------------------------------------------------------------------------


@_jit()
def _chunk_backward(
    lq, lk, va, dout, kv, mu, mu_next, ds, dlq, dlk, dva, rows, vecs, square, scaled, product
):
    """Gradients of one chunk given the states before (``kv``, ``mu``) and after
    (``mu_next``) it and ``dS`` after it; updates ``ds`` to ``dS`` before it."""
    _chunk_backward_factors(lq, lk, mu, mu_next, rows, vecs, square)
    _chunk_backward_grads(va, dout, kv, ds, dlq, dlk, dva, rows, vecs, square, scaled, product)


@_jit()
def _chunk_backward_factors(lq, lk, mu, mu_next, rows, vecs, square):
    """The forward's factors of one chunk, as :func:`_chunk_backward` needs them: ``u``,
    ``psi``, ``phi`` (``rows[0, 1, 4]``), the shifts and weights (``vecs``) and the
    masked ``intra = (u psi^T) * weights`` (``square[1]``; ``weights`` in ``square[0]``)."""
    c, m = lq.shape
    u, psi, phi = rows[0][:c], rows[1][:c], rows[4][:c]
    ms, decay, shift = vecs[0][:m], vecs[1][:m], vecs[2][:m]
    g, run, w, fq = vecs[3][:c], vecs[4][:c], vecs[5][:c], vecs[7][:c]
    weights = square[0][: c * c].reshape(c, c)
    intra = square[1][: c * c].reshape(c, c)
    has_state = _safe_shift(mu, ms)
    _chunk_shifts(lq, lk, ms, has_state, u, psi, g, run, w, weights, fq)
    full = _shift_between(mu, mu_next, ms, shift, decay)
    _key_features(lk, shift, decay, psi, g, full, phi)
    np.dot(u, psi.T, intra)
    _mask_later_keys(intra, weights)


@_jit()
def _chunk_backward_grads(va, dout, kv, ds, dlq, dlk, dva, rows, vecs, square, scaled, product):
    """The rest of :func:`_chunk_backward`, after :func:`_chunk_backward_factors`."""
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
    _mask_later_keys(paired, weights)
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
def _head_backward(
    lq, lk, va, kv0, mu0, chunk, dout, dkv_out, dlq, dlk, dva, dkv, seg_kv, seg_mu, check_kv,
    check_mu, work,
):  # fmt: skip
    """One head: checkpoint states, then recompute each segment forward and scan back.

    ``seg_kv`` holds the states of one segment of chunks, ``check_kv`` those at segment
    starts (one segment, no checkpoints, when every chunk's state fits); ``work`` is
    :func:`_backward_workspace`.
    """
    length, m = lq.shape
    n_chunks = (length + chunk - 1) // chunk
    per_segment = seg_kv.shape[0]
    n_segments = (n_chunks + per_segment - 1) // per_segment
    rows, vecs, square, scaled, product = work
    ms, shift, decay, top = vecs[0][:m], vecs[1][:m], vecs[2][:m], vecs[6][:m]
    phi = rows[4]
    kv = check_kv[0]
    mu = check_mu[0]
    kv[:] = kv0
    mu[:] = mu0
    # Pass 1: states at segment starts (checkpoints); none needed for one segment.
    for n in range((n_segments - 1) * per_segment):
        t0, t1 = n * chunk, min(n * chunk + chunk, length)
        if n % per_segment == 0:
            s = n // per_segment
            check_kv[s + 1] = check_kv[s]
            check_mu[s + 1] = check_mu[s]
            kv, mu = check_kv[s + 1], check_mu[s + 1]
        _safe_shift(mu, ms)
        c = t1 - t0
        _absorb(
            lk[t0:t1], va[t0:t1], kv, mu, ms, phi[:c], top, shift, decay, product, phi, ms, False
        )
    # Pass 2: segments last to first; recompute their states, then reverse-scan dS.
    ds = dkv
    ds[:] = dkv_out
    for s in range(n_segments - 1, -1, -1):
        n0 = s * per_segment
        n1 = min(n_chunks, n0 + per_segment)
        seg_mu[0] = check_mu[s]
        seg_kv[0] = check_kv[s]
        for n in range(n0, n1 - 1):
            t0, t1 = n * chunk, n * chunk + chunk
            i = n - n0
            seg_kv[i + 1] = seg_kv[i]
            seg_mu[i + 1] = seg_mu[i]
            _safe_shift(seg_mu[i + 1], ms)
            _absorb(
                lk[t0:t1], va[t0:t1], seg_kv[i + 1], seg_mu[i + 1], ms, phi[:chunk], top,
                shift, decay, product, phi, ms, False,
            )  # fmt: skip
        # mu after the segment's last chunk: its keys' running maximum (no state needed).
        last = n1 - 1 - n0
        t0, t1 = (n1 - 1) * chunk, min(n1 * chunk, length)
        _running_max(lk[t0:t1], seg_mu[last], seg_mu[last + 1])
        for n in range(n1 - 1, n0 - 1, -1):
            t0, t1 = n * chunk, min(n * chunk + chunk, length)
            i = n - n0
            _chunk_backward(
                lq[t0:t1], lk[t0:t1], va[t0:t1], dout[t0:t1], seg_kv[i], seg_mu[i],
                seg_mu[i + 1], ds, dlq[t0:t1], dlk[t0:t1], dva[t0:t1], rows, vecs, square,
                scaled, product,
            )  # fmt: skip


@_jit()
def _backward_workspace(chunk, m, d, dtype):
    return (
        np.empty((5, chunk, m), dtype),
        np.empty((8, max(m, chunk)), dtype),
        np.empty((3, chunk * chunk), dtype),
        np.empty((chunk, d), dtype),
        np.empty((m, d), dtype),
    )


@_variants
def _backward(
    lq, lk, va, kv, mu, chunk, dout, dkv_out, dlq, dlk, dva, dkv, seg_kv, seg_mu, check_kv,
    check_mu,
):  # fmt: skip
    """Heads in turn on each worker ``t`` (its own ``seg_*``/``check_*`` buffers)."""
    batch, _, m = lq.shape
    workers = seg_kv.shape[0]
    for t in prange(workers):
        work = _backward_workspace(chunk, m, va.shape[2], lq.dtype)
        for b in range(t, batch, workers):
            _head_backward(
                lq[b], lk[b], va[b], kv[b], mu[b], chunk, dout[b], dkv_out[b], dlq[b], dlk[b],
                dva[b], dkv[b], seg_kv[t], seg_mu[t], check_kv[t], check_mu[t], work,
            )  # fmt: skip


# -- NumPy entry points (checked before any compiled code runs) -----------------------


def _check(arrays: dict[str, Any], chunk_size: object) -> tuple[_contract.Sizes, np.dtype]:
    """Validate kernel inputs (:mod:`linattn_numba._contract`); return sizes and dtype."""
    _contract.check_arrays(arrays, lambda x: isinstance(x, np.ndarray), "a numpy.ndarray")
    names = tuple(str(d) for d in DTYPES)
    dtype = np.dtype(_contract.check_dtypes(arrays, names, same=True))
    return _contract.check_shapes(arrays, chunk_size), dtype


def _flat(x: np.ndarray, shape: tuple[int, ...], dtype: Any = None) -> np.ndarray:
    """``x`` as a C-contiguous array of ``shape`` (a view where it already is one)."""
    return np.ascontiguousarray(x, dtype=dtype).reshape(shape)


def _fresh(x: np.ndarray, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A C-contiguous copy of ``x`` of ``shape`` that the kernel may overwrite."""
    return np.array(x, dtype=dtype, order="C", copy=True).reshape(shape)


def _without_empty_rows(state: np.ndarray, log_shift: np.ndarray) -> np.ndarray:
    """Zeros, in place, for the rows of a state whose shift is ``-inf``.

    Such a row has seen no key, so it holds nothing whatever it stores (the array-API
    scan and the CUDA kernels read it as zeros too); a gradient for it is likewise 0.
    """
    empty = log_shift == -np.inf
    if empty.any():
        state[empty] = 0
    return state


def numpy_forward(
    log_phi_q: np.ndarray,
    log_phi_k: np.ndarray,
    values_aug: np.ndarray,
    kv: np.ndarray,
    log_shift: np.ndarray,
    chunk_size: int,
    *,
    return_log_scale: bool = False,
) -> tuple[np.ndarray, ...]:
    """The causal kernel on NumPy arrays: ``(outputs_aug, kv_out, log_shift_out)``.

    With ``return_log_scale=True`` also ``log_scale`` of shape ``(*batch, L)``: row ``t``
    of ``outputs_aug`` is the true ``[numerator | denominator]`` (with the state's keys
    in their true scale) times ``exp(-log_scale[t])``, so
    ``log(outputs_aug[..., -1]) + log_scale`` is the log-normaliser
    ``log sum_j phi(q_t) . phi(k_j)`` (``-inf`` where the row sees no key).  Like
    ``log_shift_out`` it is a stabiliser: finite, held constant by :func:`numpy_backward`
    (exact: the gradient of the log-normaliser flows through the denominator column,
    ``d outputs_aug[..., -1] = d lse / outputs_aug[..., -1]``).

    Examples
    --------
    >>> import numpy as np
    >>> lq = np.zeros((1, 3, 2))  # equal features: causal attention is a running mean
    >>> va = np.array([[[0.0, 1.0], [1.0, 1.0], [2.0, 1.0]]])  # [v | 1]
    >>> empty = (np.zeros((1, 2, 2)), np.full((1, 2), -np.inf))
    >>> out, kv, mu = numpy_forward(lq, lq, va, *empty, 2)
    >>> out[0, :, 0] / out[0, :, 1]
    array([0. , 0.5, 1. ])
    >>> *_, scale = numpy_forward(lq, lq, va, *empty, 2, return_log_scale=True)
    >>> np.exp(np.log(out[..., 1]) + scale)  # t + 1 keys, each of weight 2 (two features)
    array([[2., 4., 6.]])
    """
    inputs = (log_phi_q, log_phi_k, values_aug, kv, log_shift)
    sizes, dtype = _check(_contract.named(inputs), chunk_size)
    lq, lk = (_flat(x, sizes.flat("features")) for x in (log_phi_q, log_phi_k))
    va = _flat(values_aug, sizes.flat("values"))
    mu = _fresh(log_shift, sizes.flat("shift"), dtype)
    state = _without_empty_rows(_fresh(kv, sizes.flat("state"), dtype), mu)
    out = np.empty(sizes.flat("values"), dtype)
    log_scale = np.empty((sizes.batch, sizes.length if return_log_scale else 0), dtype)
    variant = _machinery.choose_variant(sizes.batch, sizes.length, sizes.m * sizes.width)
    with _single_threaded_blas():
        chunk = _chunk(sizes.chunk, sizes.length)
        _forward.run(variant, lq, lk, va, state, mu, chunk, out, log_scale)
    results = (
        out.reshape(sizes.shape("values")),
        state.reshape(sizes.shape("state")),
        mu.reshape(sizes.shape("shift")),
    )
    if return_log_scale:
        return (*results, log_scale.reshape((*sizes.batch_shape, sizes.length)))
    return results


def _chunk(chunk_size: int, length: int) -> int:
    """The chunk the kernels run: at most ``L``, at least 1 (``L = 0`` runs none)."""
    return max(1, min(chunk_size, length))


def numpy_backward(
    log_phi_q: np.ndarray,
    log_phi_k: np.ndarray,
    values_aug: np.ndarray,
    kv: np.ndarray,
    log_shift: np.ndarray,
    chunk_size: int,
    d_outputs_aug: np.ndarray,
    d_kv: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Vector-Jacobian product of :func:`numpy_forward` (stabilisers held constant).

    Returns ``(d_log_phi_q, d_log_phi_k, d_values_aug, d_kv_in)`` for cotangents
    ``d_outputs_aug`` of the outputs and ``d_kv`` of the final state.  The forward's
    ``log_scale`` is a stabiliser (no cotangent): for cotangents ``g`` of the normalised
    output ``o = num / den`` and ``g_lse`` of the log-normaliser
    ``lse = log(den) + log_scale``, pass ``d_outputs_aug = [g / den, (g_lse - g . o) / den]``
    with ``[num | den] = outputs_aug`` as the forward returned it (0 where ``den = 0``).
    """
    inputs = (log_phi_q, log_phi_k, values_aug, kv, log_shift, d_outputs_aug, d_kv)
    sizes, dtype = _check(_contract.named(inputs, ("d_outputs_aug", "d_kv")), chunk_size)
    features, values = sizes.flat("features"), sizes.flat("values")
    state_shape, m, width = sizes.flat("state"), sizes.m, sizes.width
    flat = [_flat(x, features) for x in (log_phi_q, log_phi_k)]
    mu = _flat(log_shift, sizes.flat("shift"))
    flat += [_flat(values_aug, values), _without_empty_rows(_fresh(kv, state_shape, dtype), mu)]
    dout, dkv_out = _flat(d_outputs_aug, values), _flat(d_kv, state_shape)
    dlq, dlk = np.empty(features, dtype), np.empty(features, dtype)
    dva, dkv = np.empty(values, dtype), _fresh(dkv_out, state_shape, dtype)
    if sizes.length:  # (no tokens: no chunks, and the state's gradient passes through)
        # Per worker thread: every chunk's state when they fit in STORE_BYTES, else a
        # segment of sqrt(N) of them plus the states at segment starts (recomputed, never
        # subtracted).
        chunk = _chunk(sizes.chunk, sizes.length)
        variant = _machinery.choose_variant(sizes.batch, sizes.length, sizes.m * sizes.width)
        workers = min(sizes.batch, numba.get_num_threads()) if variant == "parallel" else 1
        n_chunks = -(-sizes.length // chunk)
        stored = n_chunks * m * width * dlq.itemsize
        per_segment = n_chunks if stored <= STORE_BYTES else math.ceil(math.sqrt(n_chunks))
        n_segments = -(-n_chunks // per_segment)
        seg_kv = np.empty((workers, per_segment, m, width), dtype)
        seg_mu = np.empty((workers, per_segment + 1, m), dtype)
        check_kv = np.empty((workers, n_segments, m, width), dtype)
        check_mu = np.empty((workers, n_segments, m), dtype)
        with _single_threaded_blas():
            _backward.run(
                variant, *flat, mu, chunk, dout, dkv_out, dlq, dlk, dva, dkv, seg_kv, seg_mu,
                check_kv, check_mu,
            )  # fmt: skip
    return (
        dlq.reshape(sizes.shape("features")),
        dlk.reshape(sizes.shape("features")),
        dva.reshape(sizes.shape("values")),
        _without_empty_rows(dkv, mu).reshape(sizes.shape("state")),
    )


def favor_causal(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    projection: np.ndarray,
    *,
    hyperbolic: bool,
    scale: float,
    key_mask: np.ndarray | None,
    kv: np.ndarray,
    log_shift: np.ndarray,
    chunk_size: int,
    return_log_normaliser: bool = False,
) -> tuple[np.ndarray, ...]:
    """Causal FAVOR+ in one pass: features, attention and normalisation chunk by chunk.

    The same results as ``FeatureMap.signed_log_features`` followed by
    :func:`numpy_forward` and ``linattn.causal.normalise`` for the ``"positive"`` and
    ``"hyperbolic"`` kinds, without ever holding an ``L x m`` feature array: memory
    above inputs and outputs is ``O(C m)`` per thread.  Inputs must already be
    checked by ``linattn`` (shapes broadcast, one floating dtype); they are cast to
    the compute dtype (float64 stays, all else float32).

    Returns
    -------
    (outputs, kv_out, log_shift_out)
        Normalised outputs ``(*batch, L, d_v)`` in the compute dtype and the state.
    log_normaliser : ndarray, shape ``(*batch, L)``
        Only with ``return_log_normaliser=True``, after the three: the log of each
        output's true denominator, ``log sum_j phi(q_t) . phi(k_j)`` over the keys it
        sees (those of the incoming state included), ``-inf`` where it sees none.

    Examples
    --------
    >>> import numpy as np
    >>> x = np.zeros((1, 3, 2)); w = np.eye(2); v = np.arange(6.0).reshape(1, 3, 2)
    >>> out, kv, mu = favor_causal(x, x, v, w, hyperbolic=False, scale=1.0, key_mask=None,
    ...     kv=np.zeros((1, 2, 3)), log_shift=np.full((1, 2), -np.inf), chunk_size=2)
    >>> out[0]
    array([[0., 1.],
           [1., 2.],
           [2., 3.]])
    >>> *_, lse = favor_causal(x, x, v, w, hyperbolic=False, scale=1.0, key_mask=None,
    ...     kv=np.zeros((1, 2, 3)), log_shift=np.full((1, 2), -np.inf), chunk_size=2,
    ...     return_log_normaliser=True)
    >>> np.exp(lse)  # phi(0) . phi(0) = 1 per key
    array([[1., 2., 3.]])
    """
    dtype = np.dtype(np.float64) if q.dtype == np.float64 else np.dtype(np.float32)
    rows, head_dim = projection.shape
    m = kv.shape[-2]
    if m != rows * (2 if hyperbolic else 1) or q.shape[-1] != head_dim:
        raise ValueError(
            f"projection {projection.shape} does not match q {q.shape} and kv {kv.shape}"
        )
    chunk = _chunk(_contract.check_chunk_size(chunk_size), q.shape[-2])
    length, dv = q.shape[-2], v.shape[-1]
    batch = np.broadcast_shapes(
        q.shape[:-2], k.shape[:-2], v.shape[:-2], kv.shape[:-2], log_shift.shape[:-1],
        () if key_mask is None else key_mask.shape[:-1],
    )  # fmt: skip

    n = math.prod(batch)

    def flat(x: np.ndarray, tail: tuple[int, ...]) -> np.ndarray:
        return _flat(np.broadcast_to(x, (*batch, *tail)), (n, *tail), dtype)

    qf, kf, vf = flat(q, (length, head_dim)), flat(k, (length, head_dim)), flat(v, (length, dv))
    mask = np.ones(length, bool) if key_mask is None else key_mask
    maskf = _flat(np.broadcast_to(mask, (*batch, length)), (n, length))
    mu = _fresh(np.broadcast_to(log_shift, (*batch, m)), (n, m), dtype)
    state = _fresh(np.broadcast_to(kv, (*batch, m, dv + 1)), (n, m, dv + 1), dtype)
    state = _without_empty_rows(state, mu)
    consts = np.array([0.5 * scale, 0.5 * np.log(m)], dtype=dtype)
    scaled_projection = np.ascontiguousarray(np.sqrt(scale) * projection, dtype=dtype)
    out = np.empty((n, length, dv), dtype)
    lse = np.empty((n, length if return_log_normaliser else 0), dtype)
    variant = _machinery.choose_variant(n, length, m * (dv + 1))
    with _single_threaded_blas():
        _forward_fused.run(
            variant, qf, kf, vf, maskf, scaled_projection, consts,
            bool(hyperbolic), state, mu, chunk, out, lse,
        )  # fmt: skip
    results = (
        out.reshape((*batch, length, dv)),
        state.reshape((*batch, m, dv + 1)),
        mu.reshape((*batch, m)),
    )
    if return_log_normaliser:
        return (*results, lse.reshape((*batch, length)))
    return results


# -- torch ----------------------------------------------------------------------------
# The kernels as torch custom operators live in ``linattn_numba._torch`` (imported when
# the first torch tensor arrives); these are their CPU implementations.


def _torch_forward(
    lq: Any, lk: Any, va: Any, kv: Any, mu: Any, chunk_size: int, return_log_scale: bool = False
) -> Any:
    """:func:`numpy_forward` on NumPy views of CPU tensors; results are fresh tensors."""
    import torch

    lq, lk, va, kv, mu = (x.detach().numpy() for x in (lq, lk, va, kv, mu))
    results = numpy_forward(lq, lk, va, kv, mu, chunk_size, return_log_scale=return_log_scale)
    return tuple(torch.from_numpy(r) for r in results)


def _torch_backward(
    lq: Any, lk: Any, va: Any, kv: Any, mu: Any, chunk_size: int, d_out: Any, d_kv: Any
) -> Any:
    """:func:`numpy_backward` on NumPy views of CPU tensors; results are fresh tensors."""
    import torch

    lq, lk, va, kv, mu, d_out, d_kv = (
        x.detach().numpy() for x in (lq, lk, va, kv, mu, d_out, d_kv)
    )
    grads = numpy_backward(lq, lk, va, kv, mu, chunk_size, d_out, d_kv)
    return tuple(torch.from_numpy(g) for g in grads)


def _torch_kernel(
    lq: Any, lk: Any, va: Any, kv: Any, mu: Any, chunk_size: int, *, return_log_scale: bool = False
) -> Any:
    """``torch.ops.linattn.causal_forward`` on CPU tensors (autograd and compile included);
    ``causal_forward_scaled`` with ``return_log_scale`` (see :func:`numpy_forward`)."""
    from linattn_numba._torch import causal  # (registers the operators on first use)

    return causal("cpu", lq, lk, va, kv, mu, chunk_size, return_log_scale=return_log_scale)


def causal_kernel(library: str) -> Callable[..., Any]:
    """The forward kernel for arrays of ``library`` (``"numpy"`` or ``"torch"`` on CPU).

    Examples
    --------
    >>> import numpy as np
    >>> kernel = causal_kernel("numpy")
    >>> lq = np.zeros((2, 1)); va = np.ones((2, 3))
    >>> out, kv, mu = kernel(lq, lq, va, np.zeros((1, 3)), np.full(1, -np.inf), 64)
    >>> out.tolist()
    [[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]]

    Every kernel also takes ``return_log_scale=True`` and then returns ``log_scale``
    fourth (:func:`numpy_forward`).
    """
    if library == "numpy":
        return numpy_forward
    if library == "torch":
        return _torch_kernel
    raise ValueError(f"library must be 'numpy' or 'torch'; got {library!r}")


def causal_backward_kernel(library: str) -> Callable[..., Any]:
    """The backward kernel for ``library`` (``"numpy"``): see :func:`numpy_backward`."""
    if library == "numpy":
        return numpy_backward
    raise ValueError(f"library must be 'numpy'; got {library!r}")


_ = numba  # imported for its side effect of failing early when numba is missing
