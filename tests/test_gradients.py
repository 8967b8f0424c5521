"""Gradients through the array-API path match finite differences (float64)."""

from __future__ import annotations

import numpy as np
import pytest

import linattn as la

RNG = np.random.default_rng(11)
Q, K, V = (0.5 * RNG.normal(size=(2, 9, 4)) for _ in range(3))
MASK = np.array([True] * 7 + [False, True])
WEIGHTS = RNG.normal(size=(2, 9, 4))


def _loss_numpy(q, k, v, fm, causal):
    out = la.linear_attention(q, k, v, fm, causal=causal, key_mask=MASK, chunk_size=4, backend="array_api")
    return float(np.sum(out * WEIGHTS))


def _finite_differences(fm, causal, eps=1e-6):
    grads = []
    args = [Q.copy(), K.copy(), V.copy()]
    for i, a in enumerate(args):
        g = np.zeros_like(a)
        for idx in np.ndindex(a.shape):
            plus = [x.copy() for x in args]
            minus = [x.copy() for x in args]
            plus[i][idx] += eps
            minus[i][idx] -= eps
            g[idx] = (_loss_numpy(*plus, fm, causal) - _loss_numpy(*minus, fm, causal)) / (2 * eps)
        grads.append(g)
    return grads


@pytest.fixture(scope="module", params=[False, True], ids=["bidirectional", "causal"])
def case(request):
    fm = la.FeatureMap(4, 8, kind="hyperbolic", seed=3)
    return fm, request.param, _finite_differences(fm, request.param)


# Central differences with eps = 1e-6: truncation ~eps^2 and rounding ~1e-16 / eps.
RTOL, ATOL = 1e-6, 1e-8


def test_torch_autograd_matches_finite_differences(case) -> None:
    torch = pytest.importorskip("torch")
    fm, causal, expected = case
    args = [torch.asarray(a.copy(), requires_grad=True) for a in (Q, K, V)]
    out = la.linear_attention(
        *args, fm, causal=causal, key_mask=torch.asarray(MASK), chunk_size=4, backend="array_api"
    )
    (out * torch.asarray(WEIGHTS)).sum().backward()
    for arg, exp in zip(args, expected, strict=True):
        np.testing.assert_allclose(arg.grad.numpy(), exp, rtol=RTOL, atol=ATOL)


def test_jax_grad_matches_finite_differences(case) -> None:
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    fm, causal, expected = case

    def loss(q, k, v):
        out = la.linear_attention(q, k, v, fm, causal=causal, key_mask=jnp.asarray(MASK), chunk_size=4)
        return jnp.sum(out * jnp.asarray(WEIGHTS))

    grads = jax.grad(loss, argnums=(0, 1, 2))(*(jnp.asarray(a) for a in (Q, K, V)))
    for g, exp in zip(grads, expected, strict=True):
        np.testing.assert_allclose(np.asarray(g), exp, rtol=RTOL, atol=ATOL)


def test_torch_gradcheck_softmax_reference() -> None:
    torch = pytest.importorskip("torch")
    args = [torch.asarray(a.copy(), requires_grad=True) for a in (Q, K, V)]
    assert torch.autograd.gradcheck(
        lambda q, k, v: la.softmax_attention(q, k, v, causal=True), args
    )
