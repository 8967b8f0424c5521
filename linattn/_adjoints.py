"""The adjoints the VJPs are built from: normalisation, the bidirectional pass, the causal
scan, and summing a broadcast cotangent back to its input's shape.

Array API only, stabilisers held constant (``docs/algorithm.md``, section 13).  Used by
:mod:`linattn.vjp` and by the parts of :mod:`linattn.hybrid`.
"""

from __future__ import annotations

from linattn._xp import Array, Namespace, constant
from linattn._xp import safe_shift as _safe
from linattn.causal import ChunkBlocks, chunk_shifts, pair_products, query_factors
from linattn.scan import inclusive_scan
from linattn.state import absorb_keys, empty_state

__all__ = ["bidirectional_vjp", "causal_vjp", "next_chunk", "normalise_vjp", "sum_to"]


def normalise_vjp(xp: Namespace, outputs_aug: Array, grad: Array) -> Array:
    """Cotangent of ``[num | den]`` from that of ``num / den``: ``[g / den, -(g . o) / den]``.

    Queries that see no key (``den == 0``) output zeros whatever the inputs: no gradient.
    """
    den = outputs_aug[..., -1:]
    empty = den == 0
    safe_den = xp.where(empty, constant(xp, 1.0, den), den)
    out = outputs_aug[..., :-1] / safe_den
    grad = xp.where(empty, constant(xp, 0.0, grad), grad)
    d_num = grad / safe_den
    d_den = -xp.sum(grad * out, axis=-1, keepdims=True) / safe_den
    return xp.concat([d_num, d_den], axis=-1)


def bidirectional_vjp(
    xp: Namespace,
    log_phi_q: Array,
    sign_q: Array | None,
    log_phi_k: Array,
    sign_k: Array | None,
    values_aug: Array,
    d_out: Array,
) -> tuple[Array, Array, Array]:
    """Closed form for ``O = u S``, ``S = phi^T [V|1]`` (shifts as in ``causal.bidirectional``)."""
    batch = tuple(log_phi_q.shape[:-2])
    m, width = log_phi_q.shape[-1], values_aug.shape[-1]
    kv, log_shift = empty_state(xp, batch, m, width - 1, log_phi_q)
    kv, log_shift = absorb_keys(xp, kv, log_shift, log_phi_k, sign_k, values_aug)
    mu = _safe(xp, log_shift)[..., None, :]
    u = query_factors(xp, log_shift, log_phi_q, sign_q)
    phi = xp.exp(log_phi_k - mu)
    if sign_k is not None:
        phi = sign_k * phi
    d_state = xp.matmul(xp.matrix_transpose(u), d_out)
    d_lq = u * xp.matmul(d_out, xp.matrix_transpose(kv))
    d_lk = phi * xp.matmul(values_aug, xp.matrix_transpose(d_state))
    return d_lq, d_lk, xp.matmul(phi, d_state)


def causal_vjp(
    xp: Namespace,
    log_phi_q: Array,
    sign_q: Array | None,
    log_phi_k: Array,
    sign_k: Array | None,
    values_aug: Array,
    d_outputs_aug: Array,
    chunk_size: int,
) -> tuple[Array, Array, Array]:
    """Backward of ``linattn.causal.causal`` from an empty state, in the array API.

    Returns ``(d_log_phi_q, d_log_phi_k, d_values_aug)``; the stabilisers are held
    constant.  One batched pass like the forward: the state before every chunk from the
    forward scan, then the cotangent of every chunk state from a reverse scan, then
    every chunk's gradients at once (``docs/algorithm.md``, section 13).  States are
    never rebuilt by subtraction.
    """
    blocks = ChunkBlocks.of(xp, log_phi_q, sign_q, log_phi_k, sign_k, values_aug, chunk_size)
    batch, m = tuple(log_phi_q.shape[:-2]), log_phi_q.shape[-1]
    start = empty_state(xp, batch, m, values_aug.shape[-1] - 1, log_phi_q)
    (kv, log_shift), end = blocks.prefix_states(xp, *start)
    lq, sq, lk, sk, va = blocks.operands
    d_out = blocks.blocked(xp, d_outputs_aug, 0.0)
    shifts = chunk_shifts(xp, log_shift, lq, sq, lk, sk, blocks.lower)
    t = xp.matrix_transpose
    # Cotangent of the state *before* chunk n: its own use plus the decayed cotangent of
    # the next state, G_n = c_n + exp(mu_n - mu_n+1) G_n+1.  The decays telescope to
    # exp(mu_n - mu_k): a reverse scan of (c_k, -mu_k) whose shift is exactly -mu_n.
    direct = xp.matmul(t(shifts.u), shifts.state_weight * d_out)
    seen = xp.isfinite(log_shift)
    suffix, _ = inclusive_scan(xp, direct, -_safe(xp, log_shift), reverse=True)
    d_before = xp.where(seen[..., None], suffix, constant(xp, 0.0, suffix))
    # Features a chunk's keys did not reach multiply it by exact zeros (phi below).
    d_after = next_chunk(xp, d_before, xp.zeros_like(d_before[..., :1, :, :]), axis=-3)
    next_shift = next_chunk(xp, log_shift, end[1][..., None, :], axis=-2)
    phi = xp.exp(lk - _safe(xp, next_shift)[..., None, :])  # the state update's features
    if sk is not None:
        phi = sk * phi
    intra = pair_products(xp, shifts, shifts.u, shifts.psi)
    paired = pair_products(xp, shifts, d_out, va)
    u, psi = shifts.u, shifts.psi
    d_lq = u * (shifts.state_weight * xp.matmul(d_out, t(kv)) + xp.matmul(paired, psi))
    d_lk = psi * xp.matmul(t(paired), u) + phi * xp.matmul(va, t(d_after))
    d_va = xp.matmul(t(intra), d_out) + xp.matmul(phi, d_after)
    return blocks.tokens(xp, d_lq), blocks.tokens(xp, d_lk), blocks.tokens(xp, d_va)


def next_chunk(xp: Namespace, x: Array, last: Array, *, axis: int) -> Array:
    """``x`` of chunk ``n + 1`` at position ``n``; ``last`` after the final chunk."""
    index = [slice(None)] * x.ndim
    index[axis] = slice(1, None)
    return xp.concat([x[tuple(index)], last], axis=axis)


def sum_to(xp: Namespace, grad: Array, shape: tuple[int, ...], dtype: object) -> Array:
    """Sum ``grad`` over the dimensions that broadcasting added or stretched to ``shape``."""
    extra = grad.ndim - len(shape)
    if extra:
        grad = xp.sum(grad, axis=tuple(range(extra)))
    stretched = tuple(i for i, n in enumerate(shape) if n == 1 and grad.shape[i] != 1)
    if stretched:
        grad = xp.sum(grad, axis=stretched, keepdims=True)
    return xp.astype(grad, dtype, copy=False)
