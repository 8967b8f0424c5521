"""``linear_attention_vjp`` against torch autograd of the array-API path and finite differences."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import Backend, assert_close

import linattn as la

KINDS = ["positive", "hyperbolic", "random_relu", "trigonometric", "elu", "relu"]
# Statistics-based maps: (kind, rebalance); causal use needs them calibrated first.
CALIBRATED = [("oprf", False), ("hyperbolic_oprf", True), ("positive", True)]


def _inputs(seed: int = 0) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    q, k = (0.7 * rng.normal(size=(2, 37, 8)) for _ in range(2))
    v = rng.normal(size=(1, 37, 5))  # broadcast over the batch
    mask = rng.random((2, 37)) > 0.25
    g = rng.normal(size=(2, 37, 5))
    return q, k, v, mask, g


def _feature_map(kind: str) -> la.FeatureMap:
    return la.FeatureMap(8, 8 if kind in ("elu", "relu") else 16, kind=kind, seed=0)


def _autograd(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray, g: np.ndarray, **kw: object
) -> tuple[np.ndarray, ...]:
    torch = pytest.importorskip("torch")
    leaves = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
    out = la.linear_attention(*leaves, key_mask=torch.tensor(mask), backend="array_api", **kw)
    return tuple(t.numpy() for t in torch.autograd.grad((out * torch.tensor(g)).sum(), leaves))


@pytest.mark.parametrize("backend_name", ["auto", "array_api"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_vjp_equals_torch_autograd(kind: str, causal: bool, backend_name: str) -> None:
    q, k, v, mask, g = _inputs()
    fm = _feature_map(kind)
    expected = _autograd(q, k, v, mask, g, feature_map=fm, causal=causal, chunk_size=8)
    got = la.linear_attention_vjp(
        q, k, v, fm, g, causal=causal, key_mask=mask, chunk_size=8, backend=backend_name
    )
    for name, actual, ref in zip("qkv", got, expected, strict=True):
        assert actual.shape == ref.shape and actual.dtype == ref.dtype, name
        np.testing.assert_allclose(actual, ref, rtol=1e-10, atol=1e-12 * np.abs(ref).max())


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("kind", "rebalance"), CALIBRATED)
def test_vjp_of_calibrated_maps_equals_torch_autograd(
    kind: str, rebalance: bool, causal: bool
) -> None:
    q, k, v, mask, g = _inputs()
    fm = la.FeatureMap(8, 16, kind=kind, rebalance=rebalance, seed=0)
    if causal:
        fm = fm.calibrate(q, k)
    expected = _autograd(q, k, v, mask, g, feature_map=fm, causal=causal, chunk_size=8)
    got = la.linear_attention_vjp(q, k, v, fm, g, causal=causal, key_mask=mask, chunk_size=8)
    for actual, ref in zip(got, expected, strict=True):
        np.testing.assert_allclose(actual, ref, rtol=1e-10, atol=1e-12 * np.abs(ref).max())


@pytest.mark.parametrize("causal", [False, True])
def test_vjp_equals_finite_differences(causal: bool) -> None:
    q, k, v, mask, g = _inputs(1)
    fm = _feature_map("hyperbolic")

    def loss(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> float:
        out = la.linear_attention(q, k, v, fm, causal=causal, key_mask=mask, chunk_size=8)
        return float((out * g).sum())

    grads = la.linear_attention_vjp(q, k, v, fm, g, causal=causal, key_mask=mask, chunk_size=8)
    rng = np.random.default_rng(2)
    step = 1e-5  # central differences: truncation ~ step**2, rounding ~ 1e-16 / step
    for which, grad in enumerate(grads):
        arrays = [q, k, v]
        for _ in range(4):
            index = tuple(int(rng.integers(n)) for n in arrays[which].shape)
            plus, minus = [a.copy() for a in arrays], [a.copy() for a in arrays]
            plus[which][index] += step
            minus[which][index] -= step
            numeric = (loss(*plus) - loss(*minus)) / (2 * step)
            assert abs(numeric - grad[index]) < 1e-7 * max(1.0, abs(numeric)), (which, index)


def test_vjp_float32_matches_float64() -> None:
    q, k, v, mask, g = _inputs(3)
    fm = _feature_map("positive")
    ref = la.linear_attention_vjp(q, k, v, fm, g, causal=True, key_mask=mask)
    low = [x.astype(np.float32) for x in (q, k, v)]
    got = la.linear_attention_vjp(*low, fm, g.astype(np.float32), causal=True, key_mask=mask)
    for actual, expected in zip(got, ref, strict=True):
        assert actual.dtype == np.float32
        np.testing.assert_allclose(actual, expected, rtol=0, atol=2e-5 * np.abs(expected).max())


@pytest.mark.parametrize("causal", [False, True])
def test_vjp_on_every_backend(backend: Backend, causal: bool) -> None:
    q, k, v, mask, g = _inputs(4)
    fm = _feature_map("positive")
    expected = la.linear_attention_vjp(q, k, v, fm, g, causal=causal, key_mask=mask)
    got = la.linear_attention_vjp(
        *(backend.asarray(x) for x in (q, k, v)),
        fm,
        backend.asarray(g),
        causal=causal,
        key_mask=backend.asarray(mask),
    )
    for actual, ref in zip(got, expected, strict=True):
        assert_close(backend, actual, ref, rtol=1e-9, atol=1e-12, dtype="float64")


def test_vjp_of_large_inputs_warns_of_nothing() -> None:
    """Large log-features: no overflow computed and then discarded (warnings are errors)."""
    x = 30 * np.random.default_rng(5).normal(size=(1, 5, 16))
    fm = la.FeatureMap(16, 32, seed=0)
    grads = la.linear_attention_vjp(
        x, x, x, fm, np.ones((1, 5, 16)), causal=True, backend="array_api"
    )
    assert all(np.all(np.isfinite(g)) for g in grads)


def test_vjp_bad_inputs() -> None:
    q, k, v, _, g = _inputs()
    fm = _feature_map("positive")
    with pytest.raises(ValueError, match=r"grad_output must have the output's shape \(2, 37, 5\)"):
        la.linear_attention_vjp(q, k, v, fm, g[:, :3])
    with pytest.raises(TypeError, match="grad_output must have a real floating dtype"):
        la.linear_attention_vjp(q, k, v, fm, g.astype(np.int64))
    with pytest.raises(TypeError, match=r"feature_map must be a linattn\.FeatureMap"):
        la.linear_attention_vjp(q, k, v, "positive", g)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="q and k must have head dimension 4"):
        la.linear_attention_vjp(q, k, v, la.FeatureMap(4, 8), g)
    with pytest.raises(ValueError, match="backend must be one of"):
        la.linear_attention_vjp(q, k, v, fm, g, backend="cuda")
    with pytest.raises(ValueError, match="chunk_size must be a positive integer"):
        la.linear_attention_vjp(q, k, v, fm, g, causal=True, chunk_size=0)


def test_vjp_numba_backend_rejects_signed_features() -> None:
    pytest.importorskip("numba")
    q, k, v, _, g = _inputs()
    with pytest.raises(ValueError, match="positive features only"):
        la.linear_attention_vjp(
            q, k, v, _feature_map("trigonometric"), g, causal=True, backend="numba"
        )
