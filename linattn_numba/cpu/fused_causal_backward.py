"""The backward of the fused causal FAVOR+ pass: no ``L x m`` array either.

The forward is :mod:`linattn_numba.cpu.fused_causal` (its ``forward`` checks every
argument and always returns the log-normaliser).  :func:`backward` gives the gradients of
the normalised outputs, the log-normaliser and the final state with respect to ``q``,
``k``, ``v`` and the incoming state, every stabiliser held constant (exact: the module
docstring of :mod:`linattn_numba.cpu.causal`).  It is ``numpy_backward``'s algorithm
(its ``_head_backward``: states checkpointed per segment and recomputed forward, never
rebuilt by subtraction, then a reverse scan of ``dS``) with the features recomputed chunk
by chunk from ``q`` and ``k``:

* per chunk, the forward's factors ``u``, ``psi``, ``phi`` and weights
  (``chunk_backward_factors``); from them the stabilised denominators ``D_t`` the
  forward divided by, and the cotangent of the unnormalised rows
  ``A_t = [g_t / D_t, (g^lse_t - g_t . o_t) / D_t]`` (0 where ``D_t = 0``: a row that sees
  no key);
* the chunk's log-feature gradients ``d l(q)``, ``d l(k)``, ``d [v | 1]`` and ``dS``
  before it (``chunk_backward_grads``);
* through the feature map (``features_vjp``):
  ``dx = (d_+ - d_-) P - s x sum_r d_r`` with ``P`` the projection times ``sqrt(s)``.

Masked keys get zero gradients; the incoming state's gradient is that of the state
``S`` it holds (``d log_shift = sum_e dS * S`` is the torch operator's business).
"""

from __future__ import annotations

import math

import numpy as np

from linattn_numba import _machinery
from linattn_numba.cpu.arrays import STORE_BYTES, readonly, without_empty_rows
from linattn_numba.cpu.calls import CausalFusedCall
from linattn_numba.cpu.chunks import (
    absorb,
    backward_workspace,
    chunk_backward_factors,
    chunk_backward_grads,
    running_max,
)
from linattn_numba.cpu.features import features_vjp, key_block, log_features
from linattn_numba.cpu.scalars import safe_shift

__all__ = ["backward"]

_jit = _machinery.jit


@_jit()
def _row_cotangents(u, kv, w, intra, va, out, grad, grad_lse, dout):
    """``dout = A`` for one chunk (``grad_lse`` empty: no log-normaliser cotangent).

    ``D_t = w_t u_t . S[:, d_v] + sum_{j <= t} intra_tj [v_j | 1]_{d_v}``: the forward's
    stabilised denominator, from the same factors.
    """
    c, m = u.shape
    dv = out.shape[1]
    with_lse = grad_lse.shape[0] == c
    for i in range(c):
        den = u[i, 0] * kv[0, dv]
        for r in range(1, m):
            den += u[i, r] * kv[r, dv]
        den *= w[i]
        for j in range(i + 1):
            den += intra[i, j] * va[j, dv]
        if den == 0:
            for e in range(dv + 1):
                dout[i, e] = 0
            continue
        paired = grad[i, 0] - grad[i, 0]
        for e in range(dv):
            dout[i, e] = grad[i, e] / den
            paired += grad[i, e] * out[i, e]
        if with_lse:
            paired -= grad_lse[i]
        dout[i, dv] = -paired / den


@_jit()
def _features_workspace(chunk, m, rows, hyperbolic, width, dtype):
    """Per worker: projection scratch, ``(lq, lk, dlq, dlk)`` and ``([v|1], A, d[v|1])``."""
    return (
        np.empty((chunk if hyperbolic else 0, rows), dtype),
        np.empty((4, chunk, m), dtype),
        np.empty((3, chunk, width), dtype),
    )


@_jit()
def _chunk_grads(
    q, k, v, mask, projection, consts, hyperbolic, kv, mu, out, grad, grad_lse, ds, dq, dk,
    dv, work, fwork,
):  # fmt: skip
    """One chunk of the reverse scan: its features, ``A``, gradients; ``ds`` to before it."""
    c = q.shape[0]
    m = mu.shape[0]
    rows, vecs, square, scaled, product = work
    proj, feats, blocks = fwork
    lq, lk, dlq, dlk = feats[0][:c], feats[1][:c], feats[2][:c], feats[3][:c]
    va, dout, dva = blocks[0][:c], blocks[1][:c], blocks[2][:c]
    top = vecs[6][:m]  # (unused by the chunk's factors)
    key_block(k, v, mask, projection, consts, hyperbolic, proj[:c], lk, va)
    log_features(q, projection, consts, hyperbolic, proj[:c], lq)
    running_max(lk, mu, top)  # mu after the chunk
    chunk_backward_factors(lq, lk, mu, top, rows, vecs, square)
    intra = square[1][: c * c].reshape(c, c)
    _row_cotangents(rows[0][:c], kv, vecs[5][:c], intra, va, out, grad, grad_lse, dout)
    chunk_backward_grads(va, dout, kv, ds, dlq, dlk, dva, rows, vecs, square, scaled, product)
    features_vjp(q, dlq, projection, consts, hyperbolic, proj[:c], dq)
    features_vjp(k, dlk, projection, consts, hyperbolic, proj[:c], dk)
    width = dv.shape[1]
    for j in range(c):
        if mask[j]:
            for e in range(width):
                dv[j, e] = dva[j, e]
        else:
            for e in range(width):
                dv[j, e] = 0
            for e in range(dk.shape[1]):
                dk[j, e] = 0


@_jit()
def _absorb_chunk(k, v, mask, projection, consts, hyperbolic, kv, mu, work, fwork):
    """``(kv, mu)`` absorb one chunk of keys, their features recomputed."""
    c = k.shape[0]
    m = mu.shape[0]
    rows, vecs, _, _, product = work
    proj, feats, blocks = fwork
    lk, va = feats[1][:c], blocks[0][:c]
    ms, shift, decay, top = vecs[0][:m], vecs[1][:m], vecs[2][:m], vecs[6][:m]
    phi = rows[4]
    key_block(k, v, mask, projection, consts, hyperbolic, proj[:c], lk, va)
    safe_shift(mu, ms)
    absorb(lk, va, kv, mu, ms, phi[:c], top, shift, decay, product, phi, ms, False)


@_jit()
def _head_backward(
    q, k, v, mask, projection, consts, hyperbolic, kv0, mu0, chunk, out, grad, grad_lse,
    dkv_out, dq, dk, dv, dkv, seg_kv, seg_mu, check_kv, check_mu, work, fwork,
):  # fmt: skip
    """One head: ``_head_backward`` with features recomputed per chunk."""
    length = q.shape[0]
    n_chunks = (length + chunk - 1) // chunk
    per_segment = seg_kv.shape[0]
    n_segments = (n_chunks + per_segment - 1) // per_segment
    operands = (projection, consts, hyperbolic)
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
        _absorb_chunk(k[t0:t1], v[t0:t1], mask[t0:t1], *operands, kv, mu, work, fwork)
    # Pass 2: segments last to first; recompute their states, then reverse-scan dS.
    ds = dkv
    ds[:] = dkv_out
    with_lse = grad_lse.shape[0] == length
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
            _absorb_chunk(k[t0:t1], v[t0:t1], mask[t0:t1], *operands, seg_kv[i + 1],
                          seg_mu[i + 1], work, fwork)  # fmt: skip
        for n in range(n1 - 1, n0 - 1, -1):
            t0, t1 = n * chunk, min(n * chunk + chunk, length)
            i = n - n0
            lse = grad_lse[t0:t1] if with_lse else grad_lse[0:0]
            _chunk_grads(
                q[t0:t1], k[t0:t1], v[t0:t1], mask[t0:t1], *operands, seg_kv[i], seg_mu[i],
                out[t0:t1], grad[t0:t1], lse, ds, dq[t0:t1], dk[t0:t1], dv[t0:t1], work, fwork,
            )  # fmt: skip


@_machinery.Variants.over(
    shared=("projection", "consts"), workers=("seg_kv", "seg_mu", "check_kv", "check_mu")
)
def _backward(
    q, k, v, mask, projection, consts, hyperbolic, kv, mu, chunk, out, grad, grad_lse,
    dkv_out, dq, dk, dv, dkv, seg_kv, seg_mu, check_kv, check_mu,
):  # fmt: skip
    """Heads in turn on each worker ``t`` (its own ``seg_*``/``check_*`` buffers)."""
    batch, _, _ = q.shape
    m, width = kv.shape[1], kv.shape[2]
    workers = seg_kv.shape[0]
    for t in range(workers):
        work = backward_workspace(chunk, m, width, q.dtype)
        fwork = _features_workspace(chunk, m, projection.shape[0], hyperbolic, width, q.dtype)
        for b in range(t, batch, workers):
            _head_backward(
                q[b], k[b], v[b], mask[b], projection, consts, hyperbolic, kv[b], mu[b], chunk,
                out[b], grad[b], grad_lse[b], dkv_out[b], dq[b], dk[b], dv[b], dkv[b],
                seg_kv[t], seg_mu[t], check_kv[t], check_mu[t], work, fwork,
            )  # fmt: skip


def backward(
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
    chunk_size: int = 64,
    grad_log_normaliser: np.ndarray | None = None,
    grad_kv: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Gradients ``(dq, dk, dv, d_kv)`` of :func:`linattn_numba.cpu.fused_causal.forward`,
    stabilisers held constant.

    For cotangents ``grad_output`` of the normalised outputs, ``grad_log_normaliser`` of
    the log-normaliser and ``grad_kv`` of the final state (``None``: zero), given the
    forward's incoming state ``(kv, log_shift)`` and its ``outputs``.  ``d_kv`` is the
    gradient of the incoming state's ``kv`` (0 in rows whose ``log_shift`` is ``-inf``).
    Gradients have the broadcast batch shape, in the compute dtype (sum over broadcast
    axes yourself); masked keys get zeros.  Features are recomputed chunk by chunk: no
    ``L x m`` array.

    Examples
    --------
    >>> import numpy as np
    >>> from linattn_numba.cpu.fused_causal import forward
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.normal(size=(1, 5, 2)) for _ in range(3))
    >>> w, g = rng.normal(size=(3, 2)), rng.normal(size=(1, 5, 2))
    >>> state = np.zeros((1, 3, 3)), np.full((1, 3), -np.inf)
    >>> options = dict(hyperbolic=False, scale=0.5, chunk_size=2)
    >>> out, *_ = forward(q, k, v, w, *state, **options)
    >>> dq, dk, dv, _ = backward(q, k, v, w, *state, out, g, **options)
    >>> q2 = q.copy(); q2[0, 3, 1] += 1e-6
    >>> out2, *_ = forward(q2, k, v, w, *state, **options)
    >>> bool(abs((g * (out2 - out)).sum() / 1e-6 - dq[0, 3, 1]) < 1e-5)
    True
    """
    call = CausalFusedCall(
        q, k, v, projection, hyperbolic, scale, key_mask, kv, log_shift, chunk_size
    )
    m, width = call.m, call.dv + 1
    out = call.check("outputs", outputs, (call.length, call.dv))
    grad = call.check("grad_output", grad_output, (call.length, call.dv))
    if grad_log_normaliser is None:
        grad_lse = readonly(np.empty((call.n, 0), call.dtype))
    else:
        grad_lse = call.check("grad_log_normaliser", grad_log_normaliser, (call.length,))
    if grad_kv is None:
        dkv_out = readonly(np.zeros((call.n, m, width), call.dtype))
    else:
        dkv_out = call.check("grad_kv", grad_kv, (m, width))
    dq, dk, dv = (np.empty(x.shape, call.dtype) for x in (call.q, call.k, call.v))
    dkv = np.array(dkv_out, dtype=call.dtype, order="C", copy=True)
    if call.length:  # (no tokens: the state's gradient passes through)
        workers = min(call.n, _machinery.threads()) if call.variant == "parallel" else 1
        n_chunks = -(-call.length // call.chunk)
        stored = n_chunks * m * width * dq.itemsize
        per_segment = n_chunks if stored <= STORE_BYTES else math.ceil(math.sqrt(n_chunks))
        n_segments = -(-n_chunks // per_segment)
        seg_kv = np.empty((workers, per_segment, m, width), call.dtype)
        seg_mu = np.empty((workers, per_segment + 1, m), call.dtype)
        check_kv = np.empty((workers, n_segments, m, width), call.dtype)
        check_mu = np.empty((workers, n_segments, m), call.dtype)
        with _machinery.single_threaded_blas():
            _backward.run(
                call.variant, *call.operands(), call.kv, call.mu, call.chunk, out, grad,
                grad_lse, dkv_out, dq, dk, dv, dkv, seg_kv, seg_mu, check_kv, check_mu,
            )  # fmt: skip
    dkv = without_empty_rows(dkv, call.mu)
    results = call.shaped_results(dq, dk, dv, dkv)
    return results[0], results[1], results[2], results[3]
