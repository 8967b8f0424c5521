"""The CUDA kernels of the chunked, stabilised causal scan (device code only).

Same algorithm, stabilisers and results as ``linattn.causal.causal`` (read its
module docstring).  All kernels take C-contiguous arrays flattened to one batch
axis: log-features ``lq, lk (B, L, m)``, ``[V | 1]`` ``va (B, L, D)``, states
``(B, m, D)``, and the per-chunk stabilisers computed here first:

* ``mus (B, N + 1, m)``: ``mu`` at every chunk start (``mus[:, N]`` the final one);
* ``F, G, Gm (B, L)``: per-query shift, per-key excess ``G_j`` and its running
  maximum ``Gmax_t`` (floored at 0 once the state holds a key);
* ``flo (B, N)``: that floor (0, or ``-inf`` for an empty state).

Everything is parallel over chunks, in ``T x T`` thread blocks (``T = TILE``)
with shared-memory tiles; no tile size limits ``L``, ``m``, ``d_v`` or the
chunk size.  The only sequential loop over chunks is an elementwise scan (one
thread per state entry), at the price of keeping the state before every chunk,
``(B, L / C, m, d_v + 1)``: about the size of one log-feature array.

``chunk_max``, ``prefix_max``, ``row_stats``
    the stabilisers (a prefix maximum over chunks, then row reductions);
``forward_intra``
    the masked intra-chunk term of the outputs, one block per query tile;
``chunk_increments``
    what each chunk adds to the state (``phi^T [V | 1]``) or to its gradient
    (``(w u)^T dO``), one block per (chunk, state tile);
``scan_states``
    the scan turning increments into the state before every chunk, ``S_n``,
    or (reverse) the gradient after every chunk, ``dS_{n+1}``;
``state_readout``
    ``u S_n`` (the state term of the outputs) and ``phi dS_{n+1}`` (the state
    gradient of ``[V | 1]``);
``feature_readout``
    the state gradients of ``l(q)`` (``dO S_n^T``) and ``l(k)`` (``[V | 1] dS_{n+1}^T``);
``backward_intra_queries``, ``backward_intra_keys``
    the intra-chunk gradients;
``log_scale``
    each output row's log-scale ``F_t + Gmax_t``: the true ``[numerator |
    denominator]`` is ``exp(F_t + Gmax_t)`` times the row (a stabiliser, on request);
``chunk_features``, ``causal_select``, ``combine_readout``
    the elementwise parts of the vendor-BLAS design (:mod:`linattn_numba.gpu.blas`):
    the features of every chunk written once, zero-padded to whole chunks,
    ``(B, N, C, m)``; the causal weights ``e[t, j] = exp(G_j - Gmax_t)`` applied
    to, and keys ``j > t`` selected out of, the scores ``u psi^T``; and the
    outputs ``intra + w S-readout``.

Backward holds the stabilisers constant (exact for the normalised output:
numerator and denominator share every shift) and recomputes the chunk states
forward from the initial state, never by subtraction.

Examples
--------
>>> from linattn_numba.gpu import kernels
>>> sorted(kernels.signatures("float32"))[:2]
['backward_intra_keys', 'backward_intra_queries']
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace
from typing import Any

import numba

from linattn_numba.gpu import target

__all__ = [
    "BLAS_KERNEL_NAMES",
    "KERNEL_NAMES",
    "KEY",
    "KEY_STATE",
    "QUERY",
    "TILE",
    "WEIGHTED_QUERY",
    "kernels",
    "signatures",
]

cuda = target.cuda
TILE = target.TILE

# Which per-(token, feature) factor a kernel needs, computed on the fly from the
# log-features and the stabilisers of the token's chunk n.
QUERY = 0  # u = exp(l(q) + mu_n - F)
WEIGHTED_QUERY = 1  # w u, w = exp(floor_n - Gmax): queries against the state
KEY_STATE = 2  # phi = exp(l(k) - mu_{n+1}): keys entering the state
KEY = 3  # psi = exp(l(k) - mu_n - G): keys inside the chunk

KERNEL_NAMES = (
    "chunk_max",
    "prefix_max",
    "row_stats",
    "forward_intra",
    "chunk_increments",
    "scan_states",
    "state_readout",
    "feature_readout",
    "backward_intra_queries",
    "backward_intra_keys",
    "log_scale",
    "chunk_features",
    "causal_select",
    "combine_readout",
)
BLAS_KERNEL_NAMES = KERNEL_NAMES[-3:]
"""The elementwise kernels of the vendor-BLAS design (:mod:`linattn_numba.gpu.blas`)."""


@functools.cache
def kernels(precision: str) -> SimpleNamespace:
    """The CUDA kernels for ``precision`` ``"float32"`` or ``"float64"`` (compiled lazily)."""
    if precision not in ("float32", "float64"):
        raise ValueError(f"precision must be 'float32' or 'float64'; got {precision!r}")
    return _build(getattr(numba, precision))


def _build(dt: Any) -> SimpleNamespace:
    T = TILE
    TT = TILE * TILE
    TP = TILE + 1  # padded rows: column reads hit distinct banks
    NEG_INF = -math.inf

    @cuda.jit(device=True, inline="always")
    def safe(x):
        if math.isfinite(x):
            return x
        return dt(0.0)

    @cuda.jit(device=True, inline="always")
    def feature(kind, lq, lk, mus, F, G, Gm, flo, b, n, t, r, end):
        if t >= end or r >= lq.shape[2]:
            return dt(0.0)
        if kind == QUERY:
            return math.exp(lq[b, t, r] + safe(mus[b, n, r]) - F[b, t])
        if kind == WEIGHTED_QUERY:
            return math.exp(lq[b, t, r] + safe(mus[b, n, r]) - F[b, t]) * math.exp(
                flo[b, n] - Gm[b, t]
            )
        if kind == KEY_STATE:
            return math.exp(lk[b, t, r] - safe(mus[b, n + 1, r]))
        return math.exp(lk[b, t, r] - safe(mus[b, n, r]) - safe(G[b, t]))

    @cuda.jit(device=True, inline="always")
    def decay(mus, b, n, r):
        old = mus[b, n, r]
        if math.isfinite(old):
            return math.exp(old - safe(mus[b, n + 1, r]))
        return dt(0.0)

    @cuda.jit(device=True, inline="always")
    def causal(x, G, Gm, b, j, t, end):
        """``x exp(G_j - Gmax_t)`` for keys ``j <= t`` of the chunk, else 0: selected,
        not ``x * 0``, so that a later key's NaN or inf never reaches query ``t``."""
        if t < end and j <= t:
            return x * math.exp(G[b, j] - Gm[b, t])
        return dt(0.0)

    @cuda.jit(device=True, inline="always")
    def entry(x, b, i, c, end):
        """``x[b, i, c]``, or 0 past the chunk's ``end`` or the last column (tile edges)."""
        if i < end and c < x.shape[2]:
            return x[b, i, c]
        return dt(0.0)

    @cuda.jit(device=True, inline="always")
    def chunk_span(n, chunk, length):
        """First token and end of chunk ``n``."""
        start = n * chunk
        return start, min(start + chunk, length)

    @cuda.jit(device=True, inline="always")
    def token_tile(tiles, chunk, length):
        """``(n, tile, start, end, first)`` of this block: ``blockIdx.x = n * tiles + tile``
        is tile ``tile`` of chunk ``n``, tokens ``first ..`` of ``start .. end``."""
        n = cuda.blockIdx.x // tiles
        tile = cuda.blockIdx.x % tiles
        start, end = chunk_span(n, chunk, length)
        return n, tile, start, end, start + tile * T

    @cuda.jit
    def chunk_max(lk, mus, chunk):
        n = cuda.blockIdx.x
        r = cuda.blockIdx.y * TT + cuda.threadIdx.x
        b = cuda.blockIdx.z
        if r < lk.shape[2]:
            acc = dt(NEG_INF)
            start, end = chunk_span(n, chunk, lk.shape[1])
            for t in range(start, end):
                acc = max(acc, lk[b, t, r])
            mus[b, n + 1, r] = acc

    @cuda.jit
    def prefix_max(mu, mus, mu_out):
        r = cuda.blockIdx.x * TT + cuda.threadIdx.x
        b = cuda.blockIdx.y
        if r < mu.shape[1]:
            run = mu[b, r]
            mus[b, 0, r] = run
            for n in range(1, mus.shape[1]):
                run = max(run, mus[b, n, r])
                mus[b, n, r] = run
            mu_out[b, r] = run

    @cuda.jit
    def row_stats(lq, lk, mus, F, G, Gm, flo, chunk):
        n = cuda.blockIdx.x
        b = cuda.blockIdx.y
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        m = lq.shape[2]
        start, end = chunk_span(n, chunk, lq.shape[1])
        red_q = cuda.shared.array((T, T), dt)
        red_k = cuda.shared.array((T, T), dt)
        for row0 in range(start, end, T):
            t = row0 + ty
            fq = dt(NEG_INF)
            gk = dt(NEG_INF)
            if t < end:
                for r in range(tx, m, T):
                    s = safe(mus[b, n, r])
                    fq = max(fq, lq[b, t, r] + s)
                    gk = max(gk, lk[b, t, r] - s)
            red_q[ty, tx] = fq
            red_k[ty, tx] = gk
            cuda.syncthreads()
            step = T // 2
            while step > 0:
                if tx < step:
                    red_q[ty, tx] = max(red_q[ty, tx], red_q[ty, tx + step])
                    red_k[ty, tx] = max(red_k[ty, tx], red_k[ty, tx + step])
                cuda.syncthreads()
                step //= 2
            if tx == 0 and t < end:
                F[b, t] = safe(red_q[ty, 0])
                G[b, t] = red_k[ty, 0]
            cuda.syncthreads()
        if tx == 0 and ty == 0:
            floor = dt(NEG_INF)
            for r in range(m):
                if math.isfinite(mus[b, n, r]):
                    floor = dt(0.0)
                    break
            flo[b, n] = floor
            run = floor
            for t in range(start, end):
                run = max(run, G[b, t])
                Gm[b, t] = safe(run)

    @cuda.jit
    def forward_intra(lq, lk, va, mus, F, G, Gm, flo, out, chunk, tiles):
        n, qt, start, end, t0 = token_tile(tiles, chunk, lq.shape[1])
        b = cuda.blockIdx.y
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        m = lq.shape[2]
        width = va.shape[2]
        if t0 >= end:
            return
        us = cuda.shared.array((T, T), dt)
        ks = cuda.shared.array((T, TP), dt)
        a_s = cuda.shared.array((T, T), dt)
        vs = cuda.shared.array((T, T), dt)
        t = t0 + ty
        for kt in range(qt + 1):
            j0 = start + kt * T
            acc = dt(0.0)
            for r0 in range(0, m, T):
                us[ty, tx] = feature(QUERY, lq, lk, mus, F, G, Gm, flo, b, n, t, r0 + tx, end)
                ks[ty, tx] = feature(KEY, lq, lk, mus, F, G, Gm, flo, b, n, j0 + ty, r0 + tx, end)
                cuda.syncthreads()
                for x in range(T):
                    acc += us[ty, x] * ks[tx, x]
                cuda.syncthreads()
            a_s[ty, tx] = causal(acc, G, Gm, b, j0 + tx, t, end)
            cuda.syncthreads()
            for c0 in range(0, width, T):
                c = c0 + tx
                j = j0 + ty
                vs[ty, tx] = entry(va, b, j, c, end)
                cuda.syncthreads()
                s = dt(0.0)
                for y in range(T):
                    s += a_s[ty, y] * vs[y, tx]
                if t < end and c < width:
                    if kt == 0:
                        out[b, t, c] = s
                    else:
                        out[b, t, c] += s
                cuda.syncthreads()

    @cuda.jit
    def chunk_increments(lq, lk, z, mus, F, G, Gm, flo, states, chunk, row_tiles, kind):
        """``states[b, n] = sum_{j in chunk n} Y_j z_j^T``, Y the features of ``kind``.

        ``KEY_STATE`` with ``z = [V | 1]``: what chunk n adds to the state;
        ``WEIGHTED_QUERY`` with ``z = dO``: what it adds to the state's gradient.
        One block per (chunk, state tile).
        """
        n = cuda.blockIdx.x
        r0 = (cuda.blockIdx.y % row_tiles) * T
        c0 = (cuda.blockIdx.y // row_tiles) * T
        b = cuda.blockIdx.z
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        m = lq.shape[2]
        width = z.shape[2]
        start, end = chunk_span(n, chunk, lq.shape[1])
        ys = cuda.shared.array((T, T), dt)
        zs = cuda.shared.array((T, T), dt)
        r = r0 + ty
        c = c0 + tx
        s = dt(0.0)
        for j0 in range(start, end, T):
            j = j0 + ty
            ys[ty, tx] = feature(kind, lq, lk, mus, F, G, Gm, flo, b, n, j, r0 + tx, end)
            zs[ty, tx] = entry(z, b, j, c, end)
            cuda.syncthreads()
            for y in range(T):
                s += ys[y, ty] * zs[y, tx]
            cuda.syncthreads()
        if r < m and c < width:
            states[b, n, r, c] = s

    @cuda.jit
    def scan_states(initial, mus, states, final, reverse):
        """Turn chunk increments into states, in place; one thread per state entry.

        Forward: ``states[b, n] <- S_n`` (before chunk n), ``S_{n+1} = decay_n S_n +
        increment_n``, ``final <- S_N``.  Reverse (gradients): ``states[b, n] <-
        dS_{n+1}``, ``dS_n = decay_n dS_{n+1} + increment_n``, ``final <- dS_0``.

        A row of the input state whose shift is ``-inf`` is empty, whatever its
        stored values (``exp(-inf) S = 0``): it starts at 0, and its gradient is 0.
        """
        i = cuda.blockIdx.x * TT + cuda.threadIdx.x
        b = cuda.blockIdx.y
        width = initial.shape[2]
        num_chunks = states.shape[1]
        if i < initial.shape[1] * width:
            r = i // width
            c = i % width
            empty = not math.isfinite(mus[b, 0, r])
            s = initial[b, r, c]
            if empty and not reverse:
                s = dt(0.0)
            for step in range(num_chunks):
                n = num_chunks - 1 - step if reverse else step
                increment = states[b, n, r, c]
                states[b, n, r, c] = s
                s = decay(mus, b, n, r) * s + increment
            if empty and reverse:
                s = dt(0.0)
            final[b, r, c] = s

    @cuda.jit
    def state_readout(lq, lk, mus, F, G, Gm, flo, states, out, chunk, tiles, kind):
        """``out[t, c] += sum_r X[t, r] M_n[r, c]``, one block per (token tile, column tile).

        ``QUERY`` against ``S_n`` (times ``w_t``): the state term of the outputs;
        ``KEY_STATE`` against ``dS_{n+1}``: the state gradient of ``[V | 1]``.
        """
        n, _, _, end, t0 = token_tile(tiles, chunk, lq.shape[1])
        c = cuda.blockIdx.y * T + cuda.threadIdx.x
        b = cuda.blockIdx.z
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        m = lq.shape[2]
        width = states.shape[3]
        if t0 >= end:
            return
        xs = cuda.shared.array((T, T), dt)
        ms = cuda.shared.array((T, T), dt)
        t = t0 + ty
        acc = dt(0.0)
        for r0 in range(0, m, T):
            xs[ty, tx] = feature(kind, lq, lk, mus, F, G, Gm, flo, b, n, t, r0 + tx, end)
            r = r0 + ty
            ms[ty, tx] = states[b, n, r, c] if (r < m and c < width) else dt(0.0)
            cuda.syncthreads()
            for x in range(T):
                acc += xs[ty, x] * ms[x, tx]
            cuda.syncthreads()
        if t < end and c < width:
            if kind == QUERY:
                acc *= math.exp(flo[b, n] - Gm[b, t])
            out[b, t, c] += acc

    @cuda.jit
    def feature_readout(lq, lk, z, mus, F, G, Gm, flo, states, out, chunk, tiles, kind):
        """``out[t, r] += X[t, r] sum_c z[t, c] M_n[r, c]``, one block per (token, feature) tile.

        ``WEIGHTED_QUERY``, ``z = dO`` against ``S_n``: the state gradient of ``l(q)``;
        ``KEY_STATE``, ``z = [V | 1]`` against ``dS_{n+1}``: that of ``l(k)``.
        """
        n, _, _, end, t0 = token_tile(tiles, chunk, lq.shape[1])
        r0 = cuda.blockIdx.y * T
        b = cuda.blockIdx.z
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        m = lq.shape[2]
        width = states.shape[3]
        if t0 >= end:
            return
        zs = cuda.shared.array((T, T), dt)
        ms = cuda.shared.array((T, TP), dt)
        t = t0 + ty
        r_load = r0 + ty
        acc = dt(0.0)
        for c0 in range(0, width, T):
            c = c0 + tx
            zs[ty, tx] = entry(z, b, t, c, end)
            ms[ty, tx] = states[b, n, r_load, c] if (r_load < m and c < width) else dt(0.0)
            cuda.syncthreads()
            for x in range(T):
                acc += zs[ty, x] * ms[tx, x]
            cuda.syncthreads()
        r = r0 + tx
        if t < end and r < m:
            out[b, t, r] += feature(kind, lq, lk, mus, F, G, Gm, flo, b, n, t, r, end) * acc

    @cuda.jit
    def backward_intra_queries(lq, lk, va, dout, mus, F, G, Gm, flo, dlq, chunk, tiles):
        """``dl(q)[t, r] = u[t, r] sum_{j<=t} P[t, j] psi[j, r]``, P = (dO va^T) e."""
        n, qt, start, end, t0 = token_tile(tiles, chunk, lq.shape[1])
        b = cuda.blockIdx.y
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        m = lq.shape[2]
        width = va.shape[2]
        if t0 >= end:
            return
        ds = cuda.shared.array((T, T), dt)
        vs = cuda.shared.array((T, TP), dt)
        ps = cuda.shared.array((T, T), dt)
        ks = cuda.shared.array((T, T), dt)
        t = t0 + ty
        for kt in range(qt + 1):
            j0 = start + kt * T
            acc = dt(0.0)
            for c0 in range(0, width, T):
                c = c0 + tx
                j = j0 + ty
                ds[ty, tx] = entry(dout, b, t, c, end)
                vs[ty, tx] = entry(va, b, j, c, end)
                cuda.syncthreads()
                for x in range(T):
                    acc += ds[ty, x] * vs[tx, x]
                cuda.syncthreads()
            ps[ty, tx] = causal(acc, G, Gm, b, j0 + tx, t, end)
            cuda.syncthreads()
            for r0 in range(0, m, T):
                ks[ty, tx] = feature(KEY, lq, lk, mus, F, G, Gm, flo, b, n, j0 + ty, r0 + tx, end)
                cuda.syncthreads()
                s = dt(0.0)
                for y in range(T):
                    s += ps[ty, y] * ks[y, tx]
                r = r0 + tx
                if t < end and r < m:
                    val = feature(QUERY, lq, lk, mus, F, G, Gm, flo, b, n, t, r, end) * s
                    if kt == 0:
                        dlq[b, t, r] = val
                    else:
                        dlq[b, t, r] += val
                cuda.syncthreads()

    @cuda.jit
    def backward_intra_keys(lq, lk, va, dout, mus, F, G, Gm, flo, dlk, dva, chunk, tiles):
        """``dl(k)[j, r] = psi[j, r] sum_{t>=j} P[t, j] u[t, r]`` and
        ``d[V|1][j, c] = sum_{t>=j} A[t, j] dO[t, c]``, A = (u psi^T) e."""
        n, kt, start, end, j0 = token_tile(tiles, chunk, lq.shape[1])
        b = cuda.blockIdx.y
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        m = lq.shape[2]
        width = va.shape[2]
        if j0 >= end:
            return
        a_s = cuda.shared.array((T, T), dt)
        b_s = cuda.shared.array((T, TP), dt)
        pts = cuda.shared.array((T, T), dt)
        ats = cuda.shared.array((T, T), dt)
        j = j0 + ty
        last = (end - start - 1) // T
        for qt in range(kt, last + 1):
            t0 = start + qt * T
            accp = dt(0.0)
            for c0 in range(0, width, T):
                c = c0 + tx
                a_s[ty, tx] = entry(va, b, j, c, end)
                tt = t0 + ty
                b_s[ty, tx] = entry(dout, b, tt, c, end)
                cuda.syncthreads()
                for x in range(T):
                    accp += a_s[ty, x] * b_s[tx, x]
                cuda.syncthreads()
            acca = dt(0.0)
            for r0 in range(0, m, T):
                a_s[ty, tx] = feature(KEY, lq, lk, mus, F, G, Gm, flo, b, n, j, r0 + tx, end)
                b_s[ty, tx] = feature(
                    QUERY, lq, lk, mus, F, G, Gm, flo, b, n, t0 + ty, r0 + tx, end
                )
                cuda.syncthreads()
                for x in range(T):
                    acca += a_s[ty, x] * b_s[tx, x]
                cuda.syncthreads()
            pts[ty, tx] = causal(accp, G, Gm, b, j, t0 + tx, end)
            ats[ty, tx] = causal(acca, G, Gm, b, j, t0 + tx, end)
            cuda.syncthreads()
            for r0 in range(0, m, T):
                a_s[ty, tx] = feature(
                    QUERY, lq, lk, mus, F, G, Gm, flo, b, n, t0 + ty, r0 + tx, end
                )
                cuda.syncthreads()
                s = dt(0.0)
                for y in range(T):
                    s += pts[ty, y] * a_s[y, tx]
                r = r0 + tx
                if j < end and r < m:
                    val = feature(KEY, lq, lk, mus, F, G, Gm, flo, b, n, j, r, end) * s
                    if qt == kt:
                        dlk[b, j, r] = val
                    else:
                        dlk[b, j, r] += val
                cuda.syncthreads()
            for c0 in range(0, width, T):
                c = c0 + tx
                tt = t0 + ty
                a_s[ty, tx] = entry(dout, b, tt, c, end)
                cuda.syncthreads()
                s = dt(0.0)
                for y in range(T):
                    s += ats[ty, y] * a_s[y, tx]
                if j < end and c < width:
                    if qt == kt:
                        dva[b, j, c] = s
                    else:
                        dva[b, j, c] += s
                cuda.syncthreads()

    @cuda.jit
    def log_scale(F, Gm, out):
        """``out[b, t] = F_t + Gmax_t``: every factor of row ``t`` that the stabilisers
        took out (``u`` is shifted by ``F_t``, all of its terms by ``Gmax_t``)."""
        t = cuda.blockIdx.x * TT + cuda.threadIdx.x
        b = cuda.blockIdx.y
        if t < F.shape[1]:
            out[b, t] = F[b, t] + Gm[b, t]

    @cuda.jit
    def chunk_features(lq, lk, va, mus, F, G, Gm, flo, u, psi, phi, vap):
        """``u``, ``psi``, ``phi (B, N, C, m)`` and ``[V | 1]`` ``vap (B, N, C, D)`` of
        every chunk, 0 past ``L``; one block per padded token, a thread per column."""
        p = cuda.blockIdx.x  # padded token n * C + i
        col = cuda.blockIdx.y * TT + cuda.threadIdx.x
        b = cuda.blockIdx.z
        C = u.shape[2]
        n = p // C
        i = p % C
        end = min((n + 1) * C, lq.shape[1])
        if col < lq.shape[2]:
            u[b, n, i, col] = feature(QUERY, lq, lk, mus, F, G, Gm, flo, b, n, p, col, end)
            psi[b, n, i, col] = feature(KEY, lq, lk, mus, F, G, Gm, flo, b, n, p, col, end)
            phi[b, n, i, col] = feature(KEY_STATE, lq, lk, mus, F, G, Gm, flo, b, n, p, col, end)
        if col < va.shape[2]:
            vap[b, n, i, col] = entry(va, b, p, col, end)

    @cuda.jit
    def causal_select(scores, G, Gm):
        """``scores[b, n, i, j] <- (u psi^T)[i, j] exp(G_j - Gmax_i)`` for keys ``j <= i``
        of the chunk, else 0 (selected: a later key's NaN never reaches query ``i``)."""
        p = cuda.blockIdx.x  # padded query n * C + i
        j = cuda.blockIdx.y * TT + cuda.threadIdx.x
        b = cuda.blockIdx.z
        C = scores.shape[2]
        n = p // C
        i = p % C
        start = n * C
        if j < C:
            end = min(start + C, G.shape[1])
            scores[b, n, i, j] = causal(scores[b, n, i, j], G, Gm, b, start + j, p, end)

    @cuda.jit
    def combine_readout(intra, readout, Gm, flo, out):
        """``out[b, t] = intra[t] + w_t (u S_n)[t]``, ``w_t = exp(floor_n - Gmax_t)``."""
        t = cuda.blockIdx.x
        c = cuda.blockIdx.y * TT + cuda.threadIdx.x
        b = cuda.blockIdx.z
        C = intra.shape[2]
        n = t // C
        i = t % C
        if c < out.shape[2]:
            out[b, t, c] = intra[b, n, i, c] + readout[b, n, i, c] * math.exp(flo[b, n] - Gm[b, t])

    return SimpleNamespace(
        chunk_max=chunk_max,
        prefix_max=prefix_max,
        row_stats=row_stats,
        forward_intra=forward_intra,
        chunk_increments=chunk_increments,
        scan_states=scan_states,
        state_readout=state_readout,
        feature_readout=feature_readout,
        backward_intra_queries=backward_intra_queries,
        backward_intra_keys=backward_intra_keys,
        log_scale=log_scale,
        chunk_features=chunk_features,
        causal_select=causal_select,
        combine_readout=combine_readout,
    )


def signatures(precision: str) -> dict[str, str]:
    """Argument types of every kernel (C-contiguous arrays), for ahead-of-time PTX checks."""
    a2, a3, a4 = (f"{precision}[{', '.join([':'] * (k - 1) + ['::1'])}]" for k in (2, 3, 4))
    stats = f"{a3}, {a2}, {a2}, {a2}, {a2}"  # mus, F, G, Gm, flo
    i = "int64"
    return {
        "chunk_max": f"void({a3}, {a3}, {i})",
        "prefix_max": f"void({a2}, {a3}, {a2})",
        "row_stats": f"void({a3}, {a3}, {stats}, {i})",
        "forward_intra": f"void({a3}, {a3}, {a3}, {stats}, {a3}, {i}, {i})",
        "chunk_increments": f"void({a3}, {a3}, {a3}, {stats}, {a4}, {i}, {i}, {i})",
        "scan_states": f"void({a3}, {a3}, {a4}, {a3}, boolean)",
        "state_readout": f"void({a3}, {a3}, {stats}, {a4}, {a3}, {i}, {i}, {i})",
        "feature_readout": f"void({a3}, {a3}, {a3}, {stats}, {a4}, {a3}, {i}, {i}, {i})",
        "backward_intra_queries": f"void({a3}, {a3}, {a3}, {a3}, {stats}, {a3}, {i}, {i})",
        "backward_intra_keys": f"void({a3}, {a3}, {a3}, {a3}, {stats}, {a3}, {a3}, {i}, {i})",
        "log_scale": f"void({a2}, {a2}, {a2})",
        "chunk_features": f"void({a3}, {a3}, {a3}, {stats}, {a4}, {a4}, {a4}, {a4})",
        "causal_select": f"void({a4}, {a2}, {a2})",
        "combine_readout": f"void({a4}, {a4}, {a2}, {a2}, {a3})",
    }
