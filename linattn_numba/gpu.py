"""Numba CUDA kernels: the chunked, stabilised causal scan, forward and backward.

Same algorithm, same stabilisers and the same results as
``linattn.causal.causal`` (read its module docstring): the state ``(S, mu)`` is
kept at the caller's chunk boundaries, queries are shifted per row by
``F_t = max_r (l(q_t)_r + mu_r)``, keys by ``G_j = max_r (l(k_j)_r - mu_r)``, and
token ``t`` weighs key ``j <= t`` of its chunk by ``exp(G_j - Gmax_t)`` and the
state by ``exp(floor - Gmax_t)``.

Work is split so that everything but the scan over chunks runs in parallel
over chunks (``T x T`` thread blocks, ``T = TILE``):

1. ``chunk_max`` / ``prefix_max``: ``mu`` at every chunk start (a prefix
   maximum over chunks), and the final ``mu``;
2. ``row_stats``: ``F``, ``G``, the running ``Gmax`` and the state floor;
3. ``forward_intra``: the masked intra-chunk term, one block per query tile;
4. ``scan_columns``: the state term, sequential over chunks, one block per
   (batch, column tile of ``[V | 1]``), the state in ``kv_out``.

Backward (stabilisers treated as constants, which is exact for the normalised
output since numerator and denominator share every shift) recomputes the
stabilisers and the chunk states *forward* from the initial state — never by
subtraction: ``backward_intra_queries`` / ``backward_intra_keys`` give the
intra-chunk gradients, ``scan_rows`` (forward sweep of ``S``, reverse sweep of
``dS``, one block per feature tile) the state gradients of ``l(q)``, ``l(k)``
and ``kv``, and ``scan_columns`` (reverse sweep of ``dS``) those of ``[V | 1]``.

State and accumulation are float32 (float64 inputs are computed in float64;
float16/bfloat16 inputs are upcast to float32 first).  Arrays reach the
kernels zero-copy through ``__cuda_array_interface__`` (a contiguous copy is
made only of non-contiguous or broadcast inputs) and kernels run on the
caller's current stream: CuPy's current stream, ``torch.cuda.current_stream()``.
Results are in the caller's array type on the same device.  Every input is
validated before any launch; launch failures raise ``RuntimeError``.

Examples
--------
Under the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) the ``"numpy"`` library
copies host arrays to the (simulated) device and back:

>>> import numpy as np
>>> from linattn_numba import gpu as lcuda
>>> kernel = lcuda.causal_kernel("numpy")
>>> rng = np.random.default_rng(0)
>>> lq, lk = rng.normal(size=(2, 5, 3)), rng.normal(size=(2, 5, 3))
>>> va = np.concatenate([rng.normal(size=(2, 5, 2)), np.ones((2, 5, 1))], axis=-1)
>>> kv, mu = np.zeros((2, 3, 3)), np.full((2, 3), -np.inf)
>>> out, kv_out, mu_out = kernel(lq, lk, va, kv, mu, 4)  # doctest: +SKIP
>>> out.shape, kv_out.shape, mu_out.shape  # doctest: +SKIP
((2, 5, 3), (2, 3, 3), (2, 3))
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numba
import numpy as np

from linattn_numba import _cuda

__all__ = ["KERNEL_NAMES", "backward", "causal_kernel", "forward", "kernels", "signatures"]

cuda = _cuda.cuda
TILE = _cuda.TILE

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
    "scan_columns",
    "scan_rows",
    "backward_intra_queries",
    "backward_intra_keys",
)

MAX_BATCH = 65535  # CUDA's limit on gridDim.y / gridDim.z


@functools.cache
def kernels(precision: str) -> SimpleNamespace:
    """The CUDA kernels for ``precision`` ``"float32"`` or ``"float64"`` (compiled lazily)."""
    if precision not in ("float32", "float64"):
        raise ValueError(f"precision must be 'float32' or 'float64'; got {precision!r}")
    return _build(getattr(numba, precision))


def _build(dt: Any) -> SimpleNamespace:  # noqa: C901  (one closure per precision)
    T = TILE
    TT = TILE * TILE
    TP = TILE + 1  # padded rows: column reads hit distinct banks
    NEG_INF = -math.inf

    @cuda.jit(device=True, inline=True)
    def safe(x):
        if math.isfinite(x):
            return x
        return dt(0.0)

    @cuda.jit(device=True, inline=True)
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

    @cuda.jit(device=True, inline=True)
    def decay(mus, b, n, r):
        old = mus[b, n, r]
        if math.isfinite(old):
            return math.exp(old - safe(mus[b, n + 1, r]))
        return dt(0.0)

    @cuda.jit(device=True, inline=True)
    def pair_weight(G, Gm, b, j, t, end):
        """exp(G_j - Gmax_t) for keys j <= t of the chunk, else 0."""
        if t < end and j <= t:
            return math.exp(G[b, j] - Gm[b, t])
        return dt(0.0)

    @cuda.jit
    def chunk_max(lk, mus, chunk):
        n = cuda.blockIdx.x
        r = cuda.blockIdx.y * TT + cuda.threadIdx.x
        b = cuda.blockIdx.z
        if r < lk.shape[2]:
            acc = dt(NEG_INF)
            start = n * chunk
            for t in range(start, min(start + chunk, lk.shape[1])):
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
        start = n * chunk
        end = min(start + chunk, lq.shape[1])
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
        n = cuda.blockIdx.x // tiles
        qt = cuda.blockIdx.x % tiles
        b = cuda.blockIdx.y
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        m = lq.shape[2]
        width = va.shape[2]
        start = n * chunk
        end = min(start + chunk, lq.shape[1])
        t0 = start + qt * T
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
            a_s[ty, tx] = acc * pair_weight(G, Gm, b, j0 + tx, t, end)
            cuda.syncthreads()
            for c0 in range(0, width, T):
                c = c0 + tx
                j = j0 + ty
                vs[ty, tx] = va[b, j, c] if (j < end and c < width) else dt(0.0)
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
    def scan_columns(lq, lk, z, mus, F, G, Gm, flo, state, out, chunk, x_kind, y_kind, reverse):
        """Per chunk: ``out[t, c] += sum_r X[t, r] M[r, c]``, then
        ``M[r, c] = decay_r M[r, c] + sum_t Y[t, r] z[t, c]``; block = a column tile."""
        c0 = cuda.blockIdx.x * T
        b = cuda.blockIdx.y
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        length = lq.shape[1]
        m = lq.shape[2]
        width = state.shape[2]
        num_chunks = (length + chunk - 1) // chunk
        xs = cuda.shared.array((T, T), dt)
        ms = cuda.shared.array((T, T), dt)
        ys = cuda.shared.array((T, T), dt)
        zs = cuda.shared.array((T, T), dt)
        c = c0 + tx
        for step in range(num_chunks):
            n = num_chunks - 1 - step if reverse else step
            start = n * chunk
            end = min(start + chunk, length)
            for t0 in range(start, end, T):
                t = t0 + ty
                acc = dt(0.0)
                for r0 in range(0, m, T):
                    xs[ty, tx] = feature(x_kind, lq, lk, mus, F, G, Gm, flo, b, n, t, r0 + tx, end)
                    r = r0 + ty
                    ms[ty, tx] = state[b, r, c] if (r < m and c < width) else dt(0.0)
                    cuda.syncthreads()
                    for x in range(T):
                        acc += xs[ty, x] * ms[x, tx]
                    cuda.syncthreads()
                if t < end and c < width:
                    out[b, t, c] += acc
            for r0 in range(0, m, T):
                r = r0 + ty
                s = dt(0.0)
                if r < m and c < width:
                    s = decay(mus, b, n, r) * state[b, r, c]
                for j0 in range(start, end, T):
                    j = j0 + ty
                    ys[ty, tx] = feature(y_kind, lq, lk, mus, F, G, Gm, flo, b, n, j, r0 + tx, end)
                    zs[ty, tx] = z[b, j, c] if (j < end and c < width) else dt(0.0)
                    cuda.syncthreads()
                    for y in range(T):
                        s += ys[y, ty] * zs[y, tx]
                    cuda.syncthreads()
                if r < m and c < width:
                    state[b, r, c] = s

    @cuda.jit
    def scan_rows(lq, lk, z, w, mus, F, G, Gm, flo, state, out, chunk, x_kind, y_kind, reverse):
        """Per chunk: ``out[t, r] += X[t, r] sum_c z[t, c] M[r, c]``, then
        ``M[r, c] = decay_r M[r, c] + sum_t Y[t, r] w[t, c]``; block = a feature tile."""
        r0 = cuda.blockIdx.x * T
        b = cuda.blockIdx.y
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        length = lq.shape[1]
        m = lq.shape[2]
        width = state.shape[2]
        num_chunks = (length + chunk - 1) // chunk
        zs = cuda.shared.array((T, T), dt)
        ms = cuda.shared.array((T, TP), dt)
        ys = cuda.shared.array((T, T), dt)
        ws = cuda.shared.array((T, T), dt)
        r_own = r0 + ty
        for step in range(num_chunks):
            n = num_chunks - 1 - step if reverse else step
            start = n * chunk
            end = min(start + chunk, length)
            for t0 in range(start, end, T):
                t = t0 + ty
                acc = dt(0.0)
                for c0 in range(0, width, T):
                    c = c0 + tx
                    zs[ty, tx] = z[b, t, c] if (t < end and c < width) else dt(0.0)
                    ms[ty, tx] = state[b, r_own, c] if (r_own < m and c < width) else dt(0.0)
                    cuda.syncthreads()
                    for x in range(T):
                        acc += zs[ty, x] * ms[tx, x]
                    cuda.syncthreads()
                r = r0 + tx
                if t < end and r < m:
                    out[b, t, r] += (
                        feature(x_kind, lq, lk, mus, F, G, Gm, flo, b, n, t, r, end) * acc
                    )
            for c0 in range(0, width, T):
                c = c0 + tx
                s = dt(0.0)
                if r_own < m and c < width:
                    s = decay(mus, b, n, r_own) * state[b, r_own, c]
                for j0 in range(start, end, T):
                    j = j0 + ty
                    ys[ty, tx] = feature(y_kind, lq, lk, mus, F, G, Gm, flo, b, n, j, r0 + tx, end)
                    ws[ty, tx] = w[b, j, c] if (j < end and c < width) else dt(0.0)
                    cuda.syncthreads()
                    for y in range(T):
                        s += ys[y, ty] * ws[y, tx]
                    cuda.syncthreads()
                if r_own < m and c < width:
                    state[b, r_own, c] = s

    @cuda.jit
    def backward_intra_queries(lq, lk, va, dout, mus, F, G, Gm, flo, dlq, chunk, tiles):
        """``dl(q)[t, r] = u[t, r] sum_{j<=t} P[t, j] psi[j, r]``, P = (dO va^T) e."""
        n = cuda.blockIdx.x // tiles
        qt = cuda.blockIdx.x % tiles
        b = cuda.blockIdx.y
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        m = lq.shape[2]
        width = va.shape[2]
        start = n * chunk
        end = min(start + chunk, lq.shape[1])
        t0 = start + qt * T
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
                ds[ty, tx] = dout[b, t, c] if (t < end and c < width) else dt(0.0)
                vs[ty, tx] = va[b, j, c] if (j < end and c < width) else dt(0.0)
                cuda.syncthreads()
                for x in range(T):
                    acc += ds[ty, x] * vs[tx, x]
                cuda.syncthreads()
            ps[ty, tx] = acc * pair_weight(G, Gm, b, j0 + tx, t, end)
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
        n = cuda.blockIdx.x // tiles
        kt = cuda.blockIdx.x % tiles
        b = cuda.blockIdx.y
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        m = lq.shape[2]
        width = va.shape[2]
        start = n * chunk
        end = min(start + chunk, lq.shape[1])
        j0 = start + kt * T
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
                a_s[ty, tx] = va[b, j, c] if (j < end and c < width) else dt(0.0)
                tt = t0 + ty
                b_s[ty, tx] = dout[b, tt, c] if (tt < end and c < width) else dt(0.0)
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
            e = pair_weight(G, Gm, b, j, t0 + tx, end)
            pts[ty, tx] = accp * e
            ats[ty, tx] = acca * e
            cuda.syncthreads()
            for r0 in range(0, m, T):
                a_s[ty, tx] = feature(QUERY, lq, lk, mus, F, G, Gm, flo, b, n, t0 + ty, r0 + tx, end)
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
                a_s[ty, tx] = dout[b, tt, c] if (tt < end and c < width) else dt(0.0)
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

    return SimpleNamespace(
        chunk_max=chunk_max,
        prefix_max=prefix_max,
        row_stats=row_stats,
        forward_intra=forward_intra,
        scan_columns=scan_columns,
        scan_rows=scan_rows,
        backward_intra_queries=backward_intra_queries,
        backward_intra_keys=backward_intra_keys,
    )


def signatures(precision: str) -> dict[str, str]:
    """Argument types of every kernel (C-contiguous arrays), for ahead-of-time PTX checks."""
    a1, a2, a3 = (f"{precision}[{', '.join([':'] * (k - 1) + ['::1'])}]" for k in (1, 2, 3))
    del a1
    stats = f"{a3}, {a2}, {a2}, {a2}, {a2}"  # mus, F, G, Gm, flo
    i = "int64"
    return {
        "chunk_max": f"void({a3}, {a3}, {i})",
        "prefix_max": f"void({a2}, {a3}, {a2})",
        "row_stats": f"void({a3}, {a3}, {stats}, {i})",
        "forward_intra": f"void({a3}, {a3}, {a3}, {stats}, {a3}, {i}, {i})",
        "scan_columns": f"void({a3}, {a3}, {a3}, {stats}, {a3}, {a3}, {i}, {i}, {i}, boolean)",
        "scan_rows": f"void({a3}, {a3}, {a3}, {a3}, {stats}, {a3}, {a3}, {i}, {i}, {i}, boolean)",
        "backward_intra_queries": f"void({a3}, {a3}, {a3}, {a3}, {stats}, {a3}, {i}, {i})",
        "backward_intra_keys": f"void({a3}, {a3}, {a3}, {a3}, {stats}, {a3}, {a3}, {i}, {i})",
    }


# --------------------------------------------------------------------------------------
# Array libraries: how each one is checked, flattened, allocated and handed to numba.


class _Library:
    name = ""
    float_names = ("float16", "bfloat16", "float32", "float64")

    def is_array(self, x: Any) -> bool:
        raise NotImplementedError

    def dtype_name(self, x: Any) -> str:
        return str(x.dtype).rsplit(".", 1)[-1]

    def device_id(self, x: Any) -> int | None:
        """The CUDA device ordinal of ``x``, or ``None`` if it is not on a CUDA device."""
        raise NotImplementedError

    def prepare(self, x: Any, shape: tuple[int, ...], dtype: str) -> Any:
        """``x`` reshaped to ``shape``, cast to ``dtype``, C-contiguous (copies only if needed)."""
        raise NotImplementedError

    def copy(self, x: Any, shape: tuple[int, ...], dtype: str) -> Any:
        """A fresh, writable, C-contiguous copy (kernels write into it)."""
        raise NotImplementedError

    def empty(self, shape: tuple[int, ...], dtype: str, device: int | None) -> Any:
        raise NotImplementedError

    def zeros(self, shape: tuple[int, ...], dtype: str, device: int | None) -> Any:
        raise NotImplementedError

    def view(self, x: Any) -> Any:
        """The numba device array seeing ``x``'s memory."""
        return _cuda.as_device_array(x)

    def stream(self, device: int | None) -> Any:
        raise NotImplementedError

    def result(self, x: Any, shape: tuple[int, ...]) -> Any:
        return x.reshape(shape)


class _NumPy(_Library):
    """Host arrays, copied to the device and back (for the simulator and tests)."""

    name = "numpy"

    def is_array(self, x: Any) -> bool:
        return isinstance(x, np.ndarray)

    def device_id(self, x: Any) -> int | None:
        return 0

    def prepare(self, x: Any, shape: tuple[int, ...], dtype: str) -> Any:
        return _cuda.to_device(np.ascontiguousarray(np.reshape(x, shape), dtype=dtype))

    def copy(self, x: Any, shape: tuple[int, ...], dtype: str) -> Any:
        return self.prepare(x, shape, dtype)

    def empty(self, shape: tuple[int, ...], dtype: str, device: int | None) -> Any:
        return _cuda.device_array(shape, np.dtype(dtype))

    def zeros(self, shape: tuple[int, ...], dtype: str, device: int | None) -> Any:
        return _cuda.to_device(np.zeros(shape, dtype=dtype))

    def view(self, x: Any) -> Any:
        return x

    def stream(self, device: int | None) -> Any:
        return 0

    def result(self, x: Any, shape: tuple[int, ...]) -> Any:
        return x.copy_to_host().reshape(shape)


class _CuPy(_Library):
    name = "cupy"

    def is_array(self, x: Any) -> bool:
        import cupy

        return isinstance(x, cupy.ndarray)

    def device_id(self, x: Any) -> int | None:
        return int(x.device.id)

    def prepare(self, x: Any, shape: tuple[int, ...], dtype: str) -> Any:
        import cupy

        return cupy.ascontiguousarray(x.reshape(shape), dtype=dtype)

    def copy(self, x: Any, shape: tuple[int, ...], dtype: str) -> Any:
        import cupy

        return cupy.array(x.reshape(shape), dtype=dtype, order="C", copy=True)

    def empty(self, shape: tuple[int, ...], dtype: str, device: int | None) -> Any:
        import cupy

        with cupy.cuda.Device(device):
            return cupy.empty(shape, dtype=dtype)

    def zeros(self, shape: tuple[int, ...], dtype: str, device: int | None) -> Any:
        import cupy

        with cupy.cuda.Device(device):
            return cupy.zeros(shape, dtype=dtype)

    def stream(self, device: int | None) -> Any:
        import cupy

        with cupy.cuda.Device(device):
            return _cuda.external_stream(cupy.cuda.get_current_stream().ptr)


class _Torch(_Library):
    name = "torch"

    def is_array(self, x: Any) -> bool:
        import torch

        return isinstance(x, torch.Tensor)

    def device_id(self, x: Any) -> int | None:
        return int(x.device.index or 0) if x.device.type == "cuda" else None

    def _dtype(self, dtype: str) -> Any:
        import torch

        return getattr(torch, dtype)

    def prepare(self, x: Any, shape: tuple[int, ...], dtype: str) -> Any:
        return x.detach().reshape(shape).to(self._dtype(dtype)).contiguous()

    def copy(self, x: Any, shape: tuple[int, ...], dtype: str) -> Any:
        return x.detach().reshape(shape).to(self._dtype(dtype), copy=True).contiguous()

    def empty(self, shape: tuple[int, ...], dtype: str, device: int | None) -> Any:
        import torch

        return torch.empty(shape, dtype=self._dtype(dtype), device=f"cuda:{device}")

    def zeros(self, shape: tuple[int, ...], dtype: str, device: int | None) -> Any:
        import torch

        return torch.zeros(shape, dtype=self._dtype(dtype), device=f"cuda:{device}")

    def stream(self, device: int | None) -> Any:
        import torch

        return _cuda.external_stream(torch.cuda.current_stream(device).cuda_stream)


LIBRARIES: dict[str, _Library] = {lib.name: lib for lib in (_NumPy(), _CuPy(), _Torch())}


# --------------------------------------------------------------------------------------
# Validation (before any launch).


def _check(
    lib: _Library, named: dict[str, Any], chunk_size: object
) -> tuple[tuple[int, ...], int, int, int, str, int | None]:
    """Check a kernel call; return (batch shape, L, m, d_v + 1, compute dtype, device)."""
    for name, x in named.items():
        if not lib.is_array(x):
            raise TypeError(
                f"{name} must be a {lib.name} array for the CUDA kernel; got "
                f"{type(x).__module__}.{type(x).__name__}"
            )
    for name, x in named.items():
        if lib.dtype_name(x) not in lib.float_names:
            raise TypeError(
                f"{name} must be float16, bfloat16, float32 or float64; got {x.dtype}"
            )
    devices = {name: lib.device_id(x) for name, x in named.items()}
    for name, dev in devices.items():
        if dev is None:
            raise ValueError(f"{name} must be on a CUDA device; got {named[name].device}")
    first_name, first = next(iter(devices.items()))
    for name, dev in devices.items():
        if dev != first:
            raise ValueError(
                f"all arrays must be on one CUDA device; {first_name} is on device {first} "
                f"but {name} is on device {dev}"
            )
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int | np.integer):
        raise TypeError(f"chunk_size must be a positive integer; got {chunk_size!r}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer; got {chunk_size}")
    lq, lk, va, kv, mu = (named[k] for k in ("log_phi_q", "log_phi_k", "values_aug", "kv",
                                             "log_shift"))
    if lq.ndim < 2:
        raise ValueError(f"log_phi_q must have shape (*batch, L, m); got {tuple(lq.shape)}")
    *batch, length, m = (int(s) for s in lq.shape)
    batch = tuple(batch)
    if m < 1:
        raise ValueError(f"log_phi_q must have at least one feature; got shape {lq.shape}")
    if va.ndim < 1 or int(va.shape[-1]) < 1:
        raise ValueError(
            f"values_aug must have shape (*batch, L, d_v + 1); got {tuple(va.shape)}"
        )
    width = int(va.shape[-1])
    expected = {
        "log_phi_k": (*batch, length, m),
        "values_aug": (*batch, length, width),
        "kv": (*batch, m, width),
        "log_shift": (*batch, m),
    }
    for name, shape in expected.items():
        if tuple(int(s) for s in named[name].shape) != shape:
            raise ValueError(
                f"{name} must have shape {shape} to match log_phi_q {tuple(lq.shape)} and "
                f"values_aug (..., {width}); got {tuple(named[name].shape)}"
            )
    if math.prod(batch) > MAX_BATCH:
        raise ValueError(
            f"the CUDA kernel serves at most {MAX_BATCH} batch entries (product of the "
            f"leading dimensions); got {math.prod(batch)}"
        )
    compute = "float64" if lib.dtype_name(lq) == "float64" else "float32"
    return batch, length, m, width, compute, first


def _launch(kernel: Any, name: str, grid: tuple[int, ...], block: tuple[int, ...], stream: Any,
            *args: Any) -> None:
    if 0 in grid:
        return
    try:
        kernel[grid, block, stream](*args)
    except Exception as error:  # numba raises CudaAPIError, CudaSupportError, ...
        raise RuntimeError(
            f"CUDA kernel {name} failed to launch (grid {grid}, block {block}): {error}"
        ) from error


class _Stats(SimpleNamespace):
    """Stabilisers of every chunk: mus (mu at chunk starts), F, G, Gmax, floor."""


def _stabilisers(
    k: SimpleNamespace, lib: _Library, lq: Any, lk: Any, mu: Any, mu_out: Any,
    shape: tuple[int, int, int], chunk: int, dtype: str, device: int | None, stream: Any,
) -> _Stats:
    batch, length, m = shape
    num_chunks = -(-length // chunk)
    mus = lib.view(lib.empty((batch, num_chunks + 1, m), dtype, device))
    F, G, Gm = (lib.view(lib.empty((batch, length), dtype, device)) for _ in range(3))
    flo = lib.view(lib.empty((batch, num_chunks), dtype, device))
    tt = TILE * TILE
    feature_blocks = -(-m // tt)
    _launch(k.chunk_max, "chunk_max", (num_chunks, feature_blocks, batch), (tt,), stream,
            lk, mus, chunk)
    _launch(k.prefix_max, "prefix_max", (feature_blocks, batch), (tt,), stream, mu, mus, mu_out)
    _launch(k.row_stats, "row_stats", (num_chunks, batch), (TILE, TILE), stream,
            lq, lk, mus, F, G, Gm, flo, chunk)
    return _Stats(mus=mus, F=F, G=G, Gm=Gm, flo=flo, num_chunks=num_chunks)


def _query_tiles(length: int, chunk: int) -> int:
    return -(-min(chunk, length) // TILE) if length else 0


def forward(
    library: str, log_phi_q: Any, log_phi_k: Any, values_aug: Any, kv: Any, log_shift: Any,
    chunk_size: int,
) -> tuple[Any, Any, Any]:
    """Chunked causal attention on the GPU; see the module docstring and the kernel contract.

    Returns ``(outputs_aug, kv_out, log_shift_out)`` in ``library``'s array type.
    """
    lib = LIBRARIES[library]
    named = {"log_phi_q": log_phi_q, "log_phi_k": log_phi_k, "values_aug": values_aug,
             "kv": kv, "log_shift": log_shift}
    batch_shape, length, m, width, dtype, device = _check(lib, named, chunk_size)
    batch = math.prod(batch_shape)
    chunk = int(chunk_size)
    k = kernels(dtype)
    with _cuda.gpu(device or 0):
        stream = lib.stream(device)
        lq = lib.prepare(log_phi_q, (batch, length, m), dtype)
        lk = lib.prepare(log_phi_k, (batch, length, m), dtype)
        va = lib.prepare(values_aug, (batch, length, width), dtype)
        mu = lib.prepare(log_shift, (batch, m), dtype)
        kv_out = lib.copy(kv, (batch, m, width), dtype)
        out = lib.empty((batch, length, width), dtype, device)
        mu_out = lib.empty((batch, m), dtype, device)
        views = [lib.view(x) for x in (lq, lk, va, mu, kv_out, out, mu_out)]
        d_lq, d_lk, d_va, d_mu, d_kv, d_out, d_mu_out = views
        if batch:
            s = _stabilisers(k, lib, d_lq, d_lk, d_mu, d_mu_out, (batch, length, m), chunk,
                             dtype, device, stream)
            stats = (s.mus, s.F, s.G, s.Gm, s.flo)
            tiles = _query_tiles(length, chunk)
            _launch(k.forward_intra, "forward_intra", (s.num_chunks * tiles, batch),
                    (TILE, TILE), stream, d_lq, d_lk, d_va, *stats, d_out, chunk, tiles)
            if length:
                _launch(k.scan_columns, "scan_columns", (-(-width // TILE), batch),
                        (TILE, TILE), stream, d_lq, d_lk, d_va, *stats, d_kv, d_out, chunk,
                        WEIGHTED_QUERY, KEY_STATE, False)
        return (
            lib.result(out, (*batch_shape, length, width)),
            lib.result(kv_out, (*batch_shape, m, width)),
            lib.result(mu_out, (*batch_shape, m)),
        )


def backward(
    library: str, log_phi_q: Any, log_phi_k: Any, values_aug: Any, kv: Any, log_shift: Any,
    chunk_size: int, d_outputs_aug: Any, d_kv_out: Any | None,
) -> tuple[Any, Any, Any, Any]:
    """Vector-Jacobian product of :func:`forward` with the stabilisers held constant.

    Returns ``(d_log_phi_q, d_log_phi_k, d_values_aug, d_kv)``.  ``d_kv_out=None``
    means zero.  Chunk states are recomputed forward from ``kv``, never by subtraction.
    """
    lib = LIBRARIES[library]
    named = {"log_phi_q": log_phi_q, "log_phi_k": log_phi_k, "values_aug": values_aug,
             "kv": kv, "log_shift": log_shift}
    batch_shape, length, m, width, dtype, device = _check(lib, named, chunk_size)
    grads = {"d_outputs_aug": (d_outputs_aug, (*batch_shape, length, width))}
    if d_kv_out is not None:
        grads["d_kv_out"] = (d_kv_out, (*batch_shape, m, width))
    for name, (g, shape) in grads.items():
        if not lib.is_array(g):
            raise TypeError(f"{name} must be a {lib.name} array; got {type(g).__name__}")
        if tuple(int(s) for s in g.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}; got {tuple(g.shape)}")
        if lib.dtype_name(g) not in lib.float_names:
            raise TypeError(f"{name} must have a floating dtype; got {g.dtype}")
        if lib.device_id(g) != device:
            raise ValueError(f"{name} must be on CUDA device {device}; got {g.device}")
    batch = math.prod(batch_shape)
    chunk = int(chunk_size)
    k = kernels(dtype)
    with _cuda.gpu(device or 0):
        stream = lib.stream(device)
        lq = lib.prepare(log_phi_q, (batch, length, m), dtype)
        lk = lib.prepare(log_phi_k, (batch, length, m), dtype)
        va = lib.prepare(values_aug, (batch, length, width), dtype)
        mu = lib.prepare(log_shift, (batch, m), dtype)
        dout = lib.prepare(d_outputs_aug, (batch, length, width), dtype)
        state = lib.copy(kv, (batch, m, width), dtype)
        if d_kv_out is None:
            d_kv = lib.zeros((batch, m, width), dtype, device)
            d_state = lib.zeros((batch, m, width), dtype, device)
        else:
            d_kv = lib.copy(d_kv_out, (batch, m, width), dtype)
            d_state = lib.copy(d_kv_out, (batch, m, width), dtype)
        d_lq = lib.empty((batch, length, m), dtype, device)
        d_lk = lib.empty((batch, length, m), dtype, device)
        d_va = lib.empty((batch, length, width), dtype, device)
        mu_out = lib.empty((batch, m), dtype, device)
        v = SimpleNamespace(
            **{name: lib.view(x) for name, x in dict(
                lq=lq, lk=lk, va=va, mu=mu, dout=dout, state=state, d_kv=d_kv,
                d_state=d_state, d_lq=d_lq, d_lk=d_lk, d_va=d_va, mu_out=mu_out).items()}
        )
        if batch and length:
            s = _stabilisers(k, lib, v.lq, v.lk, v.mu, v.mu_out, (batch, length, m), chunk,
                             dtype, device, stream)
            stats = (s.mus, s.F, s.G, s.Gm, s.flo)
            tiles = _query_tiles(length, chunk)
            grid = (s.num_chunks * tiles, batch)
            block = (TILE, TILE)
            _launch(k.backward_intra_queries, "backward_intra_queries", grid, block, stream,
                    v.lq, v.lk, v.va, v.dout, *stats, v.d_lq, chunk, tiles)
            _launch(k.backward_intra_keys, "backward_intra_keys", grid, block, stream,
                    v.lq, v.lk, v.va, v.dout, *stats, v.d_lk, v.d_va, chunk, tiles)
            rows = (-(-m // TILE), batch)
            _launch(k.scan_rows, "scan_rows", rows, block, stream, v.lq, v.lk, v.dout, v.va,
                    *stats, v.state, v.d_lq, chunk, WEIGHTED_QUERY, KEY_STATE, False)
            _launch(k.scan_rows, "scan_rows", rows, block, stream, v.lq, v.lk, v.va, v.dout,
                    *stats, v.d_kv, v.d_lk, chunk, KEY_STATE, WEIGHTED_QUERY, True)
            _launch(k.scan_columns, "scan_columns", (-(-width // TILE), batch), block, stream,
                    v.lq, v.lk, v.dout, *stats, v.d_state, v.d_va, chunk,
                    KEY_STATE, WEIGHTED_QUERY, True)
        return (
            lib.result(d_lq, (*batch_shape, length, m)),
            lib.result(d_lk, (*batch_shape, length, m)),
            lib.result(d_va, (*batch_shape, length, width)),
            lib.result(d_kv, (*batch_shape, m, width)),
        )


# --------------------------------------------------------------------------------------
# Entry points in the kernel contract.


def _torch_forward(*args: Any) -> tuple[Any, Any, Any]:
    return forward("torch", *args)


def _torch_backward(*args: Any) -> tuple[Any, Any, Any, Any]:
    return backward("torch", *args)


@functools.cache
def _torch_autograd() -> Callable[..., tuple[Any, Any, Any]]:
    from linattn_numba._torch import autograd_kernel

    return autograd_kernel(_torch_forward, _torch_backward)


def _torch_kernel(
    lq: Any, lk: Any, va: Any, kv: Any, mu: Any, chunk_size: int
) -> tuple[Any, Any, Any]:
    import torch

    wants_grad = torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in (lq, lk, va, kv)
    )
    if wants_grad:
        return _torch_autograd()(lq, lk, va, kv, mu, chunk_size)
    return forward("torch", lq, lk, va, kv, mu, chunk_size)


def causal_kernel(library: str) -> Callable[..., tuple[Any, Any, Any]]:
    """The contract's ``kernel(log_phi_q, log_phi_k, values_aug, kv, log_shift, chunk_size)``.

    ``library`` is ``"cupy"`` or ``"torch"`` (CUDA tensors; those that require
    grad go through ``linattn_numba._torch.autograd_kernel``), or ``"numpy"``
    (host arrays copied to the device and back: for the simulator and tests).
    """
    if library == "torch":
        return _torch_kernel
    if library in LIBRARIES:
        return functools.partial(forward, library)
    raise ValueError(f"library must be one of {sorted(LIBRARIES)}; got {library!r}")

