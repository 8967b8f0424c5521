"""Graph size and build time of linear attention on Dask arrays (issue 12); run
``pytest benchmarks/test_dask_graph.py --benchmark-only -p no:randomly``.

Workload: ``B = 1``, ``H = 4``, ``d = m = 64``, float64, sequence chunks of 8192 tokens
(lazy random inputs, never computed).  For causal and bidirectional attention this
records, for :func:`linattn.distributed.dask_linear_attention` at ``L = 65536`` (8
chunks) and for the front door :func:`linattn.linear_attention` at ``L = 16384`` (8
chunks of 2048; before ``linear_attention`` hands Dask arrays to
``dask_linear_attention`` its causal graph takes minutes to build at 65536), the tasks
in the graph, the time to build it and the number of output sequence chunks; and how
many computes ``FeatureMap.calibrate`` runs on Dask inputs.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

import linattn as la

da = pytest.importorskip("dask.array")
dask = pytest.importorskip("dask")

from linattn.distributed import dask_linear_attention  # noqa: E402

HEADS, HEAD_DIM, FEATURES, CHUNK = 4, 64, 64, 8192


def _lazy(length: int, chunk: int) -> Any:
    rng = da.random.default_rng(0)
    return rng.standard_normal((1, HEADS, length, HEAD_DIM), chunks=(1, HEADS, chunk, HEAD_DIM))


def _graph(function: Any, length: int, chunk: int, causal: bool) -> tuple[float, int, int]:
    """Seconds to build, tasks, output sequence chunks."""
    x = _lazy(length, chunk)
    fm = la.FeatureMap(HEAD_DIM, FEATURES, seed=0)
    start = time.perf_counter()
    out = function(x, x, x, fm, causal=causal)
    seconds = time.perf_counter() - start
    return seconds, len(out.__dask_graph__()), len(out.chunks[2])


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_dask_graph(benchmark: Any, bench: Any, causal: bool) -> None:
    mode = "causal" if causal else "bidirectional"
    seconds, tasks, chunks = benchmark.pedantic(
        _graph, (dask_linear_attention, 65536, CHUNK, causal), rounds=5, iterations=1
    )
    bench.record(benchmark, f"{mode} dask_linear_attention L=65536: tasks", tasks)
    bench.record(benchmark, f"{mode} dask_linear_attention L=65536: build", seconds, "s")
    bench.record(benchmark, f"{mode} dask_linear_attention L=65536: output chunks", chunks)
    assert chunks == 8
    seconds, tasks, chunks = _graph(la.linear_attention, 16384, CHUNK // 4, causal)
    bench.record(benchmark, f"{mode} linear_attention L=16384: tasks", tasks)
    bench.record(benchmark, f"{mode} linear_attention L=16384: build", seconds, "s")
    bench.record(benchmark, f"{mode} linear_attention L=16384: output chunks", chunks)


def test_calibrate_computes(benchmark: Any, bench: Any) -> None:
    """How often ``calibrate`` computes its Dask inputs (goal: once)."""
    calls = []

    def counting(graph: Any, keys: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return dask.get(graph, keys, **kwargs)

    x = _lazy(16384, CHUNK // 4)
    mask = da.ones(x.shape[:-1], dtype=bool, chunks=x.chunks[:-1])
    fm = la.FeatureMap(HEAD_DIM, FEATURES, kind="hyperbolic_oprf", rebalance=True, seed=0)

    def count() -> dict[str, int]:
        counts = {}
        for key_mask, name in ((None, "unmasked"), (mask, "masked")):
            calls.clear()
            with dask.config.set(scheduler=counting):
                fm.calibrate(x, x, key_mask=key_mask)
            counts[name] = len(calls)
        return counts

    for name, n in benchmark.pedantic(count, rounds=1, iterations=1).items():
        bench.record(benchmark, f"calibrate on Dask, {name}: computes", n)
