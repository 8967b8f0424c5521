"""Huge keys and non-finite log-features in the CPU kernels: causality and no NaN.

A key may affect only outputs at or after its own position.  A huge but finite key
has a log-feature below the float range (``-inf``, a key that contributes nothing);
a log-feature that is still NaN or ``+inf`` may spoil later outputs, never earlier
ones: inside a chunk the later keys are selected away, not multiplied by ``0``.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")

import linattn as la
from linattn_numba import cpu

HUGE = {"float32": 3e38, "float64": 1e308}
L, D, M, CHUNK, AT = 128, 16, 32, 64, 50


def _qkv(batch: int, dtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(16)
    q, k, v = (rng.normal(size=(batch, L, D)).astype(dtype) for _ in range(3))
    return q, k, v


def _with_key(k: np.ndarray, value: float) -> np.ndarray:
    k = k.copy()
    k[0, AT, :] = value
    return k


def _assert_earlier_outputs_unchanged(huge: np.ndarray, zero: np.ndarray) -> None:
    """Positions before ``AT`` of batch entry 0, and all of the others, bit for bit."""
    assert np.array_equal(huge[0, :AT], zero[0, :AT])
    assert np.array_equal(huge[1:], zero[1:])


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("kind", ["positive", "hyperbolic"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_fused_pass_huge_key(dtype: str, kind: str, batch: int) -> None:
    q, k, v = _qkv(batch, dtype)
    fm = la.FeatureMap(D, M, kind=kind, seed=0)

    def run(keys: np.ndarray) -> tuple[np.ndarray, ...]:
        return cpu.favor_causal(
            q, keys, v, fm.projection, hyperbolic=kind == "hyperbolic", scale=fm.scale,
            key_mask=None, kv=np.zeros((M, D + 1), dtype),
            log_shift=np.full(M, -np.inf, dtype), chunk_size=CHUNK,
        )  # fmt: skip

    huge, kv, mu = run(_with_key(k, HUGE[dtype]))
    zero = run(_with_key(k, 0.0))[0]
    _assert_earlier_outputs_unchanged(huge, zero)
    # Its log-features are -inf: the key is as good as masked, and nothing is NaN.
    assert not np.isnan(huge).any() and not np.isnan(kv).any() and not np.isnan(mu).any()
    masked = np.ones((batch, L), bool)
    masked[0, AT] = False
    expected = la.linear_attention(
        q, _with_key(k, 0.0), v, fm, causal=True, key_mask=masked, chunk_size=CHUNK
    )
    assert np.array_equal(huge, expected)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_fused_pass_huge_query_sees_nothing(dtype: str) -> None:
    q, k, v = _qkv(1, dtype)
    q[0, AT, :] = -HUGE[dtype]
    fm = la.FeatureMap(D, M, seed=0)
    out = la.linear_attention(q, k, v, fm, causal=True, chunk_size=CHUNK, backend="numba")
    assert np.array_equal(out[0, AT], np.zeros(D, dtype))
    assert not np.isnan(out).any()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_fused_pass_nan_input_stays_nan(dtype: str) -> None:
    """NaN is not overflow: a NaN key spoils what comes at or after it, not before."""
    q, k, v = _qkv(1, dtype)
    fm = la.FeatureMap(D, M, seed=0)
    nan = la.linear_attention(q, _with_key(k, np.nan), v, fm, causal=True, chunk_size=CHUNK)
    zero = la.linear_attention(q, _with_key(k, 0.0), v, fm, causal=True, chunk_size=CHUNK)
    assert np.array_equal(nan[0, :AT], zero[0, :AT])
    assert np.isnan(nan[0, AT:]).all()


@pytest.mark.parametrize("state", [False, True])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, "mixed"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_kernel_later_non_finite_key_leaves_earlier_outputs(dtype, bad, state) -> None:
    rng = np.random.default_rng(17)
    lq, lk = (rng.normal(size=(2, L, M)) - 2 for _ in range(2))
    va = np.concatenate([rng.normal(size=(2, L, D)), np.ones((2, L, 1))], axis=-1)
    kv = np.abs(rng.normal(size=(2, M, D + 1))) if state else np.zeros((2, M, D + 1))
    mu = rng.normal(size=(2, M)) if state else np.full((2, M), -np.inf)
    inputs = [x.astype(dtype) for x in (lq, lk, va, kv, mu)]

    def run(row: object) -> np.ndarray:
        keys = inputs[1].copy()
        keys[0, AT] = (
            np.array([np.nan, np.inf, -np.inf, 1.0] * (M // 4)) if row == "mixed" else row
        )
        return cpu.numpy_forward(inputs[0], keys, *inputs[2:], CHUNK)[0]

    _assert_earlier_outputs_unchanged(run(bad), run(0.0))


@pytest.mark.parametrize("key", ["huge", "nan"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_features_then_kernel_later_key_leaves_earlier_outputs(dtype: str, key: str) -> None:
    """A map the fused pass does not take (rebalanced): log-features, then the kernel."""
    q, k, v = _qkv(2, dtype)
    scales = np.random.default_rng(18).uniform(0.5, 2.0, D)
    fm = la.FeatureMap(D, M, seed=0, rebalance=True).with_statistics(rebalance_scales=scales)

    def run(keys: np.ndarray) -> np.ndarray:
        return la.linear_attention(q, keys, v, fm, causal=True, chunk_size=CHUNK, backend="numba")

    bad = HUGE[dtype] if key == "huge" else np.nan
    out = run(_with_key(k, bad))
    _assert_earlier_outputs_unchanged(out, run(_with_key(k, 0.0)))
    if key == "huge":  # log-feature -inf: the key drops out, nothing is NaN
        assert not np.isnan(out).any()
