"""Numba CPU kernel for decoding: a few new tokens against a causal state, features inside.

The same algorithm and stabilisers as :func:`linattn_numba.cpu.favor_causal` (the
helpers are its own: ``_log_features``, ``_chunk_shifts``, ``_running_max``,
``_shift_between``, ``_key_features``, ``_chunk_forward``), for the step a decoder
takes once per generated token, where the fixed costs of the fused pass dominate:

* the state comes in read-only and goes out in new arrays (a
  :class:`linattn.LinearAttentionState` is immutable, so the fused pass copies it and
  then updates the copy: three passes over ``S``); for ``L = 1`` the chunk's products
  are the same (``u S`` by BLAS, then the key's own term), and one pass over ``S``
  writes the new state ``S' = exp(ms - mu') S + phi^T [v | 1]``, which is
  :func:`linattn.state.absorb_keys` with the stabilisers of ``linattn.causal``;
* ``L > 1`` runs the fused pass's chunk (:func:`linattn_numba.cpu.chunks.chunk_forward`) on
  a copy of the state, in chunks of ``chunk_size``;
* either way the outputs and the state equal the fused pass's bit for bit;
* no workspace of ``FEATURE_BLOCK`` tokens, and BLAS is left as it is on the serial
  path (:func:`decode_step` pins it only where Numba's threads run).

A state's rows whose shift is ``-inf`` have seen no key: they are read as zeros,
whatever they store (as the other kernels do).

Examples
--------
>>> import numpy as np
>>> x = np.zeros((1, 1, 2)); w = np.eye(2); v = np.ones((1, 1, 2))
>>> kv, mu = np.zeros((1, 2, 3)), np.full((1, 2), -np.inf)
>>> out, kv, mu = decode_step(x, x, v, None, w, hyperbolic=False, scale=1.0, kv=kv,
...     log_shift=mu, chunk_size=64)
>>> out[0].tolist(), kv[0, :, -1].round(3).tolist()
([[1.0, 1.0]], [1.0, 1.0])
"""

from __future__ import annotations

import math

import numpy as np

from linattn_numba import _machinery
from linattn_numba.cpu.arrays import contiguous
from linattn_numba.cpu.calls import fitted_operands
from linattn_numba.cpu.chunks import (
    chunk_forward,
    chunk_shifts,
    chunk_workspace,
    key_features,
    mask_later_keys,
    running_max,
    shift_between,
)
from linattn_numba.cpu.features import block_log_features, feature_scratch
from linattn_numba.cpu.scalars import safe_shift, typed

__all__ = ["decode_step"]

_jit = _machinery.jit


@_jit()
def _copy_state(kv, mu, kv_out, mu_out):
    """The fused pass's copy of a state: rows whose shift is ``-inf`` become zeros."""
    for r in range(kv.shape[0]):
        mu_out[r] = mu[r]
        empty = mu[r] == -np.inf
        for e in range(kv.shape[1]):
            kv_out[r, e] = 0 if empty else kv[r, e]


@_jit()
def _one_token(lq, lk, va, kv, mu, kv_out, mu_out, block, vecs, rows, square, state_out):
    """The unnormalised output of one token into ``block``; ``(kv_out, mu_out)`` the
    state after it, from ``(kv, mu)`` before (neither changed)."""
    m = lq.shape[1]
    ms, shift, decay, top = vecs[0][:m], vecs[1][:m], vecs[2][:m], vecs[6][:m]
    g, run, w, fq = vecs[3][:1], vecs[4][:1], vecs[5][:1], vecs[7][:1]
    u, psi, phi = rows[0][:1], rows[1][:1], rows[2][:1]
    weights, intra = square[:1].reshape(1, 1), square[1:2].reshape(1, 1)
    has_state = safe_shift(mu, ms)
    chunk_shifts(lq, lk, ms, has_state, u, psi, g, run, w, weights, fq)
    running_max(lk, mu, top)
    full = shift_between(mu, top, ms, shift, decay)
    key_features(lk, shift, decay, psi, g, full, phi)
    # The key's weight against itself (the chunk pass's masked diagonal), as it does.
    np.dot(u, psi.T, intra)
    mask_later_keys(intra, weights)
    if not full:  # empty rows hold nothing: read a copy with zeros there, update it
        _copy_state(kv, mu, kv_out, mu_out)
        kv = kv_out
    _readout_then_update(u, intra, phi[0], va, kv, decay, w[0], block, state_out, kv_out)
    mu_out[:] = top


@_jit()
def _readout_then_update(u, intra, phi, va, kv, decay, weight_state, block, state_out, kv_out):
    """``block = intra [v|1] + w u S`` in the chunk pass's own products (so that the
    output is its, bit for bit), then one pass writes ``S' = decay S + phi^T [v|1]``
    (``kv_out`` may be ``kv``).  ``u S`` by BLAS and then the pass measured 30 % faster
    than accumulating ``u S`` in the pass."""
    m, width = kv.shape
    np.dot(u, kv, state_out)
    np.dot(intra, va, block)
    for e in range(width):
        block[0, e] += weight_state * state_out[0, e]
    row = va[0]
    for r in range(m):
        p, dr = phi[r], decay[r]
        for e in range(width):
            kv_out[r, e] = dr * kv[r, e] + p * row[e]


@_machinery.Variants.over(shared=("projection", "consts"))
def _decode(
    q, k, v, mask, projection, consts, hyperbolic, fitted_weights, fitted_biases, kv, mu, chunk,
    kv_out, mu_out, out,
):  # fmt: skip
    """Heads ``b`` of ``L`` new tokens each: features, attention, normalisation, state.
    Where ``fitted_weights`` has columns, a fitted map's features, from
    ``fitted_weights[b, 0 | 1]`` and ``fitted_biases[b, 0 | 1]`` (queries, keys), as the
    fused pass computes them; else ``projection``'s."""
    batch, length, _ = q.shape
    dv = v.shape[2]
    m = kv.shape[1]
    dtype = q.dtype
    zero = typed(0.0, consts[0])
    for b in range(batch):
        lq = np.empty((length, m), dtype)
        lk = np.empty((length, m), dtype)
        va = np.empty((length, dv + 1), dtype)
        block = np.empty((length, dv + 1), dtype)
        fw, fb = fitted_weights[b], fitted_biases[b]
        proj = feature_scratch(length, projection, hyperbolic, fw[0], q)
        block_log_features(q[b], projection, consts, hyperbolic, fw[0], fb[0], zero, proj, lq)
        block_log_features(k[b], projection, consts, hyperbolic, fw[1], fb[1], zero, proj, lk)
        for i in range(length):
            for e in range(dv):
                va[i, e] = v[b, i, e]
            va[i, dv] = 1
            if not mask[b, i]:  # a masked key: no features, no (padding) values
                for r in range(m):
                    lk[i, r] = -np.inf
                for e in range(dv):
                    va[i, e] = 0
        if length == 1:
            vecs = np.empty((8, m), dtype)
            work = np.empty((3, 1, m), dtype)
            square = np.empty(2, dtype)
            state_out = np.empty((1, dv + 1), dtype)
            _one_token(
                lq, lk, va, kv[b], mu[b], kv_out[b], mu_out[b], block, vecs, work, square,
                state_out,
            )  # fmt: skip
        else:
            _copy_state(kv[b], mu[b], kv_out[b], mu_out[b])
            size = min(chunk, length)
            work, square, vecs, state_out, product = chunk_workspace(size, m, dv + 1, dtype)
            no_scale = np.empty(0, dtype)  # no log-scale wanted
            for t0 in range(0, length, size):
                t1 = min(t0 + size, length)
                chunk_forward(
                    lq[t0:t1], lk[t0:t1], va[t0:t1], kv_out[b], mu_out[b], block[t0:t1],
                    work, square, vecs, state_out, product, no_scale, zero,
                )  # fmt: skip
        for i in range(length):
            den = block[i, dv]
            if den != 0:
                for e in range(dv):
                    out[b, i, e] = block[i, e] / den
            else:
                for e in range(dv):
                    out[b, i, e] = den


def decode_step(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    key_mask: np.ndarray | None,
    projection: np.ndarray,
    *,
    hyperbolic: bool,
    scale: float,
    kv: np.ndarray,
    log_shift: np.ndarray,
    chunk_size: int,
    consts: np.ndarray | None = None,
    fitted: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Causal FAVOR+ for a few new tokens after a state: ``(outputs, kv_out, log_shift_out)``.

    Inputs as for :func:`linattn_numba.cpu.favor_causal`, but already in one shape:
    ``q, k`` of ``(*batch, L, d)``, ``v`` of ``(*batch, L, d_v)``, ``key_mask`` of
    ``(*batch, L)`` or None, ``kv`` of ``(*batch, m, d_v + 1)`` and ``log_shift`` of
    ``(*batch, m)``, all of one dtype, float32 or float64 (``linattn._decode`` checks
    this).  ``projection`` may be given already scaled by ``sqrt(scale)`` and in the
    dtype, with ``consts = [scale / 2, log(m) / 2]``; otherwise both are computed here.
    ``kv`` and ``log_shift`` are not changed; the state after the tokens is new arrays.
    ``fitted``: a fitted map's ``(weights, biases)`` as
    :func:`linattn_numba.cpu.calls.fitted_operands` gives them for this batch (flat ``(n,
    2, d, m/2)`` and ``(n, 2, m/2)``, the dtype): its features instead of the projection's.
    """
    *batch, length, head_dim = q.shape
    dv = v.shape[-1]
    m = kv.shape[-2]
    dtype = q.dtype
    n = math.prod(batch)
    if consts is None:
        consts = np.array([0.5 * scale, 0.5 * np.log(m)], dtype=dtype)
        projection = np.sqrt(scale) * projection
    consts = contiguous(consts, consts.shape, dtype)
    projection = contiguous(projection, projection.shape, dtype)
    qf = contiguous(q, (n, length, head_dim))
    kf = contiguous(k, (n, length, head_dim))
    vf = contiguous(v, (n, length, dv))
    mask = contiguous(
        np.ones((n, length), np.bool_) if key_mask is None else key_mask, (n, length)
    )
    kv_in = contiguous(kv, (n, m, dv + 1))
    mu_in = contiguous(log_shift, (n, m))
    out = np.empty((n, length, dv), dtype)
    kv_out = np.empty((n, m, dv + 1), dtype)
    mu_out = np.empty((n, m), dtype)
    if fitted is None:  # a random map: the kernels' empty fitted operands
        fitted = fitted_operands(None, (n,), dtype)[:2]
    args = (qf, kf, vf, mask, projection, consts, hyperbolic, *fitted, kv_in, mu_in,
            chunk_size)  # fmt: skip
    variant = _machinery.choose_variant(n, length, m * (dv + 1))
    if variant == "serial":  # one thread: BLAS's own threads fight nobody
        _decode.run(variant, *args, kv_out, mu_out, out)
    else:
        with _machinery.single_threaded_blas():
            _decode.run(variant, *args, kv_out, mu_out, out)
    return (
        out.reshape((*batch, length, dv)),
        kv_out.reshape((*batch, m, dv + 1)),
        mu_out.reshape((*batch, m)),
    )
