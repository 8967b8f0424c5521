"""Stabilised linear attention in the array API: bidirectional and chunked causal.

All functions take log-features (``-inf`` for masked keys) and return *unnormalised*
outputs ``[numerator | denominator]``; :func:`normalise` divides.  Every exponent
is non-positive, so nothing overflows, and no epsilon is added anywhere.

The chunked causal form (``docs/algorithm.md``, sections 7-9) keeps the state ``(S, mu)`` at
chunk boundaries.  Inside a chunk, token ``t`` may only be stabilised by tokens
``<= t`` (anything else leaks the future through rounding and underflow), so the
chunk uses shifts that factor through the matrix products:

* queries: ``u_t = exp(l(q_t) + mu - F_t)`` with ``F_t = max_r (l(q_t)_r + mu_r)``;
* keys: ``psi_j = exp(l(k_j) - mu - G_j)`` with ``G_j = max_r (l(k_j)_r - mu_r)``;
* token ``t`` scales its state term by ``exp(-Gmax_t)`` and key ``j <= t`` by
  ``exp(G_j - Gmax_t)``, where ``Gmax_t`` is the running maximum of ``G`` up to
  ``t`` (floored at 0 once the state holds a key).

Here ``mu`` is the state's per-feature maximum *before* the chunk, which depends
on earlier chunks only.  :func:`causal` computes it for every chunk at once, by a scan
of the chunks' own states (:mod:`linattn.scan`), and then every chunk's outputs at
once: one batched pass, no loop over the sequence.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from linattn._xp import Array, Namespace, array_device, constant, from_host, safe_shift
from linattn.scan import exclusive, inclusive_scan
from linattn.state import absorb_keys, combine, empty_state

__all__ = [
    "ChunkBlocks",
    "ChunkShifts",
    "bidirectional",
    "causal",
    "chunk_shifts",
    "normalise",
    "pair_products",
    "query_factors",
    "query_factors_and_shift",
    "readout",
]


def readout(
    xp: Namespace, kv: Array, log_shift: Array, log_phi_q: Array, sign_q: Array | None
) -> Array:
    """Queries against a state: ``u^T S`` with ``u = exp(l(q) + mu - F)``, ``(..., L, d_v+1)``."""
    return xp.matmul(query_factors(xp, log_shift, log_phi_q, sign_q), kv)


def query_factors(
    xp: Namespace, log_shift: Array, log_phi_q: Array, sign_q: Array | None
) -> Array:
    """``u_t = exp(l(q_t) + mu - F_t)`` (times signs), ``F_t = max_r (l(q_t)_r + mu_r)``."""
    return query_factors_and_shift(xp, log_shift, log_phi_q, sign_q)[0]


def query_factors_and_shift(
    xp: Namespace, log_shift: Array, log_phi_q: Array, sign_q: Array | None
) -> tuple[Array, Array]:
    """``u_t`` and the shift ``F_t`` it took out (0 if infinite): ``(..., L, m)``, ``(..., L)``."""
    shifted = log_phi_q + safe_shift(xp, log_shift)[..., None, :]
    top = safe_shift(xp, xp.max(shifted, axis=-1, keepdims=True))
    u = xp.exp(shifted - top)
    return (u if sign_q is None else sign_q * u), top[..., 0]


def bidirectional(
    xp: Namespace,
    log_phi_q: Array,
    sign_q: Array | None,
    log_phi_k: Array,
    sign_k: Array | None,
    values_aug: Array,
    kv: Array,
    log_shift: Array,
    *,
    return_log_scale: bool = False,
) -> Array | tuple[Array, Array]:
    """``phi(Q) (phi(K)^T [V|1])``, stabilised per feature over all keys.

    With ``return_log_scale`` also the per-query log-scale ``c`` (``(..., L)``): the
    unstabilised ``[numerator | denominator]`` is ``exp(c)`` times the outputs.
    """
    kv, log_shift = absorb_keys(xp, kv, log_shift, log_phi_k, sign_k, values_aug)
    u, top = query_factors_and_shift(xp, log_shift, log_phi_q, sign_q)
    outputs = xp.matmul(u, kv)
    return (outputs, top) if return_log_scale else outputs


def causal(
    xp: Namespace,
    log_phi_q: Array,
    sign_q: Array | None,
    log_phi_k: Array,
    sign_k: Array | None,
    values_aug: Array,
    kv: Array,
    log_shift: Array,
    chunk_size: int,
    *,
    tokens_per_pass: int | None = None,
    return_log_scale: bool = False,
) -> tuple[Array, ...]:
    """Chunked causal linear attention continuing from state ``(kv, log_shift)``.

    One batched pass, no loop over the sequence: every chunk's own state at once, a
    scan of those states (:func:`linattn.scan.inclusive_scan`, O(log N) steps), then
    every chunk's outputs at once.  ``tokens_per_pass`` (the plan's choice for eager
    CPU arrays, :mod:`linattn._dispatch`) splits that pass into groups of chunks carried
    one to the next, so that each group's temporaries stay in cache; ``None`` is one
    pass, as tracing frameworks and GPUs want.

    Returns
    -------
    (outputs_aug, kv, log_shift) or (outputs_aug, kv, log_shift, log_scale)
        Unnormalised outputs ``(..., L, d_v + 1)`` and the state after the last token;
        with ``return_log_scale`` also the per-query log-scale ``c`` (``(..., L)``): the
        unstabilised ``[numerator | denominator]`` of query ``t`` is ``exp(c_t)`` times
        its outputs (what the window/sink hybrid needs to merge parts,
        :mod:`linattn.hybrid`).
    """
    # Passes over groups hold one group's chunk states at a time: blocks of chunk_size.
    blocks = ChunkBlocks.of(
        xp,
        log_phi_q,
        sign_q,
        log_phi_k,
        sign_k,
        values_aug,
        chunk_size,
        hold_states=tokens_per_pass is None,
    )
    # A row whose shift is -inf has seen no key: it holds nothing whatever it stores (as
    # in the kernels), so its values, and their gradients, are zeros.
    empty = (log_shift == -math.inf)[..., None]
    kv = xp.where(empty, constant(xp, 0.0, kv), kv)
    count = blocks.operands[0].shape[-3]
    size = blocks.lower.shape[0]
    step = count if tokens_per_pass is None else max(1, tokens_per_pass // size)
    pieces, scales = [], []
    for first in range(0, count, step):
        group = blocks if step >= count else blocks.select(first, first + step)
        prefix, (kv, log_shift) = group.prefix_states(xp, kv, log_shift)
        outputs, log_scale = _chunk_outputs(xp, *prefix, *group.operands, group.lower)
        pieces.append(outputs)
        scales.append(log_scale[..., None])
    outputs = blocks.tokens(xp, pieces[0] if len(pieces) == 1 else xp.concat(pieces, axis=-3))
    if not return_log_scale:
        return outputs, kv, log_shift
    scale = scales[0] if len(scales) == 1 else xp.concat(scales, axis=-3)
    return outputs, kv, log_shift, blocks.tokens(xp, scale)[..., 0]


class ChunkBlocks(NamedTuple):
    """Operands regrouped as ``(..., N, C, .)`` blocks of ``C`` tokens (the last padded).

    ``C`` is the smallest multiple of ``chunk_size`` holding ``d_v + 1`` tokens (at most
    ``L``), so the ``N`` chunk states, ``N m (d_v + 1)`` numbers, never outgrow one
    ``L x m`` array, and powers of two stay unpadded.  Results depend on ``C`` only
    through rounding.  Padded keys have log-feature ``-inf`` (they contribute nothing)
    and padded queries too (their outputs, zeros, are dropped).
    """

    operands: tuple[Array, Array | None, Array, Array | None, Array]
    lower: Array  # (C, C), j <= t
    length: int

    @classmethod
    def of(
        cls,
        xp: Namespace,
        log_phi_q: Array,
        sign_q: Array | None,
        log_phi_k: Array,
        sign_k: Array | None,
        values_aug: Array,
        chunk_size: int,
        *,
        hold_states: bool = True,
    ) -> ChunkBlocks:
        length = log_phi_q.shape[-2]
        width = values_aug.shape[-1] if hold_states else 1
        size = max(1, min(chunk_size * -(-width // chunk_size), length))
        count = -(-length // size)

        def blocks(x: Array | None, fill: float) -> Array | None:
            return None if x is None else _blocked(xp, x, count, size, fill)

        operands = (
            blocks(log_phi_q, -math.inf),
            blocks(sign_q, 1.0),
            blocks(log_phi_k, -math.inf),
            blocks(sign_k, 1.0),
            blocks(values_aug, 0.0),
        )
        lower = from_host(
            xp,
            np.tril(np.ones((size, size), dtype=bool)),
            dtype=xp.bool,
            device=array_device(log_phi_q),
        )
        return cls(operands, lower, length)

    def prefix_states(
        self, xp: Namespace, kv: Array, log_shift: Array
    ) -> tuple[tuple[Array, Array], tuple[Array, Array]]:
        """The state before every chunk (``(..., N, m, w)``, ``(..., N, m)``) and after all.

        ``(kv, log_shift)`` is the state before the first chunk.
        """
        _, _, log_phi_k, sign_k, values_aug = self.operands
        if log_phi_k.shape[-3] == 1:  # one chunk: the incoming state, then one absorb
            end = absorb_keys(
                xp,
                kv,
                log_shift,
                log_phi_k[..., 0, :, :],
                None if sign_k is None else sign_k[..., 0, :, :],
                values_aug[..., 0, :, :],
            )
            return (kv[..., None, :, :], log_shift[..., None, :]), end
        batch, m = (*log_phi_k.shape[:-2],), log_phi_k.shape[-1]
        local = absorb_keys(
            xp,
            *empty_state(xp, batch, m, values_aug.shape[-1] - 1, log_phi_k),
            log_phi_k,
            sign_k,
            values_aug,
        )
        through = inclusive_scan(xp, *local)  # chunks 0..n
        end = combine(xp, (kv, log_shift), (through[0][..., -1, :, :], through[1][..., -1, :]))
        start = (kv[..., None, :, :], log_shift[..., None, :])
        return combine(xp, start, exclusive(xp, *through)), end

    def select(self, first: int, stop: int) -> ChunkBlocks:
        """Chunks ``first .. stop - 1`` (a pass over a group of chunks)."""

        def part(x: Array | None) -> Array | None:
            return None if x is None else x[..., first:stop, :, :]

        q, sq, k, sk, va = self.operands
        return ChunkBlocks(
            (part(q), part(sq), part(k), part(sk), part(va)), self.lower, self.length
        )

    def blocked(self, xp: Namespace, x: Array, fill: float) -> Array:
        """Tokens ``(..., L, .)`` as blocks like the operands, padding filled with ``fill``."""
        return _blocked(xp, x, self.operands[0].shape[-3], self.lower.shape[0], fill)

    def tokens(self, xp: Namespace, x: Array) -> Array:
        """Blocks ``(..., N, C, .)`` back to tokens ``(..., L, .)``, padding dropped."""
        x = xp.reshape(x, (*x.shape[:-3], x.shape[-3] * x.shape[-2], x.shape[-1]))
        return x if x.shape[-2] == self.length else x[..., : self.length, :]


def _blocked(xp: Namespace, x: Array, count: int, size: int, fill: float) -> Array:
    pad = count * size - x.shape[-2]
    if pad:
        tail = xp.full(
            (*x.shape[:-2], pad, x.shape[-1]), fill, dtype=x.dtype, device=array_device(x)
        )
        x = xp.concat([x, tail], axis=-2)
    return xp.reshape(x, (*x.shape[:-2], count, size, x.shape[-1]))


class ChunkShifts(NamedTuple):
    """The stabilised factors of one chunk (module docstring); shared with the VJP."""

    u: Array  # exp(l(q_t) + mu - F_t) (times signs), (..., C, m)
    psi: Array  # exp(l(k_j) - mu - G_j) (times signs), (..., C, m)
    weights: Array  # exp(G_j - Gmax_t) for j <= t, 0 above the diagonal, (..., C, C)
    state_weight: Array  # exp(-Gmax_t) (or 0 for an empty state), (..., C, 1)
    lower: Array  # j <= t, (C, C)
    log_scale: Array  # F_t + Gmax_t: what the factors took out of each output, (..., C)


def chunk_shifts(
    xp: Namespace,
    log_shift: Array,
    log_phi_q: Array,
    sign_q: Array | None,
    log_phi_k: Array,
    sign_k: Array | None,
    lower: Array,
) -> ChunkShifts:
    """Query and key factors of a chunk and its pair weights, stabilised by tokens ``<= t``."""
    neg_inf = constant(xp, -float("inf"), log_shift)
    mu = safe_shift(xp, log_shift)[..., None, :]
    u, query_shift = query_factors_and_shift(xp, log_shift, log_phi_q, sign_q)
    # Keys, shifted per key by their own largest excess over the state's maximum.
    shifted_k = log_phi_k - mu
    key_excess = xp.max(shifted_k, axis=-1)  # G_j, (..., C)
    psi = xp.exp(shifted_k - safe_shift(xp, key_excess)[..., None])
    if sign_k is not None:
        psi = sign_k * psi
    # Running maximum of G over keys j <= t; floored at 0 once the state holds a key.
    state_floor = xp.max(
        xp.where(xp.isfinite(log_shift), constant(xp, 0.0, log_shift), neg_inf),
        axis=-1,
        keepdims=True,
    )
    visible_excess = xp.where(lower, key_excess[..., None, :], neg_inf)  # (..., C, C)
    running = safe_shift(
        xp, xp.maximum(xp.max(visible_excess, axis=-1), state_floor)
    )  # Gmax_t, (..., C)
    weights = xp.exp(visible_excess - running[..., None])
    state_weight = xp.exp(state_floor - running)[..., None]
    return ChunkShifts(u, psi, weights, state_weight, lower, query_shift + running)


def pair_products(xp: Namespace, shifts: ChunkShifts, a: Array, b: Array) -> Array:
    """``a b^T`` times the pair weights, *selected* to 0 for keys after the query.

    Selection, not multiplication by ``exp(-inf) = 0``: a later key whose log-feature
    is NaN or ``+inf`` makes its column NaN, and ``NaN * 0`` would reach earlier rows.
    """
    products = xp.matmul(a, xp.matrix_transpose(b)) * shifts.weights
    return xp.where(shifts.lower, products, constant(xp, 0.0, products))


def _chunk_outputs(
    xp: Namespace,
    kv: Array,
    log_shift: Array,
    log_phi_q: Array,
    sign_q: Array | None,
    log_phi_k: Array,
    sign_k: Array | None,
    values_aug: Array,
    lower: Array,
) -> tuple[Array, Array]:
    """Unnormalised outputs of one chunk (state term plus masked intra-chunk term), log-scale."""
    shifts = chunk_shifts(xp, log_shift, log_phi_q, sign_q, log_phi_k, sign_k, lower)
    intra = pair_products(xp, shifts, shifts.u, shifts.psi)
    outputs = shifts.state_weight * xp.matmul(shifts.u, kv) + xp.matmul(intra, values_aug)
    return outputs, shifts.log_scale


def normalise(xp: Namespace, outputs_aug: Array) -> Array:
    """``numerator / denominator``; queries that see no key (denominator 0) get zeros."""
    den = outputs_aug[..., -1:]
    one = constant(xp, 1.0, den)
    return outputs_aug[..., :-1] / xp.where(den == 0, one, den)
