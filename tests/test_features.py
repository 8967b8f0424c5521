from __future__ import annotations

import numpy as np
import pytest
from conftest import Backend, assert_close
from reference import features64

import linattn as la

KINDS = ["positive", "hyperbolic", "trigonometric", "random_relu", "elu", "relu"]


def _map(kind: str, d: int = 8) -> la.FeatureMap:
    m = d if kind in ("elu", "relu") else 12
    return la.FeatureMap(d, m, kind=kind, seed=2)


@pytest.mark.parametrize("kind", KINDS)
def test_features_match_formulas_on_every_backend(backend: Backend, kind: str) -> None:
    fm = _map(kind)
    x = np.random.default_rng(0).normal(size=(3, 5, 8))
    out = fm.features(backend.asarray(x))
    assert_close(backend, out, features64(fm, x), rtol=1e-12, atol=1e-14, dtype="float64")


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "trigonometric"])
def test_log_features_are_logs_of_features(kind: str) -> None:
    fm = _map(kind)
    x = np.random.default_rng(1).normal(size=(4, 8))
    np.testing.assert_allclose(np.exp(fm.log_features(x)), features64(fm, x), rtol=1e-12)


def test_trigonometric_has_no_log_features() -> None:
    with pytest.raises(ValueError, match="not defined for kind='trigonometric'"):
        _map("trigonometric").log_features(np.zeros((1, 8)))


def test_hyperbolic_uses_half_the_rows() -> None:
    fm = la.FeatureMap(8, 12, kind="hyperbolic")
    assert fm.projection is not None and fm.projection.shape == (6, 8)
    assert fm.num_features == 12


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_half_precision_computes_in_float32(dtype: str) -> None:
    fm = _map("positive")
    out = fm.log_features(np.ones((2, 8), dtype=dtype))
    assert out.dtype == np.float32


def test_immutable_and_redraw() -> None:
    fm = la.FeatureMap(8, 16, seed=0)
    with pytest.raises(AttributeError, match="immutable"):
        fm.seed = 3  # type: ignore[misc]
    assert fm.projection is not None
    with pytest.raises(ValueError, match="read-only"):
        fm.projection[0, 0] = 1.0
    other = fm.redraw(seed=1)
    assert other.seed == 1 and other.fingerprint != fm.fingerprint
    assert fm.redraw(seed=0).fingerprint == fm.fingerprint
    fresh = fm.redraw()
    assert isinstance(fresh.seed, int) and fresh.fingerprint != fm.fingerprint
    assert (other.kind, other.num_features, other.scale) == (fm.kind, fm.num_features, fm.scale)


def test_from_projection_keeps_the_features(backend: Backend) -> None:
    original = la.FeatureMap(8, 16, kind="hyperbolic", seed=4)
    assert original.projection is not None
    adopted = la.FeatureMap.from_projection(
        backend.asarray(original.projection), kind="hyperbolic"
    )
    x = np.random.default_rng(3).normal(size=(5, 8))
    np.testing.assert_array_equal(adopted.features(x), original.features(x))
    assert adopted.fingerprint == original.fingerprint


def test_scale_is_applied_to_queries_and_keys() -> None:
    default = la.FeatureMap(4, 8, seed=0)
    assert default.scale == 0.5  # 1 / sqrt(head_dim)
    x = np.random.default_rng(0).normal(size=(3, 4))
    # scale s acts as s**0.5 on the inputs: s = 2 on x equals s = 0.5 on 2 x.
    np.testing.assert_allclose(
        la.FeatureMap(4, 8, scale=2.0, seed=0).log_features(x),
        default.log_features(2.0 * x),
        rtol=1e-12,
    )


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        ((0, 8), {}, ValueError, "head_dim must be a positive integer; got 0"),
        ((8, -2), {}, ValueError, "num_features must be a positive integer; got -2"),
        ((8, 8.0), {}, ValueError, "num_features must be a positive integer; got 8.0"),
        ((8, 7), {"kind": "hyperbolic"}, ValueError, "num_features must be even"),
        ((8, 16), {"kind": "elu"}, ValueError, "num_features must equal head_dim"),
        ((8, 16), {"kind": "softmax"}, ValueError, "kind must be one of"),
        ((8, 16), {"scale": -1.0}, ValueError, "scale must be a positive finite number"),
        ((8, 16), {"seed": -1}, ValueError, "seed must be a non-negative integer"),
        ((8, 16), {"norms": "unit"}, ValueError, "norms must be 'chi' or 'fixed'"),
        ((8, 16), {"kind": ["positive"]}, ValueError, "kind must be one of"),
        ((8, 16), {"orthogonal": "no"}, TypeError, "orthogonal must be True or False"),
        ((8, 16), {"scale": True}, ValueError, "scale must be a positive finite number"),
        ((8, 16), {"seed": True}, ValueError, "seed must be a non-negative integer"),
        ((8, 10**12), {}, ValueError, "num_features x head_dim must be at most 268435456"),
    ],
)
def test_bad_construction(args: tuple, kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        la.FeatureMap(*args, **kwargs)


@pytest.mark.parametrize(
    ("x", "error", "match"),
    [
        (np.ones((2, 5)), ValueError, r"x must have shape \(\.\.\., 8\).*got shape \(2, 5\)"),
        (np.ones((2, 8), dtype=np.int64), TypeError, "x must have a real floating dtype"),
        (np.ones((2, 8), dtype=np.complex128), TypeError, "got complex128"),
        ([[1.0] * 8], TypeError, "x must be an array"),
    ],
)
def test_bad_feature_input(x: object, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        la.FeatureMap(8, 16).log_features(x)


@pytest.mark.parametrize(
    ("matrix", "match"),
    [
        (np.ones(4), "must be a non-empty 2-d"),
        (np.full((2, 4), np.nan), "finite real floating"),
        (np.ones((2, 4), dtype=int), "finite real floating"),
    ],
)
def test_bad_projection(matrix: np.ndarray, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        la.FeatureMap.from_projection(matrix)


# -- OPRF and rebalancing (lower-variance estimators) --------------------------------

LOW_VARIANCE = [
    ("oprf", False),
    ("hyperbolic_oprf", False),
    ("positive", True),
    ("hyperbolic", True),
    ("hyperbolic_oprf", True),
]


def _calibration_data():
    rng = np.random.default_rng(5)
    scales = np.exp(rng.normal(size=8))
    q = rng.normal(size=(2, 30, 8)) * scales
    k = rng.normal(size=(2, 30, 8)) / scales
    return q, k


@pytest.mark.parametrize(("kind", "rebalance"), LOW_VARIANCE)
def test_calibrated_features_match_formulas(backend: Backend, kind: str, rebalance: bool) -> None:
    q, k = _calibration_data()
    reference_map = la.FeatureMap(8, 12, kind=kind, rebalance=rebalance, seed=3).calibrate(q, k)
    fm = la.FeatureMap(8, 12, kind=kind, rebalance=rebalance, seed=3).calibrate(
        backend.asarray(q), backend.asarray(k)
    )
    assert fm.fingerprint == reference_map.fingerprint or (
        np.allclose(fm.rebalance_scales, reference_map.rebalance_scales, rtol=1e-12)
        if rebalance
        else abs(fm.oprf_a - reference_map.oprf_a) < 1e-12  # type: ignore[operator]
    )
    for role in ("query", "key"):
        out = fm.features(backend.asarray(q), role=role)
        assert_close(backend, out, features64(reference_map, q, role), rtol=1e-10, dtype="float64")


def test_oprf_a_closed_form() -> None:
    from linattn.calibration import oprf_optimal_a

    for rho in (0.0, 0.3, 1.0, 5.0):
        a = oprf_optimal_a(rho)

        # A* minimises the variance G^(d/2) exp(rho d / (1 - 8A)) for large d, i.e. the
        # exponent log(1-4A)^2 - log(1-8A) (per d/2) + 2 rho / (1 - 8A): check stationarity.
        def exponent(a_: float, rho: float = rho) -> float:
            return 2 * np.log1p(-4 * a_) - np.log1p(-8 * a_) + 2 * rho / (1 - 8 * a_)

        h = 1e-6
        assert a <= 0 and abs(exponent(a + h) - exponent(a - h)) / (2 * h) < 1e-5
    assert oprf_optimal_a(0.0) == 0.0


def test_rebalancing_balances_energy_and_keeps_inner_products() -> None:
    q, k = _calibration_data()
    fm = la.FeatureMap(8, 12, rebalance=True).calibrate(q, k)
    psi = fm.rebalance_scales
    assert psi is not None
    np.testing.assert_allclose(
        np.mean((q * psi) ** 2, axis=(0, 1)), np.mean((k / psi) ** 2, axis=(0, 1)), rtol=1e-12
    )
    np.testing.assert_allclose(
        (q * psi) @ np.swapaxes(k / psi, -1, -2),
        q @ np.swapaxes(k, -1, -2),
        rtol=1e-12,
        atol=1e-12,
    )


def test_calibration_ignores_masked_keys() -> None:
    q, k = _calibration_data()
    mask = np.arange(30) < 20
    k_garbage = k.copy()
    k_garbage[:, 20:] = 1e3
    fm = la.FeatureMap(8, 12, kind="oprf", rebalance=True)
    a = fm.calibrate(q, k[:, :20])
    b = fm.calibrate(q, k_garbage, key_mask=mask)
    np.testing.assert_allclose(b.rebalance_scales, a.rebalance_scales, rtol=1e-12)
    assert abs(b.oprf_a - a.oprf_a) < 1e-12  # type: ignore[operator]


def test_uncalibrated_maps_refuse_features_and_causal_use() -> None:
    q, k = _calibration_data()
    fm = la.FeatureMap(8, 12, kind="oprf")
    with pytest.raises(
        ValueError, match=r"needs query/key statistics: expected a map from calibrate"
    ):
        fm.features(q)
    with pytest.raises(
        ValueError,
        match="causal attention needs the 'oprf' feature map's query/key statistics fixed",
    ):
        la.linear_attention(q, k, k, fm, causal=True)
    rebalanced = la.FeatureMap(8, 12, rebalance=True).calibrate(q, k)
    with pytest.raises(
        ValueError, match="role must be 'query' or 'key' for a rebalanced feature map"
    ):
        rebalanced.features(q)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kind": "elu", "rebalance": True}, "rebalance=True needs a softmax-estimating kind"),
        ({"kind": "positive", "rebalance": "yes"}, "rebalance must be True or False"),
    ],
)
def test_bad_low_variance_options(kwargs: dict, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        la.FeatureMap(8, 8, **kwargs)


def test_calibrate_checks_the_mask_and_ignores_masked_padding() -> None:
    x = np.random.default_rng(0).normal(size=(6, 8))
    fm = la.FeatureMap(8, 16, kind="oprf")
    with pytest.raises(TypeError, match="key_mask must be a boolean array; got dtype int64"):
        fm.calibrate(x, x, key_mask=np.arange(6))
    with pytest.raises(ValueError, match=r"key_mask must have shape \(\.\.\., 6\)"):
        fm.calibrate(x, x, key_mask=np.ones(5, bool))
    padded = x.copy()
    padded[4:] = np.nan  # padding may hold anything
    mask = np.arange(6) < 4
    calibrated = fm.calibrate(x, padded, key_mask=mask).oprf_a
    assert calibrated == pytest.approx(fm.calibrate(x, x[:4]).oprf_a, rel=1e-12)
    with pytest.raises(ValueError, match="calibrate needs finite q and"):
        fm.calibrate(x, padded)
    with pytest.raises(ValueError, match=r"k must have shape \(\.\.\., L, 8\) with L >= 1"):
        fm.calibrate(x, x[:0])


def test_with_statistics_validates() -> None:
    with pytest.raises(ValueError, match="oprf_a must be a number below 1/8"):
        la.FeatureMap(4, 8, kind="oprf").with_statistics(oprf_a=0.2)
    with pytest.raises(ValueError, match="oprf_a applies to kinds"):
        la.FeatureMap(4, 8).with_statistics(oprf_a=-0.1)
    with pytest.raises(ValueError, match="rebalance_scales must be 4 positive finite numbers"):
        la.FeatureMap(4, 8, rebalance=True).with_statistics(rebalance_scales=[1.0, 2.0])


def test_pickle_round_trip() -> None:
    import pickle

    q, k = _calibration_data()
    fm = la.FeatureMap(8, 12, kind="hyperbolic_oprf", rebalance=True, seed=2).calibrate(q, k)
    again = pickle.loads(pickle.dumps(fm))
    assert again.fingerprint == fm.fingerprint
    np.testing.assert_array_equal(again.features(q, role="key"), fm.features(q, role="key"))


# -- issue 16: statistics and options are checked ------------------------------------


@pytest.mark.parametrize("bad", [-np.inf, -1e308, np.nan, 2e-1, True, "0.1"])
def test_with_statistics_rejects_an_unusable_oprf_a(bad: object) -> None:
    with pytest.raises(ValueError, match=r"oprf_a must be a number below 1/8.*at least -10000"):
        la.FeatureMap(4, 8, kind="oprf").with_statistics(oprf_a=bad)  # type: ignore[arg-type]


def test_with_statistics_rejects_complex_rebalance_scales() -> None:
    fm = la.FeatureMap(4, 8, rebalance=True)
    with pytest.raises(
        TypeError, match="rebalance_scales must be 4 real numbers; got dtype complex"
    ):
        fm.with_statistics(rebalance_scales=np.array([1, 2, 3, 4]) * (1 + 1j))
    scaled = fm.with_statistics(rebalance_scales=np.array([1, 2, 3, 4]))  # integers are fine
    assert scaled.rebalance_scales is not None and scaled.rebalance_scales.dtype == np.float64


def test_calibrate_refuses_inputs_beyond_any_meaningful_estimate() -> None:
    x = np.random.default_rng(0).normal(size=(16, 4)) * 1e3
    with pytest.raises(ValueError, match=r"calibrate needs q and k of moderate size: .*rho"):
        la.FeatureMap(4, 8, kind="oprf").calibrate(x, x)


def test_calibrate_names_a_key_mask_that_does_not_broadcast() -> None:
    q = np.zeros((3, 6, 8))
    with pytest.raises(
        ValueError, match=r"must broadcast together; got key_mask \(2,\), k \(3,\)"
    ):
        la.FeatureMap(8, 16, kind="oprf").calibrate(q, q, key_mask=np.ones((2, 6), bool))


def test_feature_map_is_a_frozen_hashable_value() -> None:
    import dataclasses

    fm = la.FeatureMap(8, 16, seed=0)
    assert dataclasses.is_dataclass(fm) and hash(fm) == hash(fm)
    assert fm != la.FeatureMap(8, 16, seed=0)  # eq=False: identity, as JAX static args need
    assert {fm: 1}[fm] == 1
    with pytest.raises(dataclasses.FrozenInstanceError, match="immutable"):
        fm.kind = "hyperbolic"  # type: ignore[misc]


def test_an_equal_maps_death_leaves_the_live_one_found() -> None:
    """The torch operators find a map by fingerprint: with two equal maps alive, the
    death of one (the later made, or the earlier) must leave the other found."""
    import gc

    from linattn.features import feature_map_for

    w = np.eye(4)
    kept = la.FeatureMap.fitted(w, tied=True, far_weight=0.5)
    for _ in range(2):
        transient = la.FeatureMap.fitted(w, tied=True, far_weight=0.5)
        assert transient.fingerprint == kept.fingerprint
        del transient
        gc.collect()
        assert feature_map_for(kept.fingerprint) is kept
    other = la.FeatureMap.fitted(w, tied=True, far_weight=0.25)
    fingerprint = other.fingerprint
    del other
    gc.collect()
    assert feature_map_for(fingerprint) is None
