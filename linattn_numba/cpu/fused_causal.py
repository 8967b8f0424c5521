"""The fused causal FAVOR+ pass: features, causal attention and normalisation at once.

:func:`favor_causal` computes the features chunk by chunk and normalises, so that no
``L x m`` array exists (what long sequences need); :func:`forward` runs the same kernel
after checking every argument (what the torch operators of
:mod:`linattn_numba.torch_ops` need: they are callable by anyone), and always returns the
log-normaliser.  Its backward is :mod:`linattn_numba.cpu.fused_causal_backward`.
"""

from __future__ import annotations

import math

import numpy as np

from linattn_numba import _contract, _machinery
from linattn_numba.cpu.arrays import (
    chunk_length,
    contiguous,
    fresh,
    readonly,
    without_empty_rows,
)
from linattn_numba.cpu.calls import CausalFusedCall, check_fitted, fitted_operands
from linattn_numba.cpu.chunks import chunk_forward, chunk_workspace
from linattn_numba.cpu.features import FEATURE_BLOCK, block_log_features, feature_scratch
from linattn_numba.cpu.scalars import typed

__all__ = ["favor_causal", "forward"]


@_machinery.Variants.over(shared=("projection", "consts"))
def _forward_fused(
    q, k, v, mask, projection, consts, hyperbolic, fitted_weights, fitted_biases, kv, mu, chunk,
    out, lse,
):  # fmt: skip
    """Features, causal attention and normalisation per block: no ``L x m`` array anywhere.

    ``lse`` (``(batch, L)``, or ``(batch, 0)`` to skip it) gets the log of each row's true
    denominator, ``-inf`` where the row sees no key.  The features are a fitted map's where
    ``fitted_weights`` has columns, row ``b``'s query and key parameters
    ``fitted_weights[b, 0 | 1]`` and ``fitted_biases[b, 0 | 1]`` (no far weight: with no
    exact parts it cancels), else ``projection``'s.
    """
    batch, length, _ = q.shape
    dv = v.shape[2]
    m = kv.shape[1]
    dtype = q.dtype
    span = chunk * max(1, FEATURE_BLOCK // chunk)
    zero = typed(0.0, consts[0])
    for b in range(batch):
        work, square, vecs, state_out, product = chunk_workspace(chunk, m, dv + 1, dtype)
        fw, fb = fitted_weights[b], fitted_biases[b]
        proj = feature_scratch(span, projection, hyperbolic, fw[0], q)
        lq = np.empty((span, m), dtype)
        lk = np.empty((span, m), dtype)
        va = np.empty((span, dv + 1), dtype)
        block = np.empty((chunk, dv + 1), dtype)
        for s0 in range(0, length, span):
            s1 = min(s0 + span, length)
            n = s1 - s0
            block_log_features(q[b][s0:s1], projection, consts, hyperbolic, fw[0], fb[0], zero,
                               proj[:n], lq[:n])  # fmt: skip
            block_log_features(k[b][s0:s1], projection, consts, hyperbolic, fw[1], fb[1], zero,
                               proj[:n], lk[:n])  # fmt: skip
            for i in range(n):
                for e in range(dv):
                    va[i, e] = v[b, s0 + i, e]
                va[i, dv] = 1
                if not mask[b, s0 + i]:  # a masked key: no features, no (padding) values
                    for r in range(m):
                        lk[i, r] = -np.inf
                    for e in range(dv):
                        va[i, e] = 0
            for t0 in range(0, n, chunk):
                t1 = min(t0 + chunk, n)
                c = t1 - t0
                scale = lse[b][s0 + t0 : s0 + t1]
                chunk_forward(
                    lq[t0:t1], lk[t0:t1], va[t0:t1], kv[b], mu[b], block[:c],
                    work, square, vecs, state_out, product, scale, zero,
                )  # fmt: skip
                for i in range(scale.shape[0]):
                    # log(0) = -inf: a row that sees no key; NaN stays NaN.
                    scale[i] = np.log(block[i, dv]) + scale[i]
                for i in range(c):
                    den = block[i, dv]
                    if den != 0:
                        for e in range(dv):
                            out[b, s0 + t0 + i, e] = block[i, e] / den
                    else:
                        for e in range(dv):
                            out[b, s0 + t0 + i, e] = den


def favor_causal(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    projection: np.ndarray,
    *,
    hyperbolic: bool,
    scale: float,
    key_mask: np.ndarray | None,
    kv: np.ndarray,
    log_shift: np.ndarray,
    chunk_size: int,
    return_log_normaliser: bool = False,
    fitted: dict[str, np.ndarray] | None = None,
) -> tuple[np.ndarray, ...]:
    """Causal FAVOR+ in one pass: features, attention and normalisation chunk by chunk.

    The same results as ``FeatureMap.signed_log_features`` followed by
    ``linattn_numba.cpu.causal.numpy_forward`` and ``linattn.causal.normalise`` for
    the ``"positive"`` and ``"hyperbolic"`` kinds, without ever holding an ``L x m``
    feature array: memory above inputs and outputs is ``O(C m)`` per thread.  Inputs
    must already be checked by ``linattn`` (shapes broadcast, one floating dtype); they
    are cast to the compute dtype (float64 stays, all else float32).

    With ``fitted`` (a fitted map's parameters broadcast to the batch axes, as
    ``linattn.fitted.kernel_parameters`` gives them, in the compute dtype) the features
    are that map's, computed per block the same way; ``projection`` is then ignored
    (pass an empty ``(0, d)``) and ``key_shift`` (the far weight) too, since with no
    exact parts it cancels.

    Returns
    -------
    (outputs, kv_out, log_shift_out)
        Normalised outputs ``(*batch, L, d_v)`` in the compute dtype and the state.
    log_normaliser : ndarray, shape ``(*batch, L)``
        Only with ``return_log_normaliser=True``, after the three: the log of each
        output's true denominator, ``log sum_j phi(q_t) . phi(k_j)`` over the keys it
        sees (those of the incoming state included), ``-inf`` where it sees none.

    Examples
    --------
    >>> import numpy as np
    >>> x = np.zeros((1, 3, 2)); w = np.eye(2); v = np.arange(6.0).reshape(1, 3, 2)
    >>> out, kv, mu = favor_causal(x, x, v, w, hyperbolic=False, scale=1.0, key_mask=None,
    ...     kv=np.zeros((1, 2, 3)), log_shift=np.full((1, 2), -np.inf), chunk_size=2)
    >>> out[0]
    array([[0., 1.],
           [1., 2.],
           [2., 3.]])
    >>> *_, lse = favor_causal(x, x, v, w, hyperbolic=False, scale=1.0, key_mask=None,
    ...     kv=np.zeros((1, 2, 3)), log_shift=np.full((1, 2), -np.inf), chunk_size=2,
    ...     return_log_normaliser=True)
    >>> np.exp(lse)  # phi(0) . phi(0) = 1 per key
    array([[1., 2., 3.]])
    """
    dtype = np.dtype(np.float64) if q.dtype == np.float64 else np.dtype(np.float32)
    rows, head_dim = projection.shape
    m = kv.shape[-2]
    batch = np.broadcast_shapes(
        q.shape[:-2], k.shape[:-2], v.shape[:-2], kv.shape[:-2], log_shift.shape[:-1],
        () if key_mask is None else key_mask.shape[:-1],
    )  # fmt: skip
    if fitted is not None:
        check_fitted(fitted, tuple(batch), q.shape[-1], m, dtype)
    elif m != rows * (2 if hyperbolic else 1) or q.shape[-1] != head_dim:
        raise ValueError(
            f"projection {projection.shape} does not match q {q.shape} and kv {kv.shape}"
        )
    chunk = chunk_length(_contract.check_chunk_size(chunk_size), q.shape[-2])
    length, dv = q.shape[-2], v.shape[-1]

    n = math.prod(batch)

    def flat(x: np.ndarray, tail: tuple[int, ...]) -> np.ndarray:
        return contiguous(np.broadcast_to(x, (*batch, *tail)), (n, *tail), dtype)

    qf, kf, vf = (
        flat(q, (length, head_dim)),
        flat(k, (length, head_dim)),
        flat(v, (length, dv)),
    )
    mask = np.ones(length, bool) if key_mask is None else key_mask
    maskf = contiguous(np.broadcast_to(mask, (*batch, length)), (n, length))
    mu = fresh(np.broadcast_to(log_shift, (*batch, m)), (n, m), dtype)
    state = fresh(np.broadcast_to(kv, (*batch, m, dv + 1)), (n, m, dv + 1), dtype)
    state = without_empty_rows(state, mu)
    consts = readonly(np.array([0.5 * scale, 0.5 * np.log(m)], dtype=dtype))
    scaled_projection = readonly(np.ascontiguousarray(np.sqrt(scale) * projection, dtype=dtype))
    out = np.empty((n, length, dv), dtype)
    lse = np.empty((n, length if return_log_normaliser else 0), dtype)
    variant = _machinery.choose_variant(n, length, m * (dv + 1))
    with _machinery.single_threaded_blas():
        _forward_fused.run(
            variant, qf, kf, vf, maskf, scaled_projection, consts, bool(hyperbolic),
            *fitted_operands(fitted, tuple(batch), dtype)[:2], state, mu, chunk, out, lse,
        )  # fmt: skip
    results = (
        out.reshape((*batch, length, dv)),
        state.reshape((*batch, m, dv + 1)),
        mu.reshape((*batch, m)),
    )
    if return_log_normaliser:
        return (*results, lse.reshape((*batch, length)))
    return results


def forward(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    projection: np.ndarray,
    kv: np.ndarray,
    log_shift: np.ndarray,
    *,
    hyperbolic: bool,
    scale: float,
    key_mask: np.ndarray | None = None,
    chunk_size: int = 64,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Causal FAVOR+ in one pass, every argument checked: ``(outputs, kv, log_shift,
    log_normaliser)``.

    :func:`linattn_numba.cpu.favor_causal` with ``return_log_normaliser=True`` (the same
    kernel, the same results), after checks that name the argument at fault.

    Parameters
    ----------
    q, k : ndarrays, shape ``(*batch, L, d)``
    v : ndarray, shape ``(*batch, L, d_v)``
        Batch axes broadcast; cast to the compute dtype (float64 stays, else float32).
    projection : ndarray, shape ``(rows, d)``
        The feature map's projection (``m = rows``, or ``2 rows`` for ``hyperbolic``).
    kv, log_shift : ndarrays, shapes ``(*batch, m, d_v + 1)`` and ``(*batch, m)``
        The incoming state (zeros and ``-inf`` for none).
    hyperbolic : bool
        The ``"hyperbolic"`` kind rather than ``"positive"``.
    scale : float
        The softmax scale.
    key_mask : bool ndarray, shape ``(*batch, L)``, optional
        True for keys that take part.
    chunk_size : int, default 64

    Returns
    -------
    (outputs, kv, log_shift, log_normaliser)
        Normalised outputs ``(*batch, L, d_v)``, the state after the keys and each
        output's log-denominator ``(*batch, L)`` (``-inf`` where it sees no key).

    Examples
    --------
    >>> import numpy as np
    >>> x = np.zeros((1, 3, 2)); v = np.arange(6.0).reshape(1, 3, 2)
    >>> state = np.zeros((1, 2, 3)), np.full((1, 2), -np.inf)
    >>> out, kv, mu, lse = forward(x, x, v, np.eye(2), *state, hyperbolic=False, scale=1.0)
    >>> out[0, :, 0], np.exp(lse[0])  # a running mean; t + 1 keys of weight 1
    (array([0., 1., 2.]), array([1., 2., 3.]))
    """
    call = CausalFusedCall(
        q, k, v, projection, hyperbolic, scale, key_mask, kv, log_shift, chunk_size
    )
    state, mu = call.kv, call.mu
    out = np.empty((call.n, call.length, call.dv), call.dtype)
    lse = np.empty((call.n, call.length), call.dtype)
    with _machinery.single_threaded_blas():
        _forward_fused.run(
            call.variant, *call.operands(), *call.fitted[:2], state, mu, call.chunk, out, lse,
        )  # fmt: skip
    results = call.shaped_results(out, state, mu, lse)
    return results[0], results[1], results[2], results[3]
