"""linattn.flax: the nnx module under nnx.jit and nnx.grad, its projection variable and
its decoding state."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
nnx = pytest.importorskip("flax.nnx")

import jax.numpy as jnp  # noqa: E402

import linattn as la  # noqa: E402
from linattn.flax import FastAttention, Projection  # noqa: E402

B, H, L, D = 2, 2, 10, 8


def _x() -> jax.Array:
    return jnp.asarray(0.5 * np.random.default_rng(0).normal(size=(B, H, L, D)))


class _Block(nnx.Module):  # type: ignore[misc]
    def __init__(self) -> None:
        self.mix = nnx.Linear(D, D, rngs=nnx.Rngs(0))
        self.attention = FastAttention(D, 16, causal=True, seed=2)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.mix(x)
        return self.attention(y, y, y)


def test_equals_linear_attention_with_the_seed_map() -> None:
    x = _x()
    layer = FastAttention(D, 16, causal=True, seed=2)
    fm = la.FeatureMap(D, 16, kind="hyperbolic", seed=2)
    np.testing.assert_array_equal(layer(x, x, x), la.linear_attention(x, x, x, fm, causal=True))


def test_jit_and_grad_leave_the_projection_alone() -> None:
    block, x = _Block(), _x()
    loss = nnx.jit(lambda m, x: jnp.sum(m(x) ** 2))
    grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(block)
    np.testing.assert_allclose(loss(block, x), jnp.sum(block(x) ** 2), rtol=1e-12)
    assert set(grads["mix"]) == {"kernel", "bias"}
    assert "attention" not in grads  # the projection is no parameter
    assert bool(jnp.any(grads["mix"]["kernel"][...] != 0))
    projection = nnx.state(block, Projection)["attention"]["projection"]
    assert projection.get_value().shape == (8, D)


def test_decoding_state_through_jit() -> None:
    x = _x()
    layer = FastAttention(D, 16, causal=True)
    step = nnx.jit(lambda m, q, s: m(q, q, q, state=s, return_state=True))
    first, state = step(layer, x[..., :6, :], None)
    rest, state = step(layer, x[..., 6:, :], state)
    assert isinstance(state, la.LinearAttentionState)
    np.testing.assert_allclose(jnp.concatenate([first, rest], axis=-2), layer(x, x, x), rtol=1e-10)


def test_redraw_and_restore() -> None:
    x = _x()
    layer = FastAttention(D, 16, causal=True, seed=2)
    layer.redraw_projection()
    assert (
        layer.feature_map.fingerprint
        == la.FeatureMap(D, 16, kind="hyperbolic", seed=3).fingerprint
    )
    restored = FastAttention(D, 16, causal=True, seed=9)
    nnx.update(restored, nnx.state(layer, Projection))
    restored.sync_projection()
    np.testing.assert_array_equal(restored(x, x, x), layer(x, x, x))


def test_a_fitted_map_is_state_that_round_trips() -> None:
    """A fitted map with a window and a sink, under nnx.jit, equals linear_attention; its
    parameters are FittedParameter variables: another module updated from this one's
    state (and synced) gives the same output."""
    from linattn.flax import FittedParameter

    rng = np.random.default_rng(1)

    def fitted(g: object) -> la.FeatureMap:
        return la.FeatureMap.fitted(
            rng.normal(size=(H, D, 3)), rng.normal(size=(H, 3)), tied=True, far_weight=g
        )

    fm = fitted([0.4, 2.0])
    layer = FastAttention(D, feature_map=fm, causal=True, window=2, sink_keys=1)
    x = _x()
    expected = la.linear_attention(np.asarray(x), np.asarray(x), np.asarray(x), fm,
                                   causal=True, window=2, sink_keys=1)  # fmt: skip
    run = nnx.jit(lambda module, y: module(y, y, y))
    np.testing.assert_allclose(np.asarray(run(layer, x)), expected, rtol=1e-5, atol=1e-6)
    state = nnx.state(layer, FittedParameter)
    assert sorted(state.keys()) == ["far_weight", "query_bias", "query_weight"]
    other = FastAttention(D, feature_map=fitted([1.0, 1.0]), causal=True, window=2, sink_keys=1)
    nnx.update(other, nnx.state(layer))
    other.sync_projection()
    np.testing.assert_allclose(np.asarray(run(other, x)), expected, rtol=1e-5, atol=1e-6)
