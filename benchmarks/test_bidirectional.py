"""The fused bidirectional CPU pass against its goals (issue 15, item 1 and 2); run
``pytest benchmarks/test_bidirectional.py --benchmark-only``.

Workload: B=1, H=8, d=64, m=256 ("positive" features), float32.  Paths: ``fused``
(``linattn._dispatch.fused_bidirectional`` on NumPy arrays: two compiled passes,
features included), ``fused torch`` (the same on torch CPU tensors, through the
``linattn::bidirectional_forward`` operator) and ``array-api`` (the bidirectional path
before: ``FeatureMap.signed_log_features`` then ``linattn.causal.bidirectional``).
FLOPs per head: ``4 L d m`` (query and key features) plus ``4 L m (d_v + 1)`` (state
and readout), whatever the block size.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from typing import Any

import numpy as np
import pytest

import linattn as la
from linattn import _dispatch

pytest.importorskip("linattn_numba.cpu.bidirectional")
torch = pytest.importorskip("torch")

HEADS, HEAD_DIM, FEATURES = 8, 64, 256


def flops(length: int) -> float:
    return float(
        HEADS * (4 * length * HEAD_DIM * FEATURES + 4 * length * FEATURES * (HEAD_DIM + 1))
    )


def paths(q: np.ndarray, k: np.ndarray, v: np.ndarray, fm: la.FeatureMap) -> dict[str, Any]:
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))  # (views: no copies)
    return {
        "fused": lambda: _dispatch.fused_bidirectional(q, k, v, fm, None),
        "fused torch": lambda: _dispatch.fused_bidirectional(tq, tk, tv, fm, None),
        "array-api": lambda: la.linear_attention(q, k, v, fm, backend="array_api"),
    }


@pytest.mark.parametrize("length", [1024, 4096, 16384])
def test_time_and_rate(
    benchmark: Any, length: int, feature_map: la.FeatureMap, bench: Any
) -> None:
    """Goals: >= 60 % of the float32 GEMM rate; faster than the array-API path; torch
    within 10 % of NumPy."""
    q, k, v = bench.workload(length)
    a = np.random.default_rng(1).normal(size=(2048, 2048)).astype(np.float32)
    functions = {"sgemm": lambda: a @ a, **paths(q, k, v, feature_map)}
    times = bench.best_times(functions, repeat=3 if length <= 4096 else 2)
    gemm = 2 * 2048**3 / times["sgemm"]
    rate = flops(length) / times["fused"]
    bench.record(benchmark, f"L={length} float32 GEMM rate (2048^3)", gemm / 1e9, "GFLOP/s")
    for name in ("fused", "fused torch", "array-api"):
        bench.record(benchmark, f"L={length} bidirectional {name} time", 1e3 * times[name], "ms")
    bench.record(benchmark, f"L={length} fused rate", rate / 1e9, "GFLOP/s")
    bench.record(benchmark, f"L={length} fused rate / GEMM rate", rate / gemm)
    bench.record(benchmark, f"L={length} array-api time / fused time",
                 times["array-api"] / times["fused"])  # fmt: skip
    bench.record(benchmark, f"L={length} fused torch time / fused NumPy time",
                 times["fused torch"] / times["fused"])  # fmt: skip
    benchmark.pedantic(functions["fused"], rounds=1, iterations=1)


MEMORY_PROBE = textwrap.dedent(
    """
    import gc, json, sys
    import numpy as np
    import torch
    import linattn as la
    from linattn import _dispatch

    def rss(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024

    path, length = sys.argv[1], int(sys.argv[2])
    fm = la.FeatureMap(64, 256, seed=0)
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(1, 8, length, 64)).astype(np.float32) for _ in range(3))
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    runs = {
        "fused": lambda q, k, v: _dispatch.fused_bidirectional(q, k, v, fm, None),
        "fused torch": lambda q, k, v: _dispatch.fused_bidirectional(
            torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v), fm, None),
        "array-api": lambda q, k, v: la.linear_attention(q, k, v, fm, backend="array_api"),
    }
    run = runs[path]
    run(*(x[..., :512, :].copy() for x in (q, k, v)))  # compile, start thread pools
    gc.collect()
    before = rss("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS
    out = run(q, k, v)
    peak = rss("VmHWM:")
    print(json.dumps({"before": before, "peak": peak, "inputs": 3 * q.nbytes,
                      "outputs": int(np.prod(out.shape)) * 4}))
    """
)


@pytest.mark.parametrize("path", ["fused", "fused torch", "array-api"])
def test_peak_memory(benchmark: Any, path: str, bench: Any) -> None:
    """Goal (fused): peak RSS above inputs and outputs at L=16384 <= 5 % of them.

    Peak resident set size (``VmHWM``, reset through ``/proc/self/clear_refs``) of one
    call in a fresh process, minus the resident size before it (inputs included) and
    the outputs; Numba's allocations count (tracemalloc would miss them).
    """
    result = subprocess.run(
        [sys.executable, "-c", MEMORY_PROBE, path, "16384"],
        check=True,
        capture_output=True,
        text=True,
    )
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    extra = figures["peak"] - figures["before"] - figures["outputs"]
    data = figures["inputs"] + figures["outputs"]
    bench.record(benchmark, f"L=16384 {path} peak RSS above inputs+outputs", extra / 2**20, "MiB")
    bench.record(benchmark, f"L=16384 {path} (peak above) / (inputs + outputs)", extra / data)
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)


def test_bidirectional_window_against_the_causal_pass(
    benchmark: Any, bench: Any, feature_map: la.FeatureMap
) -> None:
    """Issue 15's goal for a bidirectional window: at most 2.2x the causal fused pass at the
    same m (w = 64, L = 16384); wall and CPU time, interleaved."""
    q, k, v = bench.workload(16384)

    def window() -> np.ndarray:
        return la.linear_attention(q, k, v, feature_map, window=64)

    def causal() -> np.ndarray:
        return la.linear_attention(q, k, v, feature_map, causal=True)

    functions = {"bidirectional w=64": window, "causal": causal}
    for clock, label in ((time.perf_counter, "wall"), (time.process_time, "CPU")):
        times = bench.best_times(functions, repeat=2, clock=clock)
        for name, seconds in times.items():
            bench.record(benchmark, f"L=16384 {name} {label} time", 1e3 * seconds, "ms")
        ratio = times["bidirectional w=64"] / times["causal"]
        bench.record(benchmark, f"bidirectional window / causal, {label} (goal <= 2.2)", ratio)
    benchmark.pedantic(window, rounds=1, iterations=1)


def test_sinks_without_a_window(benchmark: Any, bench: Any, feature_map: la.FeatureMap) -> None:
    """Bidirectional sinks (4) without a window: the fused pass's rows and log-normaliser
    merged with the sinks' exact partial, against the plain fused pass and against the
    array-API parts (``backend="array_api"``), L = 16384, interleaved."""
    q, k, v = bench.workload(16384)
    functions = {
        "plain": lambda: la.linear_attention(q, k, v, feature_map),
        "4 sinks": lambda: la.linear_attention(q, k, v, feature_map, sink_keys=4),
        "4 sinks, array-API parts": lambda: la.linear_attention(
            q, k, v, feature_map, sink_keys=4, backend="array_api"
        ),
    }
    times = bench.best_times(functions, repeat=2)
    for name, seconds in times.items():
        bench.record(benchmark, f"L=16384 bidirectional {name} time", 1e3 * seconds, "ms")
    bench.record(benchmark, "4 sinks / plain", times["4 sinks"] / times["plain"])
    portable = times["4 sinks, array-API parts"]
    bench.record(benchmark, "array-API parts / 4 sinks", portable / times["4 sinks"])
    benchmark.pedantic(functions["4 sinks"], rounds=1, iterations=1)
