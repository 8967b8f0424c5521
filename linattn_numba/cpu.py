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

Each batch x head runs on its own thread (``prange``); the chunk products are
``np.dot`` calls on contiguous blocks (BLAS ``gemm``, pinned to one thread while the
kernel runs), and the exponentials use a vectorisable ``exp`` (:func:`fast_exp`,
within 2 ulp of the C library's, exact ``0``, ``inf`` and ``nan`` behaviour).

The backward pass treats every stabiliser (``mu``, ``F``, ``G``, ``R``) as a
constant.  This is exact for the normalised outputs ``O[:, :d_v] / O[:, d_v]`` (and
for any function of the state that is invariant to the shift, like later normalised
outputs), because numerator and denominator share every shift.  Chunk states are
recomputed forward from ``sqrt(N)`` checkpoints, never rebuilt by subtraction
(``MATH.md`` section 5), so memory stays ``O(sqrt(L / C) m d_v)`` per head.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

__all__ = ["causal_backward_kernel", "causal_kernel", "fast_exp", "status"]

# "contract" only lets LLVM fuse multiply-adds; no flag that assumes finite values.
_SERIAL = {"cache": True, "nogil": True, "fastmath": {"contract"}, "error_model": "numpy"}
_PARALLEL = {**_SERIAL, "parallel": True}

DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


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


def _exp32(x):  # type: ignore[no-untyped-def]
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
    y = p * _pow2(half) * _pow2(n - half)
    return y if x == x else x


def _exp64(x):  # type: ignore[no-untyped-def]
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
    y = p * _pow2(half) * _pow2(n - half)
    return y if x == x else x


def fast_exp(x):  # type: ignore[no-untyped-def]
    """``exp(x)`` for float32/float64 scalars inside ``@njit`` code (vectorises in loops)."""
    return math.exp(x)


@overload(fast_exp)
def _fast_exp_overload(x):  # type: ignore[no-untyped-def]
    if x == types.float32:
        return _exp32
    if x == types.float64:
        return _exp64
    return None


# -- one chunk ------------------------------------------------------------------------


@njit(**_SERIAL)
def _safe_shift(mu, ms):  # type: ignore[no-untyped-def]
    """``ms = mu`` where finite, else 0; returns whether the state holds any key."""
    has_state = False
    for r in range(mu.shape[0]):
        if np.isfinite(mu[r]):
            ms[r] = mu[r]
            has_state = True
        else:
            ms[r] = 0
    return has_state


@njit(**_SERIAL)
def _chunk_shifts(lq, lk, ms, has_state, u, psi, g, run, w, weights):  # type: ignore[no-untyped-def]
    """Queries ``u``, keys ``psi``, ``G``, running ``R``, state weights ``w`` and the
    masked intra-chunk weights ``exp(G_j - R_t)`` (lower triangle) of one chunk."""
    c, m = lq.shape
    zero = ms[0] - ms[0]
    for i in range(c):
        f = lq[i, 0] + ms[0]
        for r in range(1, m):
            x = lq[i, r] + ms[r]
            if x > f:
                f = x
        if not np.isfinite(f):
            f = zero
        for r in range(m):
            u[i, r] = fast_exp(lq[i, r] + ms[r] - f)
    for j in range(c):
        gj = lk[j, 0] - ms[0]
        for r in range(1, m):
            x = lk[j, r] - ms[r]
            if x > gj:
                gj = x
        g[j] = gj
        if not np.isfinite(gj):
            gj = zero
        for r in range(m):
            psi[j, r] = fast_exp(lk[j, r] - ms[r] - gj)
    best = zero if has_state else -np.inf
    floor = best
    for i in range(c):
        if g[i] > best:
            best = g[i]
        run[i] = best if np.isfinite(best) else zero
        w[i] = fast_exp(floor - run[i]) if has_state else zero
    for i in range(c):
        for j in range(i + 1):
            weights[i, j] = fast_exp(g[j] - run[i])
        for j in range(i + 1, c):
            weights[i, j] = zero


@njit(**_SERIAL)
def _absorb(lk, va, kv, mu, ms, phi, shift, decay, product):  # type: ignore[no-untyped-def]
    """``(S, mu) <- (exp(ms - mu') S + exp(l(K) - mu')^T [V|1], mu')``; leaves ``phi``."""
    c, m = lk.shape
    zero = ms[0] - ms[0]
    for r in range(m):
        shift[r] = mu[r]
    for j in range(c):
        for r in range(m):
            if lk[j, r] > shift[r]:
                shift[r] = lk[j, r]
    for r in range(m):
        top = shift[r]
        safe = top if np.isfinite(top) else zero
        decay[r] = fast_exp(ms[r] - safe) if np.isfinite(mu[r]) else zero
        mu[r] = top
        shift[r] = safe
    for j in range(c):
        for r in range(m):
            phi[j, r] = fast_exp(lk[j, r] - shift[r])
    np.dot(phi.T, va, product)
    for r in range(m):
        for e in range(kv.shape[1]):
            kv[r, e] = decay[r] * kv[r, e] + product[r, e]


@njit(**_SERIAL)
def _head_forward(lq, lk, va, kv, mu, chunk, out, buffers, small):  # type: ignore[no-untyped-def]
    """One head: outputs into ``out``; ``kv`` and ``mu`` are advanced in place."""
    length, m = lq.shape
    d = va.shape[1]
    u, psi, phi = buffers[0], buffers[1], buffers[2]
    ms, shift, decay = small[0], small[1], small[2]
    g = np.empty(chunk, lq.dtype)
    run = np.empty(chunk, lq.dtype)
    w = np.empty(chunk, lq.dtype)
    weight_buf = np.empty(chunk * chunk, lq.dtype)
    intra_buf = np.empty(chunk * chunk, lq.dtype)
    state_out = np.empty((chunk, d), lq.dtype)
    product = np.empty((m, d), lq.dtype)
    for t0 in range(0, length, chunk):
        t1 = min(t0 + chunk, length)
        c = t1 - t0
        weights = weight_buf[: c * c].reshape(c, c)
        intra = intra_buf[: c * c].reshape(c, c)
        has_state = _safe_shift(mu, ms)
        _chunk_shifts(
            lq[t0:t1], lk[t0:t1], ms, has_state, u[:c], psi[:c], g, run, w, weights
        )
        np.dot(u[:c], psi[:c].T, intra)
        for i in range(c):
            for j in range(c):
                intra[i, j] *= weights[i, j]
        np.dot(u[:c], kv, state_out[:c])
        block = out[t0:t1]
        np.dot(intra, va[t0:t1], block)
        for i in range(c):
            for e in range(d):
                block[i, e] += w[i] * state_out[i, e]
        _absorb(lk[t0:t1], va[t0:t1], kv, mu, ms, phi[:c], shift, decay, product)


@njit(**_PARALLEL)
def _forward(lq, lk, va, kv, mu, chunk, out):  # type: ignore[no-untyped-def]
    batch, _, m = lq.shape
    for b in prange(batch):
        buffers = np.empty((3, chunk, m), lq.dtype)
        small = np.empty((3, m), lq.dtype)
        _head_forward(lq[b], lk[b], va[b], kv[b], mu[b], chunk, out[b], buffers, small)


# -- backward -------------------------------------------------------------------------


@njit(**_SERIAL)
def _chunk_backward(  # type: ignore[no-untyped-def]
    lq, lk, va, dout, kv, mu, mu_next, phi, ds, dlq, dlk, dva, rows, vecs, square, scaled, product
):
    """Gradients of one chunk given the state before it and ``dS`` after it; updates ``ds``."""
    c, m = lq.shape
    d = va.shape[1]
    u, psi, du, dpsi = rows[0][:c], rows[1][:c], rows[2][:c], rows[3][:c]
    ms, decay = vecs[0], vecs[1]
    g, run, w = vecs[2][:c], vecs[3][:c], vecs[4][:c]
    weights = square[0][: c * c].reshape(c, c)
    intra = square[1][: c * c].reshape(c, c)
    paired = square[2][: c * c].reshape(c, c)
    scaled = scaled[:c]
    zero = ms[0] - ms[0]
    has_state = _safe_shift(mu, ms)
    _chunk_shifts(lq, lk, ms, has_state, u, psi, g, run, w, weights)
    np.dot(u, psi.T, intra)
    np.dot(dout, va.T, paired)
    for i in range(c):
        for j in range(c):
            intra[i, j] *= weights[i, j]
            paired[i, j] *= weights[i, j]
    # d l(q) = u * (w dO S^T + P psi), P = (dO [V|1]^T) * weights
    np.dot(dout, kv.T, du)
    np.dot(paired, psi, dpsi)
    for i in range(c):
        for r in range(m):
            dlq[i, r] = u[i, r] * (w[i] * du[i, r] + dpsi[i, r])
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
        for e in range(d):
            scaled[i, e] = w[i] * dout[i, e]
    np.dot(u.T, scaled, product)
    for r in range(m):
        shift = mu_next[r] if np.isfinite(mu_next[r]) else zero
        decay[r] = fast_exp(ms[r] - shift) if np.isfinite(mu[r]) else zero
        for e in range(d):
            ds[r, e] = decay[r] * ds[r, e] + product[r, e]


@njit(**_SERIAL)
def _head_backward(  # type: ignore[no-untyped-def]
    lq, lk, va, kv0, mu0, chunk, dout, dkv_out, dlq, dlk, dva, dkv
):
    """One head: checkpoint states, then recompute each segment forward and scan back."""
    length, m = lq.shape
    d = va.shape[1]
    dtype = lq.dtype
    n_chunks = (length + chunk - 1) // chunk
    per_segment = max(1, int(math.ceil(math.sqrt(n_chunks))))
    n_segments = (n_chunks + per_segment - 1) // per_segment
    check_kv = np.empty((n_segments, m, d), dtype)
    check_mu = np.empty((n_segments, m), dtype)
    seg_kv = np.empty((per_segment, m, d), dtype)
    seg_mu = np.empty((per_segment + 1, m), dtype)
    seg_phi = np.empty((per_segment, chunk, m), dtype)
    rows = np.empty((4, chunk, m), dtype)
    vecs = np.empty((5, max(m, chunk)), dtype)
    state_vecs = np.empty((3, m), dtype)
    square = np.empty((3, chunk * chunk), dtype)
    scaled = np.empty((chunk, d), dtype)
    product = np.empty((m, d), dtype)
    ms, shift, decay = state_vecs[0], state_vecs[1], state_vecs[2]
    kv = kv0.copy()
    mu = mu0.copy()
    # Pass 1: states at segment starts (checkpoints).
    for n in range(n_chunks):
        if n % per_segment == 0:
            check_kv[n // per_segment] = kv
            check_mu[n // per_segment] = mu
        t0, t1 = n * chunk, min(n * chunk + chunk, length)
        _safe_shift(mu, ms)
        _absorb(lk[t0:t1], va[t0:t1], kv, mu, ms, seg_phi[0][: t1 - t0], shift, decay, product)
    # Pass 2: segments last to first; recompute their states, then reverse-scan dS.
    ds = dkv_out.copy()
    for s in range(n_segments - 1, -1, -1):
        n0 = s * per_segment
        n1 = min(n_chunks, n0 + per_segment)
        kv[:] = check_kv[s]
        mu[:] = check_mu[s]
        for n in range(n0, n1):
            t0, t1 = n * chunk, min(n * chunk + chunk, length)
            seg_kv[n - n0] = kv
            seg_mu[n - n0] = mu
            _safe_shift(mu, ms)
            _absorb(
                lk[t0:t1], va[t0:t1], kv, mu, ms, seg_phi[n - n0][: t1 - t0], shift, decay,
                product,
            )
        seg_mu[n1 - n0] = mu
        for n in range(n1 - 1, n0 - 1, -1):
            t0, t1 = n * chunk, min(n * chunk + chunk, length)
            i = n - n0
            _chunk_backward(
                lq[t0:t1], lk[t0:t1], va[t0:t1], dout[t0:t1], seg_kv[i], seg_mu[i],
                seg_mu[i + 1], seg_phi[i][: t1 - t0], ds, dlq[t0:t1], dlk[t0:t1],
                dva[t0:t1], rows, vecs, square, scaled, product,
            )
    dkv[:] = ds


@njit(**_PARALLEL)
def _backward(lq, lk, va, kv, mu, chunk, dout, dkv_out, dlq, dlk, dva, dkv):  # type: ignore[no-untyped-def]
    for b in prange(lq.shape[0]):
        _head_backward(lq[b], lk[b], va[b], kv[b], mu[b], chunk, dout[b], dkv_out[b],
                       dlq[b], dlk[b], dva[b], dkv[b])


# -- NumPy entry points (checked before any compiled code runs) -----------------------


def _check(
    arrays: dict[str, Any], chunk_size: object
) -> tuple[tuple[int, ...], int, int, int, np.dtype]:
    """Validate kernel inputs; return batch shape, L, m, d_v + 1 and dtype."""
    for name, x in arrays.items():
        if not isinstance(x, np.ndarray):
            raise TypeError(f"{name} must be a numpy.ndarray; got {type(x).__name__}")
    dtype = arrays["log_phi_q"].dtype
    for name, x in arrays.items():
        if x.dtype != dtype or dtype not in DTYPES:
            raise TypeError(
                f"{name} must have dtype float32 or float64, the same as log_phi_q "
                f"({dtype}); got {x.dtype}"
            )
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int | np.integer) or (
        chunk_size < 1
    ):
        raise ValueError(f"chunk_size must be a positive integer; got {chunk_size!r}")
    lq = arrays["log_phi_q"]
    if lq.ndim < 2 or 0 in lq.shape[-2:]:
        raise ValueError(
            f"log_phi_q must have shape (..., L, m) with L, m >= 1; got {lq.shape}"
        )
    *batch, length, m = lq.shape
    va = arrays["values_aug"]
    width = va.shape[-1] if va.ndim >= 2 else 0
    expected = {
        "log_phi_k": (*batch, length, m),
        "values_aug": (*batch, length, width),
        "kv": (*batch, m, width),
        "log_shift": (*batch, m),
        "d_outputs_aug": (*batch, length, width),
        "d_kv": (*batch, m, width),
    }
    if width < 1:
        raise ValueError(f"values_aug must have shape (..., L, d_v + 1); got {va.shape}")
    for name, shape in expected.items():
        if name in arrays and arrays[name].shape != shape:
            raise ValueError(
                f"{name} must have shape {shape} to match log_phi_q {lq.shape} and "
                f"values_aug {va.shape}; got {arrays[name].shape}"
            )
    return tuple(batch), length, m, width, dtype


def _flat(x: np.ndarray, tail: int) -> np.ndarray:
    """A C-contiguous ``(batch, *last tail dims)`` copy or view of ``x``."""
    return np.ascontiguousarray(x).reshape((-1, *x.shape[x.ndim - tail :]))


def numpy_forward(
    log_phi_q: np.ndarray,
    log_phi_k: np.ndarray,
    values_aug: np.ndarray,
    kv: np.ndarray,
    log_shift: np.ndarray,
    chunk_size: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The causal kernel on NumPy arrays: ``(outputs_aug, kv_out, log_shift_out)``.

    Examples
    --------
    >>> import numpy as np
    >>> lq = np.zeros((1, 3, 2)); va = np.ones((1, 3, 2))
    >>> out, kv, mu = numpy_forward(lq, lq, va, np.zeros((1, 2, 2)), np.full((1, 2), -np.inf), 2)
    >>> out[0, :, -1]
    array([1., 2., 3.])
    """
    arrays = {
        "log_phi_q": log_phi_q,
        "log_phi_k": log_phi_k,
        "values_aug": values_aug,
        "kv": kv,
        "log_shift": log_shift,
    }
    batch, length, m, width, dtype = _check(arrays, chunk_size)
    chunk = int(min(chunk_size, length))
    lq, lk, va = _flat(log_phi_q, 2), _flat(log_phi_k, 2), _flat(values_aug, 2)
    state = np.array(kv, dtype=dtype, order="C", copy=True).reshape(-1, m, width)
    mu = np.array(log_shift, dtype=dtype, order="C", copy=True).reshape(-1, m)
    out = np.empty((lq.shape[0], length, width), dtype)
    with _single_threaded_blas():
        _forward(lq, lk, va, state, mu, chunk, out)
    return (
        out.reshape((*batch, length, width)),
        state.reshape((*batch, m, width)),
        mu.reshape((*batch, m)),
    )


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
    ``d_outputs_aug`` of the outputs and ``d_kv`` of the final state.
    """
    arrays = {
        "log_phi_q": log_phi_q,
        "log_phi_k": log_phi_k,
        "values_aug": values_aug,
        "kv": kv,
        "log_shift": log_shift,
        "d_outputs_aug": d_outputs_aug,
        "d_kv": d_kv,
    }
    batch, length, m, width, dtype = _check(arrays, chunk_size)
    chunk = int(min(chunk_size, length))
    flat = [_flat(a, 2) for a in (log_phi_q, log_phi_k, values_aug, kv)]
    mu = _flat(log_shift, 1)
    dout, dkv_out = _flat(d_outputs_aug, 2), _flat(d_kv, 2)
    dlq, dlk = np.empty_like(flat[0]), np.empty_like(flat[1])
    dva, dkv = np.empty_like(flat[2]), np.empty_like(flat[3])
    with _single_threaded_blas():
        _backward(*flat, mu, chunk, dout, dkv_out, dlq, dlk, dva, dkv)
    return (
        dlq.reshape((*batch, length, m)),
        dlk.reshape((*batch, length, m)),
        dva.reshape((*batch, length, width)),
        dkv.reshape((*batch, m, width)),
    )


@contextmanager
def _single_threaded_blas() -> Iterator[None]:
    """BLAS runs single-threaded inside the kernels (they parallelise over heads)."""
    controller = _blas_controller()
    if controller is None:
        yield
        return
    with controller.limit(limits=1, user_api="blas"):
        yield


_CONTROLLER: list[Any] = []


def _blas_controller() -> Any:
    if not _CONTROLLER:
        try:
            # Numba's np.dot calls the BLAS that SciPy ships: load it before looking.
            import scipy.linalg.cython_blas  # noqa: F401
            from threadpoolctl import ThreadpoolController

            _CONTROLLER.append(ThreadpoolController())
        except ImportError:
            _CONTROLLER.append(None)
    return _CONTROLLER[0]


# -- torch ----------------------------------------------------------------------------


def _torch_forward(lq: Any, lk: Any, va: Any, kv: Any, mu: Any, chunk_size: int) -> Any:
    import torch

    arrays = [x.detach().numpy() for x in (lq, lk, va, kv, mu)]
    return tuple(torch.from_numpy(r) for r in numpy_forward(*arrays, chunk_size))


def _torch_backward(
    lq: Any, lk: Any, va: Any, kv: Any, mu: Any, chunk_size: int, d_out: Any, d_kv: Any
) -> Any:
    import torch

    arrays = [x.detach().numpy() for x in (lq, lk, va, kv, mu)]
    grads = numpy_backward(*arrays, chunk_size, d_out.detach().numpy(), d_kv.detach().numpy())
    return tuple(torch.from_numpy(g) for g in grads)


_TORCH_KERNEL: list[Callable[..., Any]] = []


def _torch_kernel(lq: Any, lk: Any, va: Any, kv: Any, mu: Any, chunk_size: int) -> Any:
    import torch

    tensors = (lq, lk, va, kv, mu)
    for name, x in zip(("log_phi_q", "log_phi_k", "values_aug", "kv", "log_shift"), tensors):
        if not isinstance(x, torch.Tensor) or x.device.type != "cpu":
            raise TypeError(f"{name} must be a torch CPU tensor; got {_describe(x)}")
    if torch.is_grad_enabled() and any(x.requires_grad for x in tensors):
        if not _TORCH_KERNEL:
            from linattn_numba._torch import autograd_kernel

            _TORCH_KERNEL.append(autograd_kernel(_torch_forward, _torch_backward))
        return _TORCH_KERNEL[0](lq, lk, va, kv, mu, chunk_size)
    return _torch_forward(lq, lk, va, kv, mu, chunk_size)


def _describe(x: Any) -> str:
    device = getattr(x, "device", None)
    return f"{type(x).__module__}.{type(x).__name__}" + (f" on {device}" if device else "")


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
