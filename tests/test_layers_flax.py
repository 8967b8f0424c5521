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


def test_exact_heads_attend_exactly() -> None:
    """``exact_heads=``: head 1 is softmax attention under nnx.jit, head 0 the hybrid;
    decoding is refused."""
    rng = np.random.default_rng(2)
    fm = la.FeatureMap.fitted(rng.normal(size=(H, D, 3)), tied=True, far_weight=[0.4, 2.0])
    layer = FastAttention(D, feature_map=fm, window=2, sink_keys=1, exact_heads=[1])
    x = _x()
    h = np.asarray(x)
    hybrid = la.linear_attention(h, h, h, fm, window=2, sink_keys=1)
    out = np.asarray(nnx.jit(lambda module, y: module(y, y, y))(layer, x))
    np.testing.assert_allclose(out[:, 0], hybrid[:, 0], rtol=1e-5, atol=1e-6)
    exact = la.softmax_attention(h[:, 1], h[:, 1], h[:, 1], scale=fm.scale)
    np.testing.assert_allclose(out[:, 1], exact, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"exact heads \(1,\) cannot continue or return"):
        layer(x, x, x, return_state=True)


def test_train_map_trains_the_fitted_parameters() -> None:
    """``train_map=True``: the fitted parameters are nnx.Param variables under the
    FittedParameter names; the module's output equals the frozen module's (eager and
    under nnx.jit), nnx.grad reaches every parameter, gradient steps lower the error to
    softmax attention, the state loads into a frozen module; a negative far weight acts
    as 0 (no gradient); decoding and a random map are refused by name."""
    rng = np.random.default_rng(2)
    fm = la.FeatureMap.fitted(
        rng.normal(size=(H, D, 3)), rng.normal(size=(H, 3)),
        key_weight=rng.normal(size=(H, D, 3)), key_bias=rng.normal(size=(H, 3)),
        far_weight=[0.4, 2.0],
    )  # fmt: skip
    options = {"feature_map": fm, "window": 2, "sink_keys": 1}
    frozen = FastAttention(D, **options)
    layer = FastAttention(D, train_map=True, **options)
    names = ["far_weight", "key_bias", "key_weight", "query_bias", "query_weight"]
    assert sorted(nnx.state(layer, nnx.Param).keys()) == names
    x = _x()
    np.testing.assert_allclose(np.asarray(layer(x, x, x)), np.asarray(frozen(x, x, x)),
                               rtol=1e-6, atol=1e-7)  # fmt: skip
    run = nnx.jit(lambda module, y: module(y, y, y))
    np.testing.assert_allclose(np.asarray(run(layer, x)), np.asarray(frozen(x, x, x)),
                               rtol=1e-6, atol=1e-7)  # fmt: skip
    target = jnp.asarray(la.softmax_attention(*(np.asarray(x),) * 3))

    def loss(module: FastAttention) -> jax.Array:
        return jnp.mean((module(x, x, x) - target) ** 2)

    step = nnx.jit(nnx.value_and_grad(loss))
    errors = []
    for _ in range(10):
        value, grads = step(layer)
        assert all(float(jnp.abs(grads[name][...]).sum()) > 0 for name in names)
        for name in names:
            variable = getattr(layer, name)
            variable.set_value(variable.get_value() - 10.0 * grads[name][...])
        errors.append(float(value))
    assert errors[-1] < 0.9 * errors[0], errors
    frozen_state = nnx.state(frozen)
    nnx.update(frozen, {**frozen_state, **nnx.state(layer, nnx.Param)})
    frozen.sync_projection()
    np.testing.assert_allclose(np.asarray(frozen(x, x, x)), np.asarray(layer(x, x, x)),
                               rtol=1e-6, atol=1e-7)  # fmt: skip
    layer.far_weight.set_value(jnp.asarray([-0.5, 1.0]))
    negative = layer(x, x, x)
    layer.far_weight.set_value(jnp.asarray([0.0, 1.0]))
    np.testing.assert_allclose(np.asarray(negative), np.asarray(layer(x, x, x)), rtol=0, atol=0)
    layer.far_weight.set_value(jnp.asarray([-0.5, 1.0]))
    grads = nnx.grad(loss)(layer)
    assert float(grads["far_weight"][...][0]) == 0.0 and float(grads["far_weight"][...][1]) != 0
    with pytest.raises(ValueError, match="state and return_state need a module built"):
        layer(x, x, x, return_state=True)
    with pytest.raises(ValueError, match="train_map=True needs a fitted map"):
        FastAttention(D, 16, train_map=True)
