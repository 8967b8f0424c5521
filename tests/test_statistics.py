"""Statistical properties of the random-feature estimators.

Thresholds come from the estimators' sampling distributions, not from tuning:
each check compares a mean over N independent projection draws with its standard
error (the sample standard deviation over sqrt(N)) and allows |z| <= 5, a false
alarm rate below 1e-6 for a normal statistic.  ``test_unbiased_test_has_power``
shows that the same check rejects a projection known to be biased.
"""

from __future__ import annotations

import numpy as np
import pytest

import linattn as la

Z_MAX = 5.0
DRAWS = 2000
RANDOM_KINDS = ["positive", "hyperbolic", "trigonometric"]


def _kernel_pair(d: int = 16) -> tuple[np.ndarray, np.ndarray, float]:
    # |s^(1/2) (x + y)|^2 ~ 2, so a single positive feature has relative variance
    # exp(2) - 1 ~ 6.4 and the mean of 2000 draws of m = 32 features a standard
    # error near 1 %.
    rng = np.random.default_rng(7)
    x, y = 0.5 * rng.normal(size=d), 0.5 * rng.normal(size=d)
    return x, y, float(np.exp(x @ y / np.sqrt(d)))


def _z_score(make_map, draws: int = DRAWS) -> float:
    x, y, exact = _kernel_pair()
    ratios = np.empty(draws)
    for seed in range(draws):
        fm = make_map(seed)
        phi_x, phi_y = fm.features(x, role="query"), fm.features(y, role="key")
        ratios[seed] = float(phi_x @ phi_y) / exact
    return float((ratios.mean() - 1.0) / (ratios.std(ddof=1) / np.sqrt(draws)))


@pytest.mark.parametrize("orthogonal", [True, False], ids=["orthogonal", "iid"])
@pytest.mark.parametrize("kind", RANDOM_KINDS)
def test_estimator_is_unbiased(kind: str, orthogonal: bool) -> None:
    z = _z_score(lambda seed: la.FeatureMap(16, 32, kind=kind, orthogonal=orthogonal, seed=seed))
    assert abs(z) <= Z_MAX, f"mean of phi(x).phi(y) / exp(x.y) is {z:.1f} standard errors from 1"


@pytest.mark.parametrize(
    ("kind", "rebalance"),
    [("oprf", False), ("hyperbolic_oprf", False), ("positive", True), ("hyperbolic_oprf", True)],
)
def test_low_variance_estimators_are_unbiased(kind: str, rebalance: bool) -> None:
    # Statistics from skewed data (keys 3x queries) so that A* < 0 and Psi != 1.
    x, y, _ = _kernel_pair()
    base = la.FeatureMap(16, 32, kind=kind, rebalance=rebalance).calibrate(
        x[None, :], 3 * y[None, :]
    )
    assert base.oprf_a is None or base.oprf_a < -0.05
    z = _z_score(lambda seed: base.redraw(seed=seed))
    assert abs(z) <= Z_MAX, f"mean of phi(x).phi(y) / exp(x.y) is {z:.1f} standard errors from 1"


def test_unbiased_test_has_power() -> None:
    """Plain QR without the sign fix (docs/algorithm.md, section 4) is biased; the test sees it."""
    d = 16

    def unfixed_qr(seed: int) -> la.FeatureMap:
        rng = np.random.default_rng(seed)
        blocks = [np.linalg.qr(rng.standard_normal((d, d)))[0] for _ in range(2)]
        lengths = np.sqrt(rng.chisquare(d, size=2 * d))
        return la.FeatureMap.from_projection(np.concatenate(blocks) * lengths[:, None])

    assert abs(_z_score(unfixed_qr)) > Z_MAX


def _seed_experiment(m: int, draws: int, **map_options) -> np.ndarray:
    """Attention MSE of the handbook's experiment (docs/algorithm.md, section 15)."""
    rng = np.random.default_rng(42)
    n, d = 64, 32
    q, k = 0.3 * rng.normal(size=(n, d)), 0.3 * rng.normal(size=(n, d))
    v = rng.normal(size=(n, d))
    exact = la.softmax_attention(q, k, v)
    errors = np.empty(draws)
    for seed in range(draws):
        fm = la.FeatureMap(d, m, seed=seed, **map_options)
        errors[seed] = np.mean((la.linear_attention(q, k, v, fm) - exact) ** 2)
    return errors


@pytest.mark.slow
def test_orthogonal_error_below_iid() -> None:
    orthogonal = _seed_experiment(64, 300, orthogonal=True)
    iid = _seed_experiment(64, 300, orthogonal=False)
    diff_se = np.sqrt(orthogonal.var(ddof=1) / 300 + iid.var(ddof=1) / 300)
    z = (iid.mean() - orthogonal.mean()) / diff_se
    # One-sided: orthogonal must be lower by more than 3 standard errors.
    assert z > 3.0, f"orthogonal MSE {orthogonal.mean():.3g} vs iid {iid.mean():.3g} (z = {z:.1f})"


@pytest.mark.slow
@pytest.mark.parametrize(
    "map_options",
    [
        {"kind": "positive", "orthogonal": False},
        {"kind": "positive", "orthogonal": True},
        {"kind": "hyperbolic", "orthogonal": True},
    ],
    ids=["positive-iid", "positive-orthogonal", "hyperbolic-orthogonal"],
)
def test_error_falls_as_one_over_m(map_options: dict) -> None:
    """Variance O(1/m): the fitted log-log slope of MSE against m lies in [-1.3, -0.7]."""
    ms = np.array([32, 64, 128, 256, 512])
    mse = np.array([_seed_experiment(int(m), 50, **map_options).mean() for m in ms])
    slope = np.polyfit(np.log(ms), np.log(mse), 1)[0]
    assert -1.3 <= slope <= -0.7, f"slope {slope:.2f}, MSE {mse}"


def _anisotropic_error(draws: int, **map_options) -> np.ndarray:
    rng = np.random.default_rng(0)
    d, n = 16, 64
    scales = np.exp(rng.normal(size=d))
    q = 0.35 * rng.normal(size=(n, d)) * scales
    k = 0.35 * rng.normal(size=(n, d)) / scales
    v = rng.normal(size=(n, d))
    exact = la.softmax_attention(q, k, v)
    return np.array(
        [
            np.mean(
                (la.linear_attention(q, k, v, la.FeatureMap(d, 64, seed=s, **map_options)) - exact)
                ** 2
            )
            for s in range(draws)
        ]
    )


@pytest.mark.slow
def test_rebalancing_lowers_error_when_scales_differ() -> None:
    plain = _anisotropic_error(100, kind="hyperbolic")
    rebalanced = _anisotropic_error(100, kind="hyperbolic", rebalance=True)
    diff_se = np.sqrt(plain.var(ddof=1) / 100 + rebalanced.var(ddof=1) / 100)
    z = (plain.mean() - rebalanced.mean()) / diff_se
    assert z > 3.0, (
        f"rebalanced MSE {rebalanced.mean():.3g} vs plain {plain.mean():.3g} (z = {z:.1f})"
    )
