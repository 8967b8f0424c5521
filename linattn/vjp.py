"""Explicit vector-Jacobian product of linear attention, for users without autodiff.

``linear_attention_vjp`` returns ``(dq, dk, dv)`` for a cotangent of the normalised
output.  Causal attention runs the compiled backward kernel where one serves the
arrays (NumPy, positive features) and otherwise the chunked backward below, written
in the array API with the same strategy as the kernel: states are recomputed
forward from ``sqrt(N)`` chunk checkpoints (never rebuilt by subtraction,
``docs/algorithm.md``, section 13) and ``dS`` runs as a reverse scan.  Bidirectional attention
uses closed-form products.

Every stabiliser (per-feature maxima, per-row and per-key shifts) is held constant:
numerator and denominator share it, so the gradient of the normalised output is
exact.
"""

from __future__ import annotations

import math

import numpy as np

from linattn import _dispatch
from linattn._checks import check_attention_inputs, check_chunk_size
from linattn._dispatch import Backend
from linattn._xp import Array, Namespace, compute_dtype, constant, float_dtype, from_host
from linattn._xp import safe_shift as _safe
from linattn.attention import attend, attention_operands, drop_masked_keys
from linattn.causal import chunk_shifts, pair_products, query_factors
from linattn.features import FeatureMap
from linattn.state import absorb_keys, empty_state

__all__ = ["linear_attention_vjp"]


def linear_attention_vjp(
    q: Array,
    k: Array,
    v: Array,
    feature_map: FeatureMap,
    grad_output: Array,
    /,
    *,
    causal: bool = False,
    key_mask: Array | None = None,
    chunk_size: int = 64,
    backend: Backend | None = None,
) -> tuple[Array, Array, Array]:
    """Gradients of ``sum(grad_output * linear_attention(q, k, v, feature_map, ...))``.

    Parameters
    ----------
    q, k, v : arrays
        As for :func:`linattn.linear_attention`.
    feature_map : FeatureMap
        Any kind; the projection is held fixed (no gradient).
    grad_output : array, shape ``(..., L_q, d_v)``
        Cotangent of the output, with the output's (broadcast) shape.
    causal, key_mask, chunk_size, backend
        As for :func:`linattn.linear_attention`.

    Returns
    -------
    (dq, dk, dv) : arrays
        Shaped and typed like ``q``, ``k`` and ``v`` (broadcast dimensions summed).

    Examples
    --------
    >>> import numpy as np
    >>> import linattn as la
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (0.5 * rng.normal(size=(2, 16, 8)) for _ in range(3))
    >>> fm = la.FeatureMap(8, 32, seed=0)
    >>> g = rng.normal(size=(2, 16, 8))
    >>> dq, dk, dv = la.linear_attention_vjp(q, k, v, fm, g, causal=True)
    >>> dq.shape, dk.shape, dv.shape
    ((2, 16, 8), (2, 16, 8), (2, 16, 8))
    >>> eps = 1e-6; v2 = v.copy(); v2[0, 3, 1] += eps
    >>> f = lambda v: (g * la.linear_attention(q, k, v, fm, causal=True)).sum()
    >>> bool(abs((f(v2) - f(v)) / eps - dv[0, 3, 1]) < 1e-5)
    True
    """
    if not isinstance(feature_map, FeatureMap):
        raise TypeError(
            f"feature_map must be a linattn.FeatureMap; got {type(feature_map).__name__}"
        )
    if grad_output is None:
        raise TypeError("grad_output must be an array shaped like the output; got None")
    info = check_attention_inputs(
        q,
        k,
        v,
        key_mask=key_mask,
        causal=causal,
        head_dim=feature_map.head_dim,
        extra={"grad_output": grad_output},
    )
    chunk_size = check_chunk_size(chunk_size)
    _dispatch.resolve_backend(backend)
    xp = info.xp
    float_dtype(xp, "grad_output", grad_output)
    batch, lq, dv = info.batch_shape, info.query_length, info.value_dim
    if tuple(grad_output.shape) != (*batch, lq, dv):
        raise ValueError(
            f"grad_output must have the output's shape {(*batch, lq, dv)}; got "
            f"{tuple(grad_output.shape)}"
        )
    work = compute_dtype(xp, info.dtype)
    inputs = q, k, v
    q, k, v = (xp.astype(x, work, copy=False) for x in inputs)  # one compute dtype
    k, v = drop_masked_keys(xp, k, v, key_mask)
    m = feature_map.num_features
    if feature_map.needs_calibration:
        if causal:
            raise ValueError(
                f"causal attention needs the {feature_map.kind!r} feature map's query/key "
                "statistics fixed in advance: expected a map from feature_map.calibrate(q, k) "
                "or with_statistics(...), got an uncalibrated one"
            )
        # The same statistics linear_attention uses; constants for gradients there too.
        feature_map = feature_map.calibrate(q, k, key_mask=key_mask)
    log_phi_q, sign_q, log_phi_k, sign_k, values_aug = attention_operands(
        q, k, v, feature_map, info, batch, key_mask, work
    )
    kv, log_shift = empty_state(xp, batch, m, dv, log_phi_q)

    operands = (log_phi_q, sign_q, log_phi_k, sign_k, values_aug)
    outputs_aug, _, _ = attend(
        xp, operands, kv, log_shift, causal=causal, chunk_size=chunk_size, backend=backend
    )
    d_outputs_aug = _normalise_vjp(xp, outputs_aug, xp.astype(grad_output, work, copy=False))

    if not causal:
        d_lq, d_lk, d_va = _bidirectional_vjp(
            xp, log_phi_q, sign_q, log_phi_k, sign_k, values_aug, d_outputs_aug
        )
    else:
        kernel = _dispatch.causal_backward_kernel(
            log_phi_q, signed=sign_q is not None, backend=backend
        )
        if kernel is not None:
            d_lq, d_lk, d_va, _ = kernel(
                log_phi_q,
                log_phi_k,
                values_aug,
                kv,
                log_shift,
                chunk_size,
                d_outputs_aug,
                xp.zeros_like(kv),
            )
        else:
            d_lq, d_lk, d_va = causal_vjp(
                xp, log_phi_q, sign_q, log_phi_k, sign_k, values_aug, d_outputs_aug, chunk_size
            )
    dq = feature_map.log_features_vjp(q, d_lq, role="query")
    dk = feature_map.log_features_vjp(k, d_lk, role="key")
    d_values = d_va[..., :dv]
    q, k, v = inputs  # gradients in the callers' dtypes
    return (
        _sum_to(xp, dq, tuple(q.shape), q.dtype),
        _sum_to(xp, dk, tuple(k.shape), k.dtype),
        _sum_to(xp, d_values, tuple(v.shape), v.dtype),
    )


def _normalise_vjp(xp: Namespace, outputs_aug: Array, grad: Array) -> Array:
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


def _bidirectional_vjp(
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
    constant.  States are recomputed forward from ``sqrt(N)`` checkpoints, so memory
    is ``O(sqrt(N) m d_v)`` beyond inputs and outputs.
    """
    batch = tuple(log_phi_q.shape[:-2])
    length, m = log_phi_q.shape[-2:]
    width = values_aug.shape[-1]
    chunk_size = min(chunk_size, max(length, 1))  # no chunk-sized mask beyond L
    starts = list(range(0, length, chunk_size))
    per_segment = max(1, math.isqrt(len(starts) - 1) + 1)
    lower = from_host(
        xp,
        np.tril(np.ones((chunk_size, chunk_size), dtype=bool)),
        dtype=xp.bool,
        device=_device(log_phi_q),
    )

    def rows(x: Array | None, start: int) -> Array | None:
        return None if x is None else x[..., start : min(start + chunk_size, length), :]

    def absorb(state: tuple[Array, Array], start: int) -> tuple[Array, Array]:
        return absorb_keys(
            xp, *state, rows(log_phi_k, start), rows(sign_k, start), rows(values_aug, start)
        )

    state = empty_state(xp, batch, m, width - 1, log_phi_q)
    checkpoints = []
    for n, start in enumerate(starts):
        if n % per_segment == 0:
            checkpoints.append(state)
        state = absorb(state, start)
    d_state = xp.zeros_like(state[0])
    grads: list[tuple[Array, Array, Array]] = []
    for s in range(len(checkpoints) - 1, -1, -1):
        segment = starts[s * per_segment : (s + 1) * per_segment]
        states = [checkpoints[s]]
        for start in segment:
            states.append(absorb(states[-1], start))
        for i in range(len(segment) - 1, -1, -1):
            start = segment[i]
            size = min(start + chunk_size, length) - start
            chunk_grads, d_state = _chunk_vjp(
                xp,
                states[i],
                states[i + 1][1],
                rows(log_phi_q, start),
                rows(sign_q, start),
                rows(log_phi_k, start),
                rows(sign_k, start),
                rows(values_aug, start),
                rows(d_outputs_aug, start),
                d_state,
                lower if size == chunk_size else lower[:size, :size],
            )
            grads.append(chunk_grads)
    grads.reverse()
    return tuple(
        parts[0] if len(parts) == 1 else xp.concat(list(parts), axis=-2)
        for parts in zip(*grads, strict=True)
    )


def _chunk_vjp(
    xp: Namespace,
    state: tuple[Array, Array],
    next_log_shift: Array,
    log_phi_q: Array,
    sign_q: Array | None,
    log_phi_k: Array,
    sign_k: Array | None,
    values_aug: Array,
    d_out: Array,
    d_state: Array,
    lower: Array,
) -> tuple[tuple[Array, Array, Array], Array]:
    """Backward of one chunk of ``causal._chunk_outputs`` and of the state update after it."""
    kv, log_shift = state
    shifts = chunk_shifts(xp, log_shift, log_phi_q, sign_q, log_phi_k, sign_k, lower)
    u, psi, state_weight = shifts.u, shifts.psi, shifts.state_weight
    # The state update's features and decay (linattn.state.absorb_keys).
    next_mu = _safe(xp, next_log_shift)
    phi = xp.exp(log_phi_k - next_mu[..., None, :])
    if sign_k is not None:
        phi = sign_k * phi
    decay = xp.exp(log_shift - next_mu)  # 0 where mu = -inf (no overflow to discard)
    t = xp.matrix_transpose
    intra = pair_products(xp, shifts, u, psi)
    paired = pair_products(xp, shifts, d_out, values_aug)
    d_lq = u * (state_weight * xp.matmul(d_out, t(kv)) + xp.matmul(paired, psi))
    d_lk = psi * xp.matmul(t(paired), u) + phi * xp.matmul(values_aug, t(d_state))
    d_va = xp.matmul(t(intra), d_out) + xp.matmul(phi, d_state)
    d_state = decay[..., None] * d_state + xp.matmul(t(u), state_weight * d_out)
    return (d_lq, d_lk, d_va), d_state


def _sum_to(xp: Namespace, grad: Array, shape: tuple[int, ...], dtype: object) -> Array:
    """Sum ``grad`` over the dimensions that broadcasting added or stretched to ``shape``."""
    extra = grad.ndim - len(shape)
    if extra:
        grad = xp.sum(grad, axis=tuple(range(extra)))
    stretched = tuple(i for i, n in enumerate(shape) if n == 1 and grad.shape[i] != 1)
    if stretched:
        grad = xp.sum(grad, axis=stretched, keepdims=True)
    return xp.astype(grad, dtype, copy=False)


def _device(x: Array) -> object:
    import array_api_compat

    return array_api_compat.device(x)
