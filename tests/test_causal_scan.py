"""The batched causal pass: its scan, and structural counts that show no loop over L."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import Backend, assert_close

import linattn as la
from linattn import causal
from linattn.scan import inclusive_scan
from linattn.state import combine


def _states(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    kv = rng.random((2, n, 3, 4))
    mu = rng.normal(size=(2, n, 3)) * 5
    mu[:, 0, 1] = -np.inf  # a feature no key of chunk 0 reached
    kv[:, 0, 1] = 0.0
    return kv, mu


@pytest.mark.parametrize("n", [1, 2, 5, 8, 13])
@pytest.mark.parametrize("reverse", [False, True])
def test_scan_equals_sequential_combines(backend: Backend, n: int, reverse: bool) -> None:
    kv, mu = _states(np.random.default_rng(n), n)
    order = range(n - 1, -1, -1) if reverse else range(n)
    expected_kv, expected_mu = np.empty_like(kv), np.empty_like(mu)
    running = None
    for i in order:
        here = (kv[:, i], mu[:, i])
        running = here if running is None else combine(np, running, here)
        expected_kv[:, i], expected_mu[:, i] = running
    got_kv, got_mu = inclusive_scan(
        backend.xp, backend.asarray(kv), backend.asarray(mu), reverse=reverse
    )
    assert_close(backend, got_kv, expected_kv, rtol=1e-12, atol=0, dtype="float64")
    assert_close(backend, got_mu, expected_mu, rtol=0, atol=0, dtype="float64")


class _Counting:
    """An array namespace that counts the calls made to it."""

    def __init__(self, xp: object) -> None:
        self.xp, self.calls = xp, 0

    def __getattr__(self, name: str) -> object:
        attribute = getattr(self.xp, name)
        if not callable(attribute) or isinstance(attribute, type):
            return attribute

        def counted(*args: object, **kwargs: object) -> object:
            self.calls += 1
            return attribute(*args, **kwargs)  # type: ignore[operator]

        return counted


def _calls(length: int) -> int:
    import array_api_compat.numpy as xnp

    xp = _Counting(xnp)
    log_phi = np.zeros((1, length, 8))
    values_aug = np.ones((1, length, 5))
    kv, log_shift = np.zeros((1, 8, 5)), np.full((1, 8), -np.inf)
    causal.causal(xp, log_phi, None, log_phi, None, values_aug, kv, log_shift, 64)
    return xp.calls


def test_array_api_calls_grow_with_log_length() -> None:
    """One more scan step, and nothing else, each time the sequence doubles."""
    counts = [_calls(64 * 2**j) for j in range(4, 9)]  # 16 ... 256 chunks
    steps = np.diff(counts)
    assert (steps == steps[0]).all() and 0 < steps[0] <= 12, counts
    assert counts[-1] < 200


@pytest.mark.needs("jax")
def test_jaxpr_does_not_grow_with_length() -> None:
    """The same jaxpr at every L: ``lax.scan`` over chunk states, no loop over tokens."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    fm = la.FeatureMap(16, 32, seed=0)

    def forward(q):
        return la.linear_attention(q, q, q, fm, causal=True, backend="array_api")

    def gradient(q):
        return jax.grad(lambda x: jnp.sum(forward(x)))(q)

    for function in (forward, gradient):
        counts = [
            len(jax.make_jaxpr(function)(jnp.zeros((2, 64 * 2**j, 16))).jaxpr.eqns)
            for j in (3, 4, 5, 6)
        ]
        assert len(set(counts)) == 1, counts


def test_blocks_of_a_multiple_of_the_chunk_size_hold_the_state_width() -> None:
    x = np.zeros((1, 300, 4))
    for chunk_size, width, size in ((64, 65, 128), (64, 5, 64), (16, 33, 48), (512, 5, 300)):
        blocks = causal.ChunkBlocks.of(np, x, None, x, None, np.ones((1, 300, width)), chunk_size)
        assert blocks.lower.shape == (size, size)
        assert blocks.operands[0].shape[-3] == -(-300 // size)
