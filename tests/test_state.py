"""The state (S, mu): associative combine, identity, and agreement with sequential absorption."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import Backend, assert_close

import linattn as la
from linattn.state import absorb_keys, combine, empty_state


def _states(backend: Backend):
    xp = backend.xp
    rng = np.random.default_rng(0)
    fm = la.FeatureMap(4, 6, seed=1)
    k = backend.asarray(rng.normal(size=(3, 5, 4)))
    v = rng.normal(size=(3, 5, 2))
    va = backend.asarray(np.concatenate([v, np.ones((3, 5, 1))], axis=-1))
    lk = fm.log_features(k)
    empty = empty_state(xp, (), 6, 2, lk)
    pieces = [absorb_keys(xp, *empty, lk[i, ...], None, va[i, ...]) for i in range(3)]
    return xp, lk, va, empty, pieces


def test_combine_is_associative_and_matches_sequential(backend: Backend) -> None:
    xp, lk, va, empty, (a, b, c) = _states(backend)
    left = combine(xp, combine(xp, a, b), c)
    right = combine(xp, a, combine(xp, b, c))
    seq = empty
    for i in range(3):
        seq = absorb_keys(xp, *seq, lk[i, ...], None, va[i, ...])
    for got in (left, right):
        assert_close(backend, got[0], backend.to_numpy(seq[0]), rtol=1e-13, dtype="float64")
        assert_close(backend, got[1], backend.to_numpy(seq[1]), rtol=0, dtype="float64")


def test_empty_state_is_the_identity(backend: Backend) -> None:
    xp, _, _, empty, (a, _, _) = _states(backend)
    for got in (combine(xp, empty, a), combine(xp, a, empty)):
        np.testing.assert_array_equal(backend.to_numpy(got[0]), backend.to_numpy(a[0]))
        np.testing.assert_array_equal(backend.to_numpy(got[1]), backend.to_numpy(a[1]))
    both = combine(xp, empty, empty)
    assert np.all(backend.to_numpy(both[0]) == 0)
    assert np.all(np.isneginf(backend.to_numpy(both[1])))


def test_normaliser_column_is_at_least_one(backend: Backend) -> None:
    _, _, _, _, (a, _, _) = _states(backend)
    assert backend.to_numpy(a[0])[:, -1].min() >= 1.0


@pytest.mark.needs("jax")
def test_jax_jit() -> None:
    jax = pytest.importorskip("jax")
    rng = np.random.default_rng(3)
    q, k, v = (jax.numpy.asarray(rng.normal(size=(10, 4))) for _ in range(3))
    fm = la.FeatureMap(4, 8, seed=0)
    f = jax.jit(lambda q, k, v: la.linear_attention(q, k, v, fm, causal=True, chunk_size=4))
    np.testing.assert_allclose(
        np.asarray(f(q, k, v)),
        np.asarray(la.linear_attention(q, k, v, fm, causal=True, chunk_size=4)),
        rtol=1e-12,
    )
