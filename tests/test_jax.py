"""JAX: states and feature maps as pytrees, jitted decoding, statistics under tracing."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import linattn as la

jax = pytest.importorskip("jax")
jnp = jax.numpy
pytestmark = pytest.mark.needs("jax")


def _qkv(length: int, seed: int = 0) -> tuple:
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(0.5 * rng.normal(size=(2, length, 8))) for _ in range(3))


def test_state_is_a_pytree_with_the_fingerprint_static() -> None:
    fm = la.FeatureMap(8, 16, seed=0)
    q, k, v = _qkv(6)
    _, state = la.linear_attention(q, k, v, fm, causal=True, return_state=True)
    leaves, tree = jax.tree_util.tree_flatten(state)
    assert len(leaves) == 3  # kv, log_shift, num_tokens
    again = jax.tree_util.tree_unflatten(tree, leaves)
    assert again.feature_map == fm.fingerprint and int(again.num_tokens) == 6


def test_feature_map_and_state_pass_through_jit() -> None:
    fm = la.FeatureMap(8, 16, seed=0)
    q, k, v = _qkv(12)

    @jax.jit
    def prefill(fm: la.FeatureMap, q, k, v):
        return la.linear_attention(q, k, v, fm, causal=True, return_state=True)

    @jax.jit
    def step(fm: la.FeatureMap, state, q, k, v):
        return la.linear_attention(q, k, v, fm, causal=True, state=state, return_state=True)

    whole = la.linear_attention(q, k, v, fm, causal=True)
    first, state = prefill(fm, q[:, :8], k[:, :8], v[:, :8])
    rest, state = step(fm, state, q[:, 8:], k[:, 8:], v[:, 8:])
    np.testing.assert_allclose(np.concatenate([first, rest], axis=1), whole, rtol=1e-5, atol=1e-6)
    assert int(state.num_tokens) == 12


def test_jitted_decoding_loop_equals_one_pass() -> None:
    """``lax.scan`` over tokens, carrying the state: the decoding loop users write."""
    fm = la.FeatureMap(8, 16, kind="hyperbolic", seed=1)
    q, k, v = _qkv(20, seed=2)
    _, state = la.linear_attention(
        q[:, :4], k[:, :4], v[:, :4], fm, causal=True, return_state=True
    )

    def decode(state, token):
        qt, kt, vt = (x[:, None, :] for x in token)
        out, state = la.linear_attention(
            qt, kt, vt, fm, causal=True, state=state, return_state=True
        )
        return state, out[:, 0]

    tokens = tuple(jnp.moveaxis(x[:, 4:], 1, 0) for x in (q, k, v))
    state, outs = jax.jit(lambda s, t: jax.lax.scan(decode, s, t))(state, tokens)
    whole = la.linear_attention(q, k, v, fm, causal=True)
    np.testing.assert_allclose(jnp.moveaxis(outs, 0, 1), whole[:, 4:], rtol=1e-5, atol=1e-6)
    assert int(state.num_tokens) == 20


def test_pytrees_are_registered_whatever_the_import_order() -> None:
    script = (
        "import linattn as la, jax, jax.numpy as jnp\n"
        "fm = la.FeatureMap(4, 8)\n"
        "print(jax.jit(lambda fm, x: fm.features(x))(fm, jnp.ones((1, 4))).shape)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "(1, 8)"


def test_favor_attention_default_estimator_under_jit_and_grad() -> None:
    """The default (calibrated) estimator computes its statistics on the device."""
    q, k, v = _qkv(16, seed=3)
    eager = la.favor_attention(q, k, v, num_features=32)
    jitted = jax.jit(lambda q, k, v: la.favor_attention(q, k, v, num_features=32))(q, k, v)
    np.testing.assert_allclose(jitted, eager, rtol=1e-5, atol=1e-6)
    # Statistics are constants for gradients: the gradient of a map calibrated on the
    # same inputs in advance, whose statistics are fixed numbers.
    fixed = la.FeatureMap(8, 32, kind="hyperbolic_oprf", rebalance=True).calibrate(q, k)

    def loss(q, fm=None):
        if fm is None:
            return jnp.sum(la.favor_attention(q, k, v, num_features=32) ** 2)
        return jnp.sum(la.linear_attention(q, k, v, fm) ** 2)

    np.testing.assert_allclose(
        jax.jit(jax.grad(loss))(q), jax.grad(loss)(q, fixed), rtol=1e-4, atol=1e-6
    )


def test_calibrate_refuses_traced_arrays() -> None:
    fm = la.FeatureMap(8, 16, kind="oprf")
    q, k, _ = _qkv(4)
    with pytest.raises(TypeError, match="calibrate computes statistics on the host"):
        jax.jit(lambda q, k: fm.calibrate(q, k).oprf_a)(q, k)


def test_with_exact_heads_under_jit() -> None:
    """Exact heads spliced inside ``jax.jit`` (the key mask traced, grouped-query heads)
    equal the eager NumPy splice."""
    rng = np.random.default_rng(3)
    q = rng.normal(size=(2, 4, 5, 3))
    k, v = rng.normal(size=(2, 2, 5, 3)), rng.normal(size=(2, 2, 5, 2))
    out = rng.normal(size=(2, 4, 5, 2))
    mask = np.ones((2, 2, 5), dtype=bool)
    mask[1, 1, :2] = False
    expected = la.with_exact_heads(out, q, k, v, [3, 1], causal=True, key_mask=mask)

    @jax.jit
    def splice(out, q, k, v, mask):  # type: ignore[no-untyped-def]
        return la.with_exact_heads(out, q, k, v, [3, 1], causal=True, key_mask=mask)

    got = splice(*(jnp.asarray(a) for a in (out, q, k, v, mask)))
    assert isinstance(got, jax.Array)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-6)
