"""The portable causal paths (issue 12): the batched pass, its passes per group, decoding,
and what tracing frameworks see (jaxpr size, compile time).

``pytest benchmarks/test_causal_paths.py --benchmark-only -p no:randomly``; figures in
the summary table at the end.  Times are best-of-N, interleaved (see ``conftest.py``).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

import linattn as la
from linattn import _dispatch

LENGTH = 16384


@pytest.fixture(scope="module")
def feature_map(bench: Any) -> la.FeatureMap:
    return la.FeatureMap(bench.head_dim, bench.features, seed=0)


def test_array_api_passes(
    benchmark: Any, feature_map: la.FeatureMap, bench: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NumPy on the array-API path at L = 16384: tokens per pass (the plan's constant)."""
    q, k, v = bench.workload(LENGTH)

    def run(tokens: int) -> Any:
        def call() -> Any:
            monkeypatch.setattr(_dispatch.scan, "EAGER_CPU_TOKENS_PER_PASS", tokens)
            return la.linear_attention(q, k, v, feature_map, causal=True, backend="array_api")

        return call

    sizes = {"one chunk": 1, "1024 tokens": 1024, "4096 tokens": 4096, "one pass": LENGTH}
    times = bench.best_times({name: run(tokens) for name, tokens in sizes.items()}, repeat=2)
    for name, seconds in times.items():
        bench.record(benchmark, f"array API causal L=16384, {name} per pass", 1e3 * seconds, "ms")
    benchmark.pedantic(run(1), rounds=1, iterations=1)


def test_decode_step(benchmark: Any, feature_map: la.FeatureMap, bench: Any) -> None:
    """One token after a 4096-token prefill, B = 1, H = 8: kernel against array API."""
    q, k, v = bench.workload(4097)
    _, state = la.linear_attention(
        q[..., :4096, :], k[..., :4096, :], v[..., :4096, :], feature_map,
        causal=True, return_state=True,
    )  # fmt: skip
    token = tuple(x[..., 4096:, :] for x in (q, k, v))

    def step(backend: str) -> Any:
        return lambda: la.linear_attention(
            *token, feature_map, causal=True, state=state, return_state=True, backend=backend
        )

    times = bench.best_times({"kernel": step("auto"), "array API": step("array_api")}, 50)
    for name, seconds in times.items():
        bench.record(benchmark, f"decode step {name}", 1e6 * seconds, "us")
    benchmark.pedantic(step("auto"), rounds=20, iterations=1)


@pytest.mark.parametrize("length", [256, 4096, 65536])
def test_jax_trace_and_compile(benchmark: Any, length: int, bench: Any) -> None:
    """jaxpr equations and jit compile seconds of causal forward and grad (B=1, H=2)."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    fm = la.FeatureMap(bench.head_dim, bench.features, seed=0)
    q = jnp.zeros((1, 2, length, bench.head_dim), jnp.float32)

    def forward(q: Any) -> Any:
        return la.linear_attention(q, q, q, fm, causal=True)

    def gradient(q: Any) -> Any:
        return jax.grad(lambda x: jnp.sum(forward(x)))(q)

    for name, function in (("forward", forward), ("grad", gradient)):
        equations = len(jax.make_jaxpr(function)(q).jaxpr.eqns)
        start = time.perf_counter()
        jax.jit(function).lower(q).compile()
        seconds = time.perf_counter() - start
        bench.record(benchmark, f"JAX causal {name} L={length} jaxpr equations", equations)
        bench.record(benchmark, f"JAX causal {name} L={length} jit compile", seconds, "s")
    benchmark.pedantic(lambda: np.zeros(1), rounds=1, iterations=1)
