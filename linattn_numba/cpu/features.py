"""Feature primitives: log-features of the fused passes, blocks of them, their VJP.

``l(x) = s^(1/2) P x - s |x|^2 / 2 - log(m) / 2`` (``"positive"``; ``"hyperbolic"`` has
both signs of the projection), computed :data:`FEATURE_BLOCK` tokens at a time by the
fused causal, bidirectional, hybrid and decoding passes (``docs/algorithm.md``, section
"Feature maps"); a fitted map's ``l(x) = [u, -u] - logsumexp([u, -u]) + c``, ``u = x W +
b`` (:func:`fitted_log_features`, the one-pass hybrid kernels).  Scalar loops and BLAS
products only: no policy.
"""

from __future__ import annotations

import numpy as np

from linattn_numba import _machinery
from linattn_numba.cpu.scalars import fast_exp, log_floor

__all__ = [
    "FEATURE_BLOCK",
    "LANES",
    "block_log_features",
    "exp_row",
    "feature_scratch",
    "features_vjp",
    "fitted_log_features",
    "key_block",
    "key_factors",
    "log_features",
    "project",
    "query_block",
    "query_factors",
    "scaled_half_norm",
]

_jit = _machinery.jit


@_jit(fastmath=frozenset({"contract", "reassoc"}))
def scaled_half_norm(x, root_half_scale):
    """``scale |x|^2 / 2`` of a row as ``sum((sqrt(scale / 2) x)**2)``: scaled before
    squaring, so that it overflows only where the result does; summed in any order (so
    that it vectorises)."""
    total = x[0] - x[0]
    for e in range(x.shape[0]):
        y = x[e] * root_half_scale
        total += y * y
    return total


@_jit()
def log_features(x, projection, consts, hyperbolic, proj, out):
    """``FeatureMap.signed_log_features`` for "positive"/"hyperbolic" kinds, one block.

    ``projection`` is the feature map's, times ``sqrt(scale)``; ``consts = [scale / 2,
    log(m) / 2]`` in the compute dtype.  ``l(x) = +-(sqrt(scale) x) W^T - scale |x|^2 / 2
    - log(m) / 2``: the array-API formula, rounded differently (within a few ulp).
    Where ``scale |x|^2 / 2`` overflows, ``l(x)`` is below the float range: ``-inf``
    exactly (the projection may overflow too, and ``inf - inf`` would be NaN); NaN
    inputs stay NaN.  ``proj`` is scratch for the hyperbolic kind (the positive kind
    projects into ``out``).
    """
    c = x.shape[0]
    rows = projection.shape[0]
    width = out.shape[1]
    # locals, so that the loops vectorise
    root_half_scale, log_root_m = np.sqrt(consts[0]), consts[1]
    target = proj if hyperbolic else out
    np.dot(x, projection.T, target)
    for i in range(c):
        half_norm = scaled_half_norm(x[i], root_half_scale)
        if half_norm == np.inf:
            for r in range(width):
                out[i, r] = -np.inf
            continue
        offset = half_norm + log_root_m
        if not hyperbolic:  # in place (through two names of one array: 85 vs 75 us a block)
            for r in range(rows):
                out[i, r] -= offset
            continue
        for r in range(rows):
            out[i, r] = target[i, r] - offset
            out[i, rows + r] = -target[i, r] - offset


@_jit()
def fitted_log_features(x, weight, bias, shift, proj, out):
    """``linattn.fitted.log_features`` of one block: ``l(x) = [u, -u] - logsumexp([u,
    -u]) + shift``, ``u = x W + b`` (``weight`` ``(d, n)``, ``bias`` ``(n,)``, ``out``
    ``(c, 2 n)``, ``proj`` ``(c, n)`` scratch; ``shift`` is a key head's ``log g``, 0
    for queries).  ``logsumexp`` is shifted by ``max |u|``; NaN inputs stay NaN.
    The map's entries are floored at :func:`~linattn_numba.cpu.scalars.log_floor` before
    ``shift`` is added (no output changes: a product with one is below the float range;
    the passes' shifts stay bounded).
    """
    c = x.shape[0]
    n = weight.shape[1]
    np.dot(x, weight, proj)
    floor = log_floor(shift)
    for i in range(c):
        top = proj[i, 0] - proj[i, 0]
        for r in range(n):
            u = proj[i, r] + bias[r]
            proj[i, r] = u
            top = max(top, abs(u))
        total = top - top
        for r in range(n):
            total += fast_exp(proj[i, r] - top) + fast_exp(-proj[i, r] - top)
        # ``u - top`` first, then the small terms: ``top + log(total) - shift`` rounded
        # ``log g`` away at large weights (|u| ~ 1e16: a ulp of 2).
        offset = np.log(total)
        for r in range(n):
            plus = (proj[i, r] - top) - offset
            minus = (-proj[i, r] - top) - offset
            # floored before the shift: a head with g = 0 (shift -inf) keeps no far keys
            out[i, r] = (floor if plus < floor else plus) + shift  # (NaN stays)
            out[i, n + r] = (floor if minus < floor else minus) + shift


@_jit()
def block_log_features(x, projection, consts, hyperbolic, weight, bias, shift, proj, out):
    """Log-features of one block, the one place that tells a fitted map from a random
    one, by ``weight``: with columns (``(d, m/2)``) a fitted map's
    (:func:`fitted_log_features`, with ``bias`` and ``shift``, a key head's ``log g`` or
    0), empty (``(0, 0)``) ``projection``'s random features (:func:`log_features`).
    ``proj`` is the scratch :func:`feature_scratch` sizes."""
    if weight.shape[1] > 0:
        fitted_log_features(x, weight, bias, shift, proj, out)
    else:
        log_features(x, projection, consts, hyperbolic, proj, out)


@_jit()
def feature_scratch(rows, projection, hyperbolic, weight, like):
    """Scratch ``proj`` of :func:`block_log_features` for ``rows`` tokens, ``like``'s
    dtype: ``(rows, m/2)`` for a fitted map, ``(rows, P)`` for the hyperbolic kind,
    empty for the positive kind (which projects into its output)."""
    if weight.shape[1] > 0:
        return np.empty((rows, weight.shape[1]), like.dtype)
    return np.empty((rows if hyperbolic else 0, projection.shape[0]), like.dtype)


#: The fused pass computes features for this many tokens at a time (whole chunks): the
#: projection is a ``(FEATURE_BLOCK x d) @ (d x m)`` product, which BLAS runs about twice
#: as fast as one chunk's ``(64 x d) @ (d x m)`` (measured, one thread, d = 64, m = 256).
FEATURE_BLOCK = 256


@_jit()
def key_block(k, v, mask, projection, consts, hyperbolic, proj, lk, va):
    """Key log-features ``lk`` and ``va = [v | 1]`` of one block; a masked key gets
    ``-inf`` features and zero values (no features, no padding values)."""
    n = lk.shape[0]
    dv = v.shape[1]
    m = lk.shape[1]
    log_features(k, projection, consts, hyperbolic, proj, lk)
    for i in range(n):
        for e in range(dv):
            va[i, e] = v[i, e]
        va[i, dv] = 1
        if not mask[i]:
            for r in range(m):
                lk[i, r] = -np.inf
            for e in range(dv):
                va[i, e] = 0


#: Lanes of the per-row maximum in :func:`query_block`: a running maximum per lane is
#: an elementwise ``max`` that vectorises (a scalar ``max`` reduction over floats does
#: not without fast-math flags that assume no NaN); measured 2.4x faster, m = 256.
LANES = 16


@_jit()
def project(x, projection, hyperbolic, proj, out):
    """``out = +-(sqrt(s) x) W^T``: the log-features without their per-row offset
    ``s |x|^2 / 2 + log(m) / 2`` (``proj`` is scratch for the hyperbolic kind)."""
    rows = projection.shape[0]
    if not hyperbolic:
        np.dot(x, projection.T, out)
        return
    np.dot(x, projection.T, proj)
    for i in range(x.shape[0]):
        for r in range(rows):
            out[i, r] = proj[i, r]
            out[i, rows + r] = -proj[i, r]


@_jit(fastmath=frozenset({"contract", "reassoc"}))
def exp_row(u, i, f, z):
    """``u[i] = exp(u[i] - f)`` in place; returns ``u[i] . z`` (summed in any order)."""
    total = u[i, 0] - u[i, 0]
    for r in range(u.shape[1]):
        p = fast_exp(u[i, r] - f)
        u[i, r] = p
        total += p * z[r]
    return total


@_jit()
def query_factors(u, ms, lanes, z, den, tops):
    """``u_t = exp(u_t + ms - F_t)`` in place (``F_t`` the row's maximum, 0 where not
    finite, into ``tops``) and ``den_t = u_t . z``; ``lanes`` is scratch of
    :data:`LANES` entries."""
    n, m = u.shape
    zero = ms[0] - ms[0]
    whole = m - m % LANES
    for i in range(n):
        row = u[i]
        for r in range(m):
            row[r] += ms[r]
        lanes[:] = row[0]
        for r0 in range(0, whole, LANES):
            for lane in range(LANES):
                x = row[r0 + lane]
                lanes[lane] = x if x > lanes[lane] else lanes[lane]
        f = lanes[0]
        for lane in range(1, LANES):
            if lanes[lane] > f:
                f = lanes[lane]
        for r in range(whole, m):
            if row[r] > f:
                f = row[r]
        if not np.isfinite(f):
            f = zero
        tops[i] = f
        den[i] = exp_row(u, i, f, z)


@_jit()
def query_block(x, projection, consts, hyperbolic, proj, ms, lanes, z, u, den, scale):
    """``u_t = exp(l(q_t) + ms - F_t)`` of one block of queries into ``u``, their
    denominators ``den_t = u_t . z`` (``z = S[:, d_v]``) and log-scales ``scale_t``: the
    true ``[num | den]`` is ``exp(scale_t) [u_t S]``.

    ``F_t = max_r (l(q_t) + ms)_r`` absorbs ``l``'s per-row offset ``o_t = s |q_t|^2 / 2
    + log(m) / 2``, so that is not subtracted from the projection, only from the scale
    (``scale_t = F_t - o_t``).  A row whose ``s |x|^2 / 2`` overflows has no features
    (``l = -inf``): ``u_t = 0``.
    """
    root_half_scale = np.sqrt(consts[0])
    project(x, projection, hyperbolic, proj, u)
    query_factors(u, ms, lanes, z, den, scale)
    for i in range(u.shape[0]):
        half_norm = scaled_half_norm(x[i], root_half_scale)
        scale[i] -= half_norm + consts[1]
        if half_norm == np.inf:
            for r in range(u.shape[1]):
                u[i, r] = 0
            den[i] = 0


@_jit()
def key_factors(lk, ms):
    """``phi_j = exp(l(k_j) - ms)`` in place of ``lk``: the keys as the final state holds them."""
    n, m = lk.shape
    for j in range(n):
        for r in range(m):
            lk[j, r] = fast_exp(lk[j, r] - ms[r])


@_jit()
def features_vjp(x, d_log, projection, consts, hyperbolic, d_proj, dx):
    """``dx`` from the cotangent ``d_log`` of :func:`linattn_numba.cpu.features.log_features`.

    ``l(x) = +-P x - s |x|^2 / 2 - c``: ``dx = (d_+ - d_-) P - s x sum_r d_r``; rows
    whose ``s |x|^2 / 2`` overflows have constant (``-inf``) features: ``dx = 0``.
    """
    n = x.shape[0]
    rows = projection.shape[0]
    width = d_log.shape[1]
    d = x.shape[1]
    root_half_scale = np.sqrt(consts[0])
    scale = consts[0] + consts[0]  # (2 * x would be float64)
    if hyperbolic:
        for i in range(n):
            for r in range(rows):
                d_proj[i, r] = d_log[i, r] - d_log[i, rows + r]
        np.dot(d_proj, projection, dx)
    else:
        np.dot(d_log, projection, dx)
    for i in range(n):
        if scaled_half_norm(x[i], root_half_scale) == np.inf:
            for e in range(d):
                dx[i, e] = 0
            continue
        total = d_log[i, 0] - d_log[i, 0]
        for r in range(width):
            total += d_log[i, r]
        weight = scale * total
        for e in range(d):
            dx[i, e] -= weight * x[i, e]
