"""The one-pass hybrid kernels keep their precision at any weight scale of a fitted map.

A sharply peaked fitted map (weights x1e4 and x1e16 in float64, x1e3 and x1e7 in
float32) puts log-features at ``-1e16``; on the commit before, the one-pass hybrid
kernels were off by 0.4 to 0.7 against the dense form there (three causes: the key head's
``log g`` rounded away in a log-feature of magnitude 1e16; a chunk's shared shift raised
by keys the query does not weigh, which underflowed every term of a row and lost its far
keys; shifts of magnitude 1e16 whose rounding entered every weight).  The reference is
the dense form in float64 (``linattn._fitted_call.dense_hybrid``: features as
probabilities, no shifts); the tolerance is the dtype's rounding over the ``O(1)``
outputs (the sums are of positive terms, so no cancellation widens it).
"""

from __future__ import annotations

import numpy as np
import pytest

import linattn as la
from linattn._fitted_call import dense_hybrid

pytest.importorskip("numba")

#: (dtype, weight scale, tolerance: about 4000 ulp of an O(1) output)
CASES = [
    ("float64", 1e4, 1e-12), ("float64", 1e16, 1e-12),
    ("float32", 1e3, 5e-4), ("float32", 1e7, 5e-4),
]  # fmt: skip
OPTIONS = [
    {"window": 3, "sink_keys": 2},
    {"window": 3, "sink_keys": 2, "causal": True},
    {"window": 20, "sink_keys": 1},
    {"window": 20, "causal": True},
]


@pytest.mark.parametrize(("dtype", "scale", "tolerance"), CASES)
def test_one_pass_hybrid_kernels_at_large_weights(
    dtype: str, scale: float, tolerance: float
) -> None:
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 2, 70, 8)).astype(dtype) for _ in range(3))
    weight = (rng.standard_normal((2, 8, 4)) * scale).astype(dtype)
    far = np.array([0.5, 2.0], dtype)
    fm = la.FeatureMap.fitted(weight, tied=True, far_weight=far)
    for options in OPTIONS:
        plan = la.plan_attention(q, k, v, fm, backend="numba", **options)
        assert plan.executor.startswith("hybrid-") and plan.executor.endswith("-fused")
        out = la.linear_attention(q, k, v, fm, backend="numba", **options)
        reference = dense_hybrid(
            *(x.astype(np.float64) for x in (q, k, v)), weight.astype(np.float64), tied=True,
            far_weight=far.astype(np.float64), **options,
        )  # fmt: skip
        np.testing.assert_allclose(out, reference, rtol=0, atol=tolerance, err_msg=str(options))


def _log_domain_reference(q, k, v, weight, floor):  # type: ignore[no-untyped-def]
    """Bidirectional attention with a fitted map (no exact parts: ``g`` cancels) in the
    log domain, float64: ``log w_ij = logsumexp_f(l(q_i)_f + l(k_j)_f)`` per pair, the
    log-features floored as the library floors them (no shift, no factorisation)."""

    def log_features(x):  # type: ignore[no-untyped-def]
        u = np.einsum("bhld,hdm->bhlm", x, weight)
        u = np.concatenate([u, -u], axis=-1)
        top = u.max(axis=-1, keepdims=True)
        log_phi = u - top - np.log(np.exp(u - top).sum(axis=-1, keepdims=True))
        return np.maximum(log_phi, floor)

    pairs = log_features(q)[..., :, None, :] + log_features(k)[..., None, :, :]
    top = pairs.max(axis=-1)
    logits = top + np.log(np.exp(pairs - top[..., None]).sum(axis=-1))
    weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return (weights / weights.sum(axis=-1, keepdims=True)) @ v


@pytest.mark.parametrize("scale", [1e4, 1e16])
@pytest.mark.parametrize("backend", ["array_api", "numba"])
def test_plain_calls_at_large_weights_against_the_log_domain(scale: float, backend: str) -> None:
    """(Weights x1e8 put log-features at -1e8, whose rounding in the scans' shifts was
    off by 0.37 before the floor; the dense form, which takes features as probabilities,
    loses such rows: the reference here is per pair, in the log domain.)"""
    from linattn.fitted import LOG_FLOOR

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 2, 70, 8)) for _ in range(3))
    weight = rng.standard_normal((2, 8, 4)) * scale
    fm = la.FeatureMap.fitted(weight, tied=True, far_weight=np.array([0.5, 2.0]))
    out = la.linear_attention(q, k, v, fm, backend=backend)
    reference = _log_domain_reference(q, k, v, weight, LOG_FLOOR["float64"])
    np.testing.assert_allclose(out, reference, rtol=0, atol=1e-12)
