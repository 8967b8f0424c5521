"""Exact sliding-window attention and the hybrid on the CPU (issue 13); run
``pytest benchmarks/test_window.py --benchmark-only -p no:randomly``.

Workload: B=1, H=8, d=64, float32, causal, window w = 64.  Goals (ratios from one run,
never asserted): exact sliding-window attention (``feature_map=None``, the compiled
window kernel ``linattn_numba.cpu.window``) linear in L (``time(32768) / time(16384)`` in
[1.8, 2.2]) and at least 2x faster than the banded NumPy reference below; the hybrid
(window + 4 sinks + m = 256 random features) within 1.3x of random features alone, in
wall time and in CPU time (the process's threads; steadier when other jobs load the
machine).
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import pytest

import linattn as la

pytest.importorskip("linattn_numba.cpu.window")

WINDOW, SINKS, LENGTHS = 64, 4, (16384, 32768)


def banded_reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, w: int) -> np.ndarray:
    """Causal sliding-window softmax attention, the obvious NumPy way: one pass per
    offset ``o`` (query ``t`` against key ``t - o``), a stable softmax across offsets."""
    length, scale = q.shape[-2], 1 / math.sqrt(q.shape[-1])
    logits = np.full((*q.shape[:-1], w), -np.inf, q.dtype)
    for o in range(w):
        logits[..., o:, o] = np.sum(q[..., o:, :] * k[..., : length - o, :], -1) * scale
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    out = np.zeros_like(v)
    for o in range(w):
        out[..., o:, :] += weights[..., o:, o, None] * v[..., : length - o, :]
    return out / weights.sum(-1)[..., None]


def window(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    return la.linear_attention(q, k, v, None, causal=True, window=WINDOW)


def test_sliding_window_is_linear_and_beats_numpy(benchmark: Any, bench: Any) -> None:
    inputs = {length: bench.workload(length) for length in LENGTHS}
    short = inputs[LENGTHS[0]]
    np.testing.assert_allclose(  # (the two compute the same thing)
        window(*short), banded_reference(*short, WINDOW), rtol=2e-4, atol=2e-5
    )
    functions = {f"L={n} window": lambda x=x: window(*x) for n, x in inputs.items()}
    functions[f"L={LENGTHS[0]} banded NumPy"] = lambda: banded_reference(*short, WINDOW)
    times = bench.best_times(functions, repeat=2)
    for name, seconds in times.items():
        bench.record(benchmark, f"{name} time", 1e3 * seconds, "ms")
    long, short_time = times[f"L={LENGTHS[1]} window"], times[f"L={LENGTHS[0]} window"]
    bench.record(benchmark, "window time(32768) / time(16384) (goal 1.8-2.2)", long / short_time)
    bench.record(
        benchmark,
        "banded NumPy / window at L=16384 (goal >= 2)",
        times[f"L={LENGTHS[0]} banded NumPy"] / short_time,
    )
    benchmark.pedantic(window, args=short, rounds=1, iterations=1)


def test_hybrid_against_random_features_alone(
    benchmark: Any, bench: Any, feature_map: la.FeatureMap
) -> None:
    q, k, v = bench.workload(LENGTHS[0])

    def hybrid() -> np.ndarray:
        options = {"causal": True, "window": WINDOW, "sink_keys": SINKS}
        return la.linear_attention(q, k, v, feature_map, **options)

    def features() -> np.ndarray:
        return la.linear_attention(q, k, v, feature_map, causal=True)

    functions = {"hybrid": hybrid, "random features": features}
    for clock, label in ((time.perf_counter, "wall"), (time.process_time, "CPU")):
        times = bench.best_times(functions, repeat=3, clock=clock)
        for name, seconds in times.items():
            bench.record(benchmark, f"L={LENGTHS[0]} {name} {label} time", 1e3 * seconds, "ms")
        bench.record(
            benchmark,
            f"hybrid / random features at L=16384, {label} time (goal <= 1.3)",
            times["hybrid"] / times["random features"],
        )
    benchmark.pedantic(hybrid, rounds=1, iterations=1)


def test_hybrid_vjp_against_random_features_alone(
    benchmark: Any, bench: Any, feature_map: la.FeatureMap
) -> None:
    """The hybrid's VJP (window, sinks and far parts' adjoints; the far parts by the fused
    causal backward) against random features' VJP alone, causal and bidirectional."""
    q, k, v = bench.workload(LENGTHS[0])
    grad = np.random.default_rng(3).normal(size=q.shape).astype(np.float32)

    def vjp(causal: bool, **options: int) -> Any:
        return lambda: la.linear_attention_vjp(
            q, k, v, feature_map, grad, causal=causal, **options
        )

    functions = {
        "causal hybrid": vjp(True, window=WINDOW, sink_keys=SINKS),
        "causal random features": vjp(True),
        "bidirectional hybrid": vjp(False, window=WINDOW, sink_keys=SINKS),
        "bidirectional random features": vjp(False),
    }
    times = bench.best_times(functions, repeat=2, clock=time.process_time)
    for name, seconds in times.items():
        bench.record(benchmark, f"L={LENGTHS[0]} {name} VJP CPU time", 1e3 * seconds, "ms")
    for kind in ("causal", "bidirectional"):
        ratio = times[f"{kind} hybrid"] / times[f"{kind} random features"]
        bench.record(benchmark, f"{kind} hybrid VJP / random features VJP, CPU time", ratio)
    benchmark.pedantic(functions["causal hybrid"], rounds=1, iterations=1)
