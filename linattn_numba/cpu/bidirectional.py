"""Fused bidirectional FAVOR+ on the CPU: features, attention and normalisation in two passes.

The algorithm is that of ``linattn.causal.bidirectional`` (``linattn.state.absorb_keys``
then ``linattn.causal.readout``), computed block by block so that no ``L x m`` array
exists:

1. every block of keys is absorbed into the stabilised state ``(S, mu)``:
   ``mu' = max(mu, max_j l(k_j))``, ``S' = exp(mu - mu') S + exp(l(K) - mu')^T [V | 1]``
   (``linattn_numba.cpu.chunks.absorb``; the per-feature maximum over all keys is reached
   block by block, each block rescaling the sum so far);
2. every block of queries is read out: ``u_t = exp(l(q_t) + mu - F_t)``,
   ``F_t = max_r (l(q_t) + mu)_r``, ``O_t = u_t S``, normalised ``O_t[:d_v] / O_t[d_v]``
   (zeros where the denominator is 0: the query sees no key).

The log-features ``l(x)`` of the ``"positive"`` and ``"hyperbolic"`` kinds are computed
in the kernel, :data:`linattn_numba.cpu.features.FEATURE_BLOCK` tokens at a time, so memory above
inputs and outputs is ``O(FEATURE_BLOCK m)`` per thread; the queries' per-row offset
``s |q_t|^2 / 2 + log(m) / 2`` is never computed (``F_t`` absorbs it), each denominator is
summed with its row's exponentials, and the state products run ``d_v`` wide (``phi^T V``
and ``u S[:, :d_v]``), the ones column as sums.

The backward pass (:func:`favor_bidirectional_backward`) gives the gradients of the
normalised outputs with respect to ``q``, ``k`` and ``v``, every stabiliser (``mu``,
``F``) held constant: exact, because numerator and denominator share every shift (the
module docstring of :mod:`linattn_numba.cpu.causal`).  With ``A_t = [g_t / D_t, -(g_t . o_t) /
D_t]`` the cotangent of the unnormalised row: ``d l(q_t) = u_t * (A_t S^T)``,
``dS = sum_t u_t^T A_t``, ``d l(k_j) = phi_j * ([v_j | 1] dS^T)``, ``d[v_j | 1] = phi_j dS``
with ``phi_j = exp(l(k_j) - mu)``, then through the features: ``dx = d_proj P - s x
sum_r d l_r`` (``P`` the projection times ``sqrt(s)``).

Batch x heads are shared among threads (serial for small work:
:mod:`linattn_numba._machinery`); BLAS is pinned to one thread while a kernel runs.
"""

from __future__ import annotations

import numpy as np

from linattn_numba import _machinery
from linattn_numba.cpu.arrays import readonly, without_empty_rows
from linattn_numba.cpu.calls import FusedCall
from linattn_numba.cpu.chunks import running_max, shift_between
from linattn_numba.cpu.exact import exact_rows, merge_into
from linattn_numba.cpu.features import (
    FEATURE_BLOCK,
    LANES,
    block_log_features,
    feature_scratch,
    features_vjp,
    fitted_log_features,
    key_block,
    key_factors,
    query_block,
    query_factors,
)
from linattn_numba.cpu.scalars import fast_exp, safe_shift, typed

__all__ = ["favor_bidirectional", "favor_bidirectional_backward"]

_jit = _machinery.jit


@_jit()
def _normalise_rows(block, den, out):
    """``out = block / den`` row by row; zeros where the denominator is 0."""
    dv = out.shape[1]
    for i in range(out.shape[0]):
        if den[i] != 0:
            for e in range(dv):
                out[i, e] = block[i, e] / den[i]
        else:
            for e in range(dv):
                out[i, e] = den[i]


@_jit()
def _workspace(span, m, rows, hyperbolic, width, dtype):
    """Per worker: projection scratch, two feature blocks, two value-width blocks, six
    vectors (shifts, sums, :data:`LANES` scratch) and an ``m x (d_v + 1)`` product."""
    return (
        np.empty((span if hyperbolic else 0, rows), dtype),
        np.empty((2, span, m), dtype),
        np.empty((2, span, width), dtype),
        np.empty((6, max(m, span, LANES)), dtype),
        np.empty((m, width), dtype),
    )


@_jit()
def _key_log_features(x, mask, projection, consts, hyperbolic, fitted, lk):
    """``lk = l(k)`` of one block of keys
    (:func:`linattn_numba.cpu.features.block_log_features`: ``fitted = (weight, bias,
    scratch)``, a fitted map's where ``weight`` has columns, the scratch
    :func:`linattn_numba.cpu.features.feature_scratch` sizes; no far weight: with no exact
    parts it cancels), ``-inf`` rows for masked keys."""
    weight, bias, scratch = fitted
    zero = typed(0.0, consts[0])
    block_log_features(x, projection, consts, hyperbolic, weight, bias, zero,
                       scratch[: x.shape[0]], lk)  # fmt: skip
    for j in range(lk.shape[0]):
        if not mask[j]:
            for r in range(lk.shape[1]):
                lk[j, r] = -np.inf


@_jit(fastmath=frozenset({"contract", "reassoc"}))
def _exp_rows(lk, shift, sums):
    """``lk = exp(lk - shift)`` in place (one array: aliased arguments would not
    vectorise), and ``sums`` its column sums, summed in any order."""
    sums[:] = 0
    for j in range(lk.shape[0]):
        row = lk[j]
        for r in range(lk.shape[1]):
            p = fast_exp(row[r] - shift[r])
            row[r] = p
            sums[r] += p


@_jit()
def _absorb_all(k, v, mask, projection, consts, hyperbolic, fitted, kv, mu, work):
    """Pass 1 of one head: every key block into ``(kv, mu)``.

    Per block: ``mu' = max(mu, max_j l(k_j))``, ``phi = exp(l(K) - mu')``, and ``S' =
    exp(mu - mu') S + phi^T [V | 1]`` as ``phi^T V`` (``d_v`` columns: ``d_v + 1`` runs
    as slowly as 80 in BLAS, measured) and ``phi``'s column sums.
    """
    _, feats, blocks, vecs, product = work
    m, dv = mu.shape[0], v.shape[1]
    ms, top, shift, decay, sums = vecs[0][:m], vecs[1][:m], vecs[2][:m], vecs[3][:m], vecs[4][:m]
    span = feats.shape[1]
    values = blocks[0].reshape(-1)[: span * dv].reshape((span, dv))
    numerators = product.reshape(-1)[: m * dv].reshape((m, dv))
    for s0 in range(0, k.shape[0], span):
        s1 = min(s0 + span, k.shape[0])
        n = s1 - s0
        lk = feats[0][:n]
        safe_shift(mu, ms)
        _key_log_features(k[s0:s1], mask[s0:s1], projection, consts, hyperbolic, fitted, lk)
        running_max(lk, mu, top)
        shift_between(mu, top, ms, shift, decay)
        _exp_rows(lk, shift, sums)
        every = True
        for j in range(s0, s1):
            every = every and mask[j]
        block_values = v[s0:s1]
        if not every:  # masked keys' values zeroed: nothing they hold (NaN) reaches S
            block_values = values[:n]
            for j in range(n):
                for e in range(dv):
                    block_values[j, e] = v[s0 + j, e] if mask[s0 + j] else 0
        np.dot(lk.T, block_values, numerators)
        for r in range(m):
            scale = decay[r]
            mu[r] = top[r]
            for e in range(dv):
                kv[r, e] = scale * kv[r, e] + numerators[r, e]
            kv[r, dv] = scale * kv[r, dv] + sums[r]


@_jit()
def _split_state(kv, numerators, z):
    """``numerators = S[:, :d_v]`` (contiguous, for BLAS) and ``z = S[:, d_v]``."""
    dv = numerators.shape[1]
    for r in range(kv.shape[0]):
        for e in range(dv):
            numerators[r, e] = kv[r, e]
        z[r] = kv[r, dv]


@_jit()
def _merge_sinks(q, t, sinks, sink_values, visible, window_consts, far, far_scale, work, out):
    """``out[t]``: query ``t``'s far row ``exp(far_scale) far`` (``[num | den]``) merged
    with its exact sinks (:func:`linattn_numba.cpu.exact.exact_rows` with no window)."""
    scratch, row, later, recent, recent_values, keep = work
    top = exact_rows(
        q, q, sink_values, recent, recent_values, keep, sinks, sink_values, visible, t, -1, 0,
        window_consts, scratch, row[0],
    )  # fmt: skip
    merge_into(
        far, 0, far_scale, later, 0, typed(-np.inf, far_scale), row, 0, row[0, out.shape[1]], top,
        window_consts[0], out, t,
    )  # fmt: skip


@_machinery.Variants.over(shared=("projection", "consts", "window_consts"))
def _forward(
    q, k, v, mask, projection, consts, hyperbolic, fitted_weights, fitted_biases, kv, mu, out,
    lse, sinks, sink_values, visible, window_consts,
):  # fmt: skip
    """All heads; ``lse`` (``(batch, L)``, or ``(batch, 0)`` to skip it) gets the log of
    each row's true denominator over the feature-map keys, ``-inf`` where the row sees
    none.  Sinks (``(batch, S, d)`` keys, their values, ``visible`` ``(batch, L, S)``) are
    attended exactly and merged per query (``S = 0``: none).  A fitted map's parameters,
    ``fitted_weights[b, 0 | 1]`` ``(d, m/2)`` and ``fitted_biases[b, 0 | 1]`` for queries
    and keys (``(batch, 2, 0, 0)``: a random map, ``projection``'s), give the features."""
    batch, length, d = q.shape
    m, width = kv.shape[1], kv.shape[2]
    dv = width - 1
    count = sinks.shape[1]
    span = min(FEATURE_BLOCK, max(length, k.shape[1], 1))
    fitted = fitted_weights.shape[3] > 0
    for b in range(batch):
        work = _workspace(span, m, projection.shape[0], hyperbolic, width, q.dtype)
        proj, feats, blocks, vecs, product = work
        scratch = feature_scratch(span, projection, hyperbolic, fitted_weights[b, 1], q)
        keys = (fitted_weights[b, 1], fitted_biases[b, 1], scratch)
        _absorb_all(k[b], v[b], mask[b], projection, consts, hyperbolic, keys, kv[b], mu[b], work)
        ms, z, den, lanes = vecs[0][:m], vecs[1][:m], vecs[2][:span], vecs[5][:LANES]
        scale = vecs[3][:span]
        numerators = product.reshape(-1)[: m * dv].reshape((m, dv))
        block = blocks[0].reshape(-1)[: span * dv].reshape((span, dv))
        far = blocks[1][:1]
        sink_work = (
            np.empty(count, q.dtype), np.empty((1, width), q.dtype), np.zeros((1, width), q.dtype),
            np.empty((0, d), q.dtype), np.empty((0, dv), q.dtype), mask[b],
        )  # fmt: skip
        safe_shift(mu[b], ms)
        _split_state(kv[b], numerators, z)
        for s0 in range(0, length, span):
            s1 = min(s0 + span, length)
            n = s1 - s0
            u = feats[0][:n]
            if fitted:  # whole log-features: the row maxima F_t are the log-scales
                fitted_log_features(q[b][s0:s1], fitted_weights[b, 0], fitted_biases[b, 0],
                                    typed(0.0, consts[0]), scratch[:n], u)  # fmt: skip
                query_factors(u, ms, lanes, z, den[:n], scale[:n])
            else:
                query_block(q[b][s0:s1], projection, consts, hyperbolic, proj[:n], ms, lanes,
                            z, u, den[:n], scale[:n])  # fmt: skip
            np.dot(u, numerators, block[:n])
            if lse.shape[1]:  # log(0) = -inf: a row that sees no key; NaN stays NaN
                for i in range(n):
                    lse[b, s0 + i] = np.log(den[i]) + scale[i]
            if count == 0:
                _normalise_rows(block[:n], den[:n], out[b][s0:s1])
                continue
            for i in range(n):
                for e in range(dv):
                    far[0, e] = block[i, e]
                far[0, dv] = den[i]
                _merge_sinks(q[b], s0 + i, sinks[b], sink_values[b], visible[b], window_consts,
                             far, scale[i], sink_work, out[b])  # fmt: skip


@_jit()
def _query_cotangents(u, kv, out, grad, d_aug):
    """``A_t = [g_t / D_t, -(g_t . o_t) / D_t]``, ``D_t = u_t . S[:, d_v]``; 0 where
    ``D_t = 0`` (a query that sees no key outputs zeros whatever the inputs)."""
    n, m = u.shape
    dv = out.shape[1]
    for i in range(n):
        den = u[i, 0] * kv[0, dv]
        for r in range(1, m):
            den += u[i, r] * kv[r, dv]
        if den == 0:
            for e in range(dv + 1):
                d_aug[i, e] = 0
            continue
        paired = grad[i, 0] - grad[i, 0]
        for e in range(dv):
            d_aug[i, e] = grad[i, e] / den
            paired += grad[i, e] * out[i, e]
        d_aug[i, dv] = -paired / den


@_machinery.Variants.over(shared=("projection", "consts"))
def _backward(q, k, v, mask, projection, consts, hyperbolic, kv, mu, out, grad, dq, dk, dv):
    batch, length, _ = q.shape
    m, width = kv.shape[1], kv.shape[2]
    rows = projection.shape[0]
    span = min(FEATURE_BLOCK, max(length, k.shape[1], 1))
    for b in range(batch):
        proj, feats, blocks, vecs, product = _workspace(span, m, rows, hyperbolic, width, q.dtype)
        d_state = np.zeros((m, width), q.dtype)
        ms, z, lanes = vecs[0][:m], vecs[1][:m], vecs[5][:LANES]
        safe_shift(mu[b], ms)
        z[:] = kv[b][:, width - 1]
        # Queries: d l(q) = u * (A S^T), dS = u^T A.
        for s0 in range(0, length, span):
            s1 = min(s0 + span, length)
            n = s1 - s0
            u, d_aug, du = feats[0][:n], blocks[0][:n], feats[1][:n]
            query_block(q[b][s0:s1], projection, consts, hyperbolic, proj[:n], ms, lanes, z,
                         u, vecs[2][:n], vecs[3][:n])  # fmt: skip
            _query_cotangents(u, kv[b], out[b][s0:s1], grad[b][s0:s1], d_aug)
            np.dot(d_aug, kv[b].T, du)
            np.dot(u.T, d_aug, product)
            d_state += product
            du *= u
            features_vjp(q[b][s0:s1], du, projection, consts, hyperbolic, proj[:n],
                          dq[b][s0:s1])  # fmt: skip
        # Keys: d l(k) = phi * ([V|1] dS^T), d[V|1] = phi dS.
        for s0 in range(0, k.shape[1], span):
            s1 = min(s0 + span, k.shape[1])
            n = s1 - s0
            phi, va, d_va, dphi = feats[0][:n], blocks[0][:n], blocks[1][:n], feats[1][:n]
            key_block(k[b][s0:s1], v[b][s0:s1], mask[b][s0:s1], projection, consts,
                       hyperbolic, proj[:n], phi, va)  # fmt: skip
            key_factors(phi, ms)
            np.dot(va, d_state.T, dphi)
            np.dot(phi, d_state, d_va)
            dphi *= phi
            dv[b][s0:s1] = d_va[:, : width - 1]
            features_vjp(k[b][s0:s1], dphi, projection, consts, hyperbolic, proj[:n],
                          dk[b][s0:s1])  # fmt: skip


def favor_bidirectional(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    projection: np.ndarray,
    *,
    hyperbolic: bool,
    scale: float,
    key_mask: np.ndarray | None = None,
    return_log_normaliser: bool = False,
    sinks: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
    fitted: dict[str, np.ndarray] | None = None,
) -> tuple[np.ndarray, ...]:
    """Bidirectional FAVOR+ in two compiled passes, features included: no ``L x m`` array.

    The same results, up to rounding, as ``FeatureMap.signed_log_features`` followed by
    ``linattn.causal.bidirectional`` and ``linattn.causal.normalise`` for the
    ``"positive"`` and ``"hyperbolic"`` kinds (unrebalanced, no statistics).

    Parameters
    ----------
    q : ndarray, shape ``(*batch, L_q, d)``
    k, v : ndarrays, shapes ``(*batch, L_k, d)`` and ``(*batch, L_k, d_v)``
        Batch axes broadcast; cast to the compute dtype (float64 stays, else float32).
    projection : ndarray, shape ``(rows, d)``
        The feature map's projection (``m = rows``, or ``2 rows`` for ``hyperbolic``).
    hyperbolic : bool
        The ``"hyperbolic"`` kind (features ``exp(+-w.x)``) rather than ``"positive"``.
    scale : float
        The softmax scale.
    key_mask : bool ndarray, shape ``(*batch, L_k)``, optional
        True for keys that take part; a query that sees no key gets zeros.
    return_log_normaliser : bool, default False
        Also return each row's log-denominator ``log sum_j phi(q_t) . phi(k_j)``
        (``(*batch, L_q)``, ``-inf`` where the query sees no key): what merging these
        rows with other partials needs (over the feature-map keys alone).
    sinks : (keys, values, visible), optional
        Keys attended exactly, ``(*batch, S, d)``, their values ``(*batch, S, d_v)`` and
        ``visible`` ``(*batch, L_q, S)`` (bool): each query's exact weights
        ``exp(scale q . k)`` are merged with its feature-map row as online softmax does
        (keep them out of ``key_mask``: a key in both counts twice).
    fitted : dict of ndarrays, optional
        A fitted map's parameters broadcast to the batch axes, in the compute dtype
        (``linattn.fitted.kernel_parameters``): its features instead of ``projection``'s
        (pass an empty ``(0, d)`` projection).  Without sinks only: ``key_shift``, the far
        weight, cancels and is not applied (the hybrid kernels take fitted maps with
        exact keys).

    Returns
    -------
    (outputs, kv, log_shift) or (outputs, kv, log_shift, log_normaliser)
        Normalised outputs ``(*batch, L_q, d_v)`` and the state after every key,
        ``(*batch, m, d_v + 1)`` and ``(*batch, m)`` (what the backward takes).

    Examples
    --------
    >>> import numpy as np
    >>> x = np.zeros((1, 3, 2)); v = np.arange(6.0).reshape(1, 3, 2)
    >>> out, kv, mu = favor_bidirectional(x, x, v, np.eye(2), hyperbolic=False, scale=1.0)
    >>> out[0]  # equal features: every query gets the mean value
    array([[2., 3.],
           [2., 3.],
           [2., 3.]])
    """
    if fitted is not None and sinks is not None:
        raise ValueError("fitted maps with sinks run in the hybrid kernels; got both")
    call = FusedCall(q, k, v, projection, hyperbolic, scale, key_mask, fitted)
    weights, biases, _ = call.fitted
    kv = np.zeros((call.n, call.m, call.dv + 1), call.dtype)
    mu = np.full((call.n, call.m), -np.inf, call.dtype)
    out = np.empty((call.n, call.length, call.dv), call.dtype)
    if not isinstance(return_log_normaliser, bool | np.bool_):
        raise TypeError(
            f"return_log_normaliser must be True or False; got {return_log_normaliser!r}"
        )
    lse = np.empty((call.n, call.length if return_log_normaliser else 0), call.dtype)
    exact = call.sinks(sinks)
    window_consts = readonly(np.array([0.0, -np.inf, scale], dtype=call.dtype))
    with _machinery.single_threaded_blas():
        _forward.run(
            call.variant, *call.operands(), weights, biases, kv, mu, out, lse, *exact,
            window_consts,
        )  # fmt: skip
    batch = call.batch
    results = (
        out.reshape((*batch, call.length, call.dv)),
        kv.reshape((*batch, call.m, call.dv + 1)),
        mu.reshape((*batch, call.m)),
    )
    if return_log_normaliser:
        return (*results, lse.reshape((*batch, call.length)))
    return results


def favor_bidirectional_backward(
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
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gradients ``(dq, dk, dv)`` of ``sum(grad_output * outputs)`` for
    :func:`favor_bidirectional`, given its results ``(outputs, kv, log_shift)``.

    Stabilisers are held constant (exact for the normalised outputs).  Gradients have
    the broadcast batch shape ``(*batch, L, d)`` in the compute dtype (sum over
    broadcast axes yourself).  Masked keys get zero gradients.

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.normal(size=(1, 4, 2)) for _ in range(3))
    >>> w, g = rng.normal(size=(3, 2)), rng.normal(size=(1, 4, 2))
    >>> out, kv, mu = favor_bidirectional(q, k, v, w, hyperbolic=False, scale=0.5)
    >>> dq, dk, dv = favor_bidirectional_backward(
    ...     q, k, v, w, kv, mu, out, g, hyperbolic=False, scale=0.5)
    >>> v2 = v.copy(); v2[0, 1, 0] += 1e-6
    >>> out2, _, _ = favor_bidirectional(q, k, v2, w, hyperbolic=False, scale=0.5)
    >>> bool(abs((g * (out2 - out)).sum() / 1e-6 - dv[0, 1, 0]) < 1e-5)
    True
    """
    call = FusedCall(q, k, v, projection, hyperbolic, scale, key_mask)
    state = call.check("kv", kv, (call.m, call.dv + 1))
    mu = call.check("log_shift", log_shift, (call.m,))
    state = readonly(without_empty_rows(state.copy(), mu))
    out = call.check("outputs", outputs, (call.length, call.dv))
    grad = call.check("grad_output", grad_output, (call.length, call.dv))
    dq, dk, dv = (np.empty(x.shape, call.dtype) for x in (call.q, call.k, call.v))
    with _machinery.single_threaded_blas():
        _backward.run(call.variant, *call.operands(), state, mu, out, grad, dq, dk, dv)
    batch = call.batch
    return (
        dq.reshape((*batch, *dq.shape[1:])),
        dk.reshape((*batch, *dk.shape[1:])),
        dv.reshape((*batch, *dv.shape[1:])),
    )
