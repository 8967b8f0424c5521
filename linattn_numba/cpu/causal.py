"""The causal pass on the CPU: the chunked, stabilised causal scan, forward and backward.

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

The heads are shared among threads (:class:`linattn_numba._machinery.Variants`: one
compiled kernel, run serial for small work); the chunk products are
``np.dot`` calls on contiguous blocks (BLAS ``gemm`` from SciPy's OpenBLAS, pinned
to one thread while the kernel runs: measured 10x faster than letting BLAS threads
fight the kernel's threads), and the exponentials use a vectorisable ``exp``
(:func:`~linattn_numba.cpu.scalars.fast_exp`, within 2 ulp of the C library's, with exact
``0``, ``inf`` and ``nan``).  The per-chunk steps are the primitives of
:mod:`linattn_numba.cpu.chunks`.

Entry points: :func:`numpy_forward` / :func:`numpy_backward` (the kernel contract
of ``linattn_numba``).  :func:`linattn_numba.libraries.cpu_causal_kernel` serves them (or, for
torch CPU tensors, the custom operators of :mod:`linattn_numba.torch_ops`), and
:func:`linattn_numba.cpu.fused_causal.favor_causal` also computes the features and
normalises chunk by chunk, so that no ``L x m`` array exists (what long sequences need).

The backward pass treats every stabiliser (``mu``, ``F``, ``G``, ``R``) as a
constant.  This is exact for the normalised outputs ``O[:, :d_v] / O[:, d_v]`` (and
for any function of the state that is invariant to the shift, like later normalised
outputs), because numerator and denominator share every shift.  Chunk states are
recomputed forward, never rebuilt by subtraction (``docs/algorithm.md``, section 13): all of a
head's chunk states are kept when they fit in :data:`STORE_BYTES`, else ``sqrt(N)``
checkpoints are, and each segment is recomputed from its checkpoint.  Key features
are recomputed per chunk (mostly from ``psi``, see
:func:`linattn_numba.cpu.chunks.key_features`), not stored, and each worker thread
reuses one set of buffers for all its heads.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from linattn_numba import _contract, _machinery
from linattn_numba.cpu.arrays import (
    DTYPES,
    STORE_BYTES,
    chunk_length,
    contiguous,
    fresh,
    without_empty_rows,
)
from linattn_numba.cpu.chunks import (
    absorb,
    backward_workspace,
    chunk_backward,
    chunk_forward,
    chunk_workspace,
    running_max,
)
from linattn_numba.cpu.scalars import safe_shift

__all__ = ["numpy_backward", "numpy_forward"]

_jit = _machinery.jit


@_machinery.Variants
def _forward(lq, lk, va, kv, mu, chunk, out, log_scale):
    """All heads; ``log_scale`` is ``(batch, L)``, or ``(batch, 0)`` to skip it."""
    batch, length, m = lq.shape
    for b in range(batch):
        work, square, vecs, state_out, product = chunk_workspace(chunk, m, va.shape[2], lq.dtype)
        never = np.zeros(1, lq.dtype)[0]  # (no rescue: the backward shares the shifts)
        for t0 in range(0, length, chunk):
            t1 = min(t0 + chunk, length)
            chunk_forward(
                lq[b][t0:t1], lk[b][t0:t1], va[b][t0:t1], kv[b], mu[b], out[b][t0:t1],
                work, square, vecs, state_out, product, log_scale[b][t0:t1], never,
            )  # fmt: skip


@_jit()
def _head_backward(
    lq, lk, va, kv0, mu0, chunk, dout, dkv_out, dlq, dlk, dva, dkv, seg_kv, seg_mu, check_kv,
    check_mu, work,
):  # fmt: skip
    """One head: checkpoint states, then recompute each segment forward and scan back.

    ``seg_kv`` holds the states of one segment of chunks, ``check_kv`` those at segment
    starts (one segment, no checkpoints, when every chunk's state fits); ``work`` is
    :func:`backward_workspace`.
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
        safe_shift(mu, ms)
        c = t1 - t0
        absorb(
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
            safe_shift(seg_mu[i + 1], ms)
            absorb(
                lk[t0:t1], va[t0:t1], seg_kv[i + 1], seg_mu[i + 1], ms, phi[:chunk], top,
                shift, decay, product, phi, ms, False,
            )  # fmt: skip
        # mu after the segment's last chunk: its keys' running maximum (no state needed).
        last = n1 - 1 - n0
        t0, t1 = (n1 - 1) * chunk, min(n1 * chunk, length)
        running_max(lk[t0:t1], seg_mu[last], seg_mu[last + 1])
        for n in range(n1 - 1, n0 - 1, -1):
            t0, t1 = n * chunk, min(n * chunk + chunk, length)
            i = n - n0
            chunk_backward(
                lq[t0:t1], lk[t0:t1], va[t0:t1], dout[t0:t1], seg_kv[i], seg_mu[i],
                seg_mu[i + 1], ds, dlq[t0:t1], dlk[t0:t1], dva[t0:t1], rows, vecs, square,
                scaled, product,
            )  # fmt: skip


@_machinery.Variants.over(workers=("seg_kv", "seg_mu", "check_kv", "check_mu"))
def _backward(
    lq, lk, va, kv, mu, chunk, dout, dkv_out, dlq, dlk, dva, dkv, seg_kv, seg_mu, check_kv,
    check_mu,
):  # fmt: skip
    """Heads in turn on each worker ``t`` (its own ``seg_*``/``check_*`` buffers)."""
    batch, _, m = lq.shape
    workers = seg_kv.shape[0]
    for t in range(workers):
        work = backward_workspace(chunk, m, va.shape[2], lq.dtype)
        for b in range(t, batch, workers):
            _head_backward(
                lq[b], lk[b], va[b], kv[b], mu[b], chunk, dout[b], dkv_out[b], dlq[b], dlk[b],
                dva[b], dkv[b], seg_kv[t], seg_mu[t], check_kv[t], check_mu[t], work,
            )  # fmt: skip


def _check(arrays: dict[str, Any], chunk_size: object) -> tuple[_contract.Sizes, np.dtype]:
    """Validate kernel inputs (:mod:`linattn_numba._contract`); return sizes and dtype."""
    _contract.check_arrays(arrays, lambda x: isinstance(x, np.ndarray), "a numpy.ndarray")
    names = tuple(str(d) for d in DTYPES)
    dtype = np.dtype(_contract.check_dtypes(arrays, names, same=True))
    return _contract.check_shapes(arrays, chunk_size), dtype


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
    lq, lk = (contiguous(x, sizes.flat("features")) for x in (log_phi_q, log_phi_k))
    va = contiguous(values_aug, sizes.flat("values"))
    mu = fresh(log_shift, sizes.flat("shift"), dtype)
    state = without_empty_rows(fresh(kv, sizes.flat("state"), dtype), mu)
    out = np.empty(sizes.flat("values"), dtype)
    log_scale = np.empty((sizes.batch, sizes.length if return_log_scale else 0), dtype)
    variant = _machinery.choose_variant(sizes.batch, sizes.length, sizes.m * sizes.width)
    with _machinery.single_threaded_blas():
        chunk = chunk_length(sizes.chunk, sizes.length)
        _forward.run(variant, lq, lk, va, state, mu, chunk, out, log_scale)
    results = (
        out.reshape(sizes.shape("values")),
        state.reshape(sizes.shape("state")),
        mu.reshape(sizes.shape("shift")),
    )
    if return_log_scale:
        return (*results, log_scale.reshape((*sizes.batch_shape, sizes.length)))
    return results


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
    flat = [contiguous(x, features) for x in (log_phi_q, log_phi_k)]
    mu = contiguous(log_shift, sizes.flat("shift"))
    flat += [contiguous(values_aug, values), without_empty_rows(fresh(kv, state_shape, dtype), mu)]
    dout, dkv_out = contiguous(d_outputs_aug, values), contiguous(d_kv, state_shape)
    dlq, dlk = np.empty(features, dtype), np.empty(features, dtype)
    dva, dkv = np.empty(values, dtype), fresh(dkv_out, state_shape, dtype)
    if sizes.length:  # (no tokens: no chunks, and the state's gradient passes through)
        # Per worker thread: every chunk's state when they fit in STORE_BYTES, else a
        # segment of sqrt(N) of them plus the states at segment starts (recomputed, never
        # subtracted).
        chunk = chunk_length(sizes.chunk, sizes.length)
        variant = _machinery.choose_variant(sizes.batch, sizes.length, sizes.m * sizes.width)
        workers = min(sizes.batch, _machinery.threads()) if variant == "parallel" else 1
        n_chunks = -(-sizes.length // chunk)
        stored = n_chunks * m * width * dlq.itemsize
        per_segment = n_chunks if stored <= STORE_BYTES else math.ceil(math.sqrt(n_chunks))
        n_segments = -(-n_chunks // per_segment)
        seg_kv = np.empty((workers, per_segment, m, width), dtype)
        seg_mu = np.empty((workers, per_segment + 1, m), dtype)
        check_kv = np.empty((workers, n_segments, m, width), dtype)
        check_mu = np.empty((workers, n_segments, m), dtype)
        with _machinery.single_threaded_blas():
            _backward.run(
                variant, *flat, mu, chunk, dout, dkv_out, dlq, dlk, dva, dkv, seg_kv, seg_mu,
                check_kv, check_mu,
            )  # fmt: skip
    return (
        dlq.reshape(sizes.shape("features")),
        dlk.reshape(sizes.shape("features")),
        dva.reshape(sizes.shape("values")),
        without_empty_rows(dkv, mu).reshape(sizes.shape("state")),
    )
