"""Gradients through the array-API path match finite differences (float64)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import Backend

import linattn as la

RNG = np.random.default_rng(11)
Q, K, V = (0.5 * RNG.normal(size=(2, 9, 4)) for _ in range(3))
MASK = np.array([True] * 7 + [False, True])
WEIGHTS = RNG.normal(size=(2, 9, 4))


def _loss_numpy(q, k, v, fm, causal):
    out = la.linear_attention(
        q, k, v, fm, causal=causal, key_mask=MASK, chunk_size=4, backend="array_api"
    )
    return float(np.sum(out * WEIGHTS))


DIRECTIONS = [RNG.normal(size=(3, *Q.shape)) for _ in range(4)]


def _directional_differences(fm, causal, eps=1e-6):
    """Central differences of the loss along random directions (one per q, k, v each)."""
    out = []
    for direction in DIRECTIONS:
        plus = [a + eps * u for a, u in zip((Q, K, V), direction, strict=True)]
        minus = [a - eps * u for a, u in zip((Q, K, V), direction, strict=True)]
        out.append((_loss_numpy(*plus, fm, causal) - _loss_numpy(*minus, fm, causal)) / (2 * eps))
    return np.array(out)


@pytest.fixture(scope="module", params=[False, True], ids=["bidirectional", "causal"])
def case(request):
    fm = la.FeatureMap(4, 8, kind="hyperbolic", seed=3)
    return fm, request.param, _directional_differences(fm, request.param)


# Central differences with eps = 1e-6: truncation ~eps^2 and rounding ~1e-16 / eps
# relative to the loss (of order 10 here).
RTOL, ATOL = 1e-6, 1e-8


def _torch_gradients(fm, causal):
    import torch

    args = [torch.asarray(a.copy(), requires_grad=True) for a in (Q, K, V)]
    out = la.linear_attention(
        *args, fm, causal=causal, key_mask=torch.asarray(MASK), chunk_size=4, backend="array_api"
    )
    (out * torch.asarray(WEIGHTS)).sum().backward()
    return [a.grad.numpy() for a in args]


def _jax_gradients(fm, causal):
    import jax

    jnp = jax.numpy

    def loss(q, k, v):
        out = la.linear_attention(
            q, k, v, fm, causal=causal, key_mask=jnp.asarray(MASK), chunk_size=4
        )
        return jnp.sum(out * jnp.asarray(WEIGHTS))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*(jnp.asarray(a) for a in (Q, K, V)))
    return [np.asarray(g) for g in grads]


AUTODIFF = {"torch": _torch_gradients, "jax": _jax_gradients}


def test_autodiff_matches_finite_differences(backend: Backend, case) -> None:
    if backend.name not in AUTODIFF:
        pytest.skip(f"{backend.name} has no automatic differentiation")
    fm, causal, expected = case
    grads = AUTODIFF[backend.name](fm, causal)
    along = np.array(
        [sum(np.sum(g * u) for g, u in zip(grads, d, strict=True)) for d in DIRECTIONS]
    )
    np.testing.assert_allclose(along, expected, rtol=RTOL, atol=ATOL)


@pytest.mark.needs("torch")
def test_torch_gradcheck_softmax_reference() -> None:
    torch = pytest.importorskip("torch")
    args = [torch.asarray(a.copy(), requires_grad=True) for a in (Q, K, V)]
    assert torch.autograd.gradcheck(
        lambda q, k, v: la.softmax_attention(q, k, v, causal=True), args
    )
