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
