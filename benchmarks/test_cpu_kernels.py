"""Numba CPU kernels against their goals (issue 3); run ``nox -s bench`` or, quickly,
``pytest benchmarks --benchmark-only -k NAME``.

Workload: B=1, H=8, d=64, m=256 ("positive" features), float32, chunk 64.  Two causal
entry points are measured: ``fused`` (``linattn_numba.cpu.favor_causal``: features,
attention and normalisation chunk by chunk in one compiled pass) and
``linear_attention`` (features computed by the array-API code, then the kernel).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest

import linattn as la

numba_cpu = pytest.importorskip("linattn_numba.cpu")

LENGTH = 16384
CHUNK = 64
HEADS, HEAD_DIM, FEATURES = 8, 64, 256  # the workload (also in conftest)


def fused(q: np.ndarray, k: np.ndarray, v: np.ndarray, fm: la.FeatureMap) -> np.ndarray:
    m, dv = fm.num_features, v.shape[-1]
    out, _, _ = numba_cpu.favor_causal(
        q, k, v, fm.projection, hyperbolic=fm.kind == "hyperbolic", scale=fm.scale,
        key_mask=None, kv=np.zeros((m, dv + 1), q.dtype),
        log_shift=np.full(m, -np.inf, q.dtype), chunk_size=CHUNK,
    )  # fmt: skip
    return out


def kernel_inputs(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, fm: la.FeatureMap
) -> tuple[np.ndarray, ...]:
    """The causal kernel's operands: log-features, ``[V | 1]`` and an empty state."""
    va = np.concatenate([v, np.ones_like(v[..., :1])], axis=-1)
    kv = np.zeros((1, HEADS, FEATURES, HEAD_DIM + 1), np.float32)
    mu = np.full((1, HEADS, FEATURES), -np.inf, np.float32)
    return fm.log_features(q), fm.log_features(k), va, kv, mu


def causal_flops(length: int, heads: int, with_features: bool) -> float:
    """FLOPs counted per token: features (2 x 2 d m), intra-chunk (2 C m + 2 C (d_v+1)),
    state readout and state update (2 x 2 m (d_v+1))."""
    width = HEAD_DIM + 1
    per_token = 2 * CHUNK * FEATURES + 2 * CHUNK * width + 4 * FEATURES * width
    if with_features:
        per_token += 4 * HEAD_DIM * FEATURES
    return float(heads * length * per_token)


def test_causal_vs_bidirectional(benchmark: Any, feature_map: la.FeatureMap, bench: Any) -> None:
    """Goal: causal (features included) at L=16384 <= 1.5 x our bidirectional."""
    q, k, v = bench.workload(LENGTH)
    times = bench.best_times(
        {
            "fused": lambda: fused(q, k, v, feature_map),
            "linear_attention": lambda: la.linear_attention(q, k, v, feature_map, causal=True),
            "bidirectional": lambda: la.linear_attention(q, k, v, feature_map),
        },
        repeat=3,
    )
    for name, seconds in times.items():
        bench.record(benchmark, f"L=16384 {name} causal time" if name != "bidirectional"
               else "L=16384 bidirectional time", 1e3 * seconds, "ms")  # fmt: skip
    bench.record(
        benchmark, "causal fused / bidirectional", times["fused"] / times["bidirectional"]
    )
    bench.record(
        benchmark,
        "causal linear_attention / bidirectional",
        times["linear_attention"] / times["bidirectional"],
    )
    benchmark.pedantic(fused, args=(q, k, v, feature_map), rounds=3, iterations=1)


def test_flop_rate(benchmark: Any, feature_map: la.FeatureMap, bench: Any) -> None:
    """Goal: achieved FLOP rate >= 50 % of the float32 matmul rate of the same run."""
    q, k, v = bench.workload(LENGTH)
    lq, lk, va, kv, mu = kernel_inputs(q, k, v, feature_map)
    a = np.random.default_rng(1).normal(size=(2048, 2048)).astype(np.float32)
    times = bench.best_times(
        {
            "sgemm": lambda: a @ a,
            "fused": lambda: fused(q, k, v, feature_map),
            "kernel": lambda: numba_cpu.numpy_forward(lq, lk, va, kv, mu, CHUNK),
        },
        repeat=5,
    )
    matmul_rate = 2 * 2048**3 / times["sgemm"]
    fused_rate = causal_flops(LENGTH, HEADS, True) / times["fused"]
    kernel_rate = causal_flops(LENGTH, HEADS, False) / times["kernel"]
    bench.record(
        benchmark, "float32 matmul rate (2048^3, all cores)", matmul_rate / 1e9, "GFLOP/s"
    )
    bench.record(benchmark, "fused causal rate (features included)", fused_rate / 1e9, "GFLOP/s")
    bench.record(benchmark, "fused causal rate / matmul rate", fused_rate / matmul_rate)
    bench.record(benchmark, "kernel rate (log-features given)", kernel_rate / 1e9, "GFLOP/s")
    bench.record(benchmark, "kernel rate / matmul rate", kernel_rate / matmul_rate)
    benchmark.pedantic(
        numba_cpu.numpy_forward, args=(lq, lk, va, kv, mu, CHUNK), rounds=3, iterations=1
    )


def test_one_core_flop_rate(benchmark: Any, feature_map: la.FeatureMap, bench: Any) -> None:
    """The FLOP-rate goal on one core (Numba and BLAS pinned to one thread), and how the
    fused pass and sgemm each scale to all cores: what the all-core ratio is made of."""
    import numba
    from threadpoolctl import threadpool_limits

    q, k, v = bench.workload(LENGTH)
    a = np.random.default_rng(1).normal(size=(2048, 2048)).astype(np.float32)
    cores = numba.config.NUMBA_NUM_THREADS

    def on(threads: int, fn: Any) -> Any:
        def run() -> None:
            numba.set_num_threads(threads)
            try:
                with threadpool_limits(threads, user_api="blas"):
                    fn()
            finally:
                numba.set_num_threads(cores)

        return run

    times = bench.best_times(
        {
            "sgemm, one core": on(1, lambda: a @ a),
            "fused, one core": on(1, lambda: fused(q, k, v, feature_map)),
            "sgemm, all cores": on(cores, lambda: a @ a),
            "fused, all cores": on(cores, lambda: fused(q, k, v, feature_map)),
        },
        repeat=3,
    )
    rate = {name: 1e-9 * (2 * 2048**3 if name.startswith("sgemm") else
                          causal_flops(LENGTH, HEADS, True)) / seconds
            for name, seconds in times.items()}  # fmt: skip
    for name, value in rate.items():
        bench.record(benchmark, f"{name} rate", value, "GFLOP/s")
    bench.record(
        benchmark,
        "one core: fused rate / sgemm rate",
        rate["fused, one core"] / rate["sgemm, one core"],
    )
    for what in ("sgemm", "fused"):
        bench.record(
            benchmark,
            f"{what}: all cores / one core ({cores} cores)",
            times[f"{what}, one core"] / times[f"{what}, all cores"],
        )
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)


@pytest.mark.parametrize("length", [1024, 2048, 4096, 8192, 16384, 32768])
def test_vs_exact_causal_attention(
    benchmark: Any, feature_map: la.FeatureMap, length: int, bench: Any
) -> None:
    """Goal: faster than exact causal attention from L=1024; >= 15 x at L=32768."""
    torch = pytest.importorskip("torch")
    q, k, v = bench.workload(length)
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    functions = {
        "fused": lambda: fused(q, k, v, feature_map),
        "linear_attention": lambda: la.linear_attention(q, k, v, feature_map, causal=True),
        "torch SDPA": lambda: sdpa(tq, tk, tv, is_causal=True),
    }
    if length <= 4096:  # the (H, L, L) logits: 0.5 GB at 4096, 2 GB at 8192
        functions["numpy softmax"] = lambda: la.softmax_attention(q, k, v, causal=True)
    times = bench.best_times(functions, repeat=2 if length >= 16384 else 5)
    for name, seconds in times.items():
        bench.record(benchmark, f"L={length} {name} time", 1e3 * seconds, "ms")
    for exact in ("torch SDPA", "numpy softmax"):
        if exact in times:
            bench.record(benchmark, f"L={length} {exact} / fused", times[exact] / times["fused"])
    benchmark.pedantic(fused, args=(q, k, v, feature_map), rounds=1, iterations=1)


MEMORY_PROBE = textwrap.dedent(
    """
    import gc, json, sys
    import numpy as np
    import linattn as la
    from linattn_numba import cpu

    def fused(q, k, v, fm):
        m, dv = fm.num_features, v.shape[-1]
        return cpu.favor_causal(
            q, k, v, fm.projection, hyperbolic=False, scale=fm.scale, key_mask=None,
            kv=np.zeros((m, dv + 1), q.dtype), log_shift=np.full(m, -np.inf, q.dtype),
            chunk_size=64,
        )[0]

    def rss(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024

    path, length, heads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    fm = la.FeatureMap(64, 256, seed=0)
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(1, heads, length, 64)).astype(np.float32) for _ in range(3))
    run = {
        "fused": lambda: fused(q, k, v, fm),
        "linear_attention": lambda: la.linear_attention(q, k, v, fm, causal=True),
    }[path]
    small = [x[..., :256, :].copy() for x in (q, k, v)]
    for f in (fused, la.linear_attention):  # load the compiled kernels and thread pools
        f(*small, fm) if f is fused else f(*small, fm, causal=True)
    gc.collect()
    before = rss("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS
    out = run()
    peak = rss("VmHWM:")
    print(json.dumps({"before": before, "peak": peak, "inputs": 3 * q.nbytes,
                      "outputs": out.nbytes}))
    """
)


def probe_memory(path: str, length: int, heads: int = HEADS) -> dict[str, int]:
    """Peak RSS of one call in a fresh process (Linux ``VmHWM``, reset before the call)."""
    result = subprocess.run(
        [sys.executable, "-c", MEMORY_PROBE, path, str(length), str(heads)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.parametrize("path", ["fused", "linear_attention"])
def test_peak_memory(benchmark: Any, path: str, bench: Any) -> None:
    """Goal: peak memory above inputs and outputs at L=16384 <= 25 % of inputs + outputs.

    Peak resident set size (``VmHWM``, reset through ``/proc/self/clear_refs``) of the
    call in a fresh process, minus the resident size before it (inputs included) and
    the outputs it returns.  This counts Numba's own allocations, which tracemalloc
    does not see.
    """
    figures = probe_memory(path, LENGTH)
    extra = figures["peak"] - figures["before"] - figures["outputs"]
    data = figures["inputs"] + figures["outputs"]
    bench.record(benchmark, f"L=16384 {path} peak RSS above inputs+outputs", extra / 2**20, "MiB")
    bench.record(benchmark, f"L=16384 {path} (peak above) / (inputs + outputs)", extra / data)
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)


def test_backward_over_forward(benchmark: Any, feature_map: la.FeatureMap, bench: Any) -> None:
    """Goal: backward kernel <= 2.5 x forward kernel (log-features given, L=16384)."""
    q, k, v = bench.workload(LENGTH)
    lq, lk, va, kv, mu = kernel_inputs(q, k, v, feature_map)
    out, kv_out, _ = numba_cpu.numpy_forward(lq, lk, va, kv, mu, CHUNK)
    d_out = np.random.default_rng(2).normal(size=out.shape).astype(np.float32)
    d_kv = np.zeros_like(kv_out)
    times = bench.best_times(
        {
            "forward": lambda: numba_cpu.numpy_forward(lq, lk, va, kv, mu, CHUNK),
            "backward": lambda: numba_cpu.numpy_backward(lq, lk, va, kv, mu, CHUNK, d_out, d_kv),
        },
        repeat=5,
    )
    bench.record(benchmark, "L=16384 kernel forward time", 1e3 * times["forward"], "ms")
    bench.record(benchmark, "L=16384 kernel backward time", 1e3 * times["backward"], "ms")
    bench.record(benchmark, "backward / forward", times["backward"] / times["forward"])
    benchmark.pedantic(
        numba_cpu.numpy_backward,
        args=(lq, lk, va, kv, mu, CHUNK, d_out, d_kv),
        rounds=1,
        iterations=1,
    )


def test_million_tokens(benchmark: Any, feature_map: la.FeatureMap, bench: Any) -> None:
    """Goal: L=2^20 (B=1, H=1) in bounded memory, time(2^20) / time(2^19) in [1.8, 2.2]."""
    long = bench.workload(2**20, heads=1)
    half = tuple(np.ascontiguousarray(x[..., : 2**19, :]) for x in long)
    times = bench.best_times(
        {
            "2^19": lambda: fused(*half, feature_map),
            "2^20": lambda: fused(*long, feature_map),
        },
        repeat=2,
    )
    bench.record(benchmark, "L=2^19 H=1 fused time", 1e3 * times["2^19"], "ms")
    bench.record(benchmark, "L=2^20 H=1 fused time", 1e3 * times["2^20"], "ms")
    bench.record(benchmark, "time(2^20) / time(2^19)", times["2^20"] / times["2^19"])
    figures = probe_memory("fused", 2**20, heads=1)
    extra = figures["peak"] - figures["before"] - figures["outputs"]
    bench.record(benchmark, "L=2^20 H=1 fused peak RSS above inputs+outputs", extra / 2**20, "MiB")
    benchmark.pedantic(fused, args=(*long, feature_map), rounds=1, iterations=1)


def test_default_chunk(benchmark: Any, feature_map: la.FeatureMap, bench: Any) -> None:
    """The CPU kernels' own chunk (``chunk_size=None``: 32 for their forward passes)
    against 64, the portable paths' and the backward's, at L=16384 through the front door."""
    from linattn import _dispatch
    from linattn.vjp import linear_attention_vjp

    q, k, v = bench.workload(LENGTH)
    grad = np.random.default_rng(3).normal(size=q.shape).astype(np.float32)
    calls = {
        "causal": {"causal": True},
        "bidirectional window 64": {"window": 64},
        "causal window 64 + 4 sinks": {"causal": True, "window": 64, "sink_keys": 4},
    }
    own, other = _dispatch.CPU_FORWARD_CHUNK_SIZE, _dispatch.DEFAULT_CHUNK_SIZE
    functions = {}
    for name, options in calls.items():
        for chunk in (own, other):
            functions[f"{name}, chunk {chunk}"] = lambda o=options, c=chunk: la.linear_attention(
                q, k, v, feature_map, **o, chunk_size=c
            )
    for chunk in (own, other):
        functions[f"causal VJP, chunk {chunk}"] = lambda c=chunk: linear_attention_vjp(
            q, k, v, feature_map, grad, causal=True, chunk_size=c
        )
    times = bench.best_times(functions, repeat=3)
    for name in (*calls, "causal VJP"):
        ratio = times[f"{name}, chunk {own}"] / times[f"{name}, chunk {other}"]
        bench.record(benchmark, f"{name}: chunk {own} / chunk {other}", ratio)
    benchmark.pedantic(functions[f"causal, chunk {own}"], rounds=1, iterations=1)
