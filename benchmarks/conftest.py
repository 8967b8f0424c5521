"""Shared pieces of the benchmark suites: the workload, interleaved timing, the figures table.

Every ratio is taken within one run from interleaved, best-of-N wall times (the
machine is shared, so the minimum is the least disturbed figure); each timed call
follows an untimed one of the same function (see :func:`best_times`).  The figures are
printed at the end of the session and kept in each benchmark's ``extra_info``
(``--benchmark-json`` saves them).
"""

from __future__ import annotations

import os

# Kernels compile in the call, never in the background (linattn._warm): the benchmarks assert
# or time which path runs a call, which must not depend on what a cache holds.
os.environ["LINATTN_COMPILE"] = "foreground"

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

#: The issue's workload: B=1, H=8, d=64, m=256, float32.
HEADS, HEAD_DIM, FEATURES = 8, 64, 256

FIGURES: list[tuple[str, str]] = []

#: Pause before each timed call (see :func:`best_times`).
SETTLE_SECONDS = 0.25


class Bench:
    """Helpers handed to the benchmarks by the ``bench`` fixture."""

    heads, head_dim, features = HEADS, HEAD_DIM, FEATURES

    @staticmethod
    def record(benchmark: Any, name: str, value: float, unit: str = "") -> None:
        """Keep one figure for the summary table and the benchmark's JSON."""
        benchmark.extra_info[name] = value
        FIGURES.append((name, f"{value:.4g} {unit}".rstrip()))

    @staticmethod
    def best_times(
        functions: dict[str, Callable[[], object]],
        repeat: int,
        clock: Callable[[], float] = time.perf_counter,
    ) -> dict[str, float]:
        return best_times(functions, repeat, clock)

    @staticmethod
    def workload(length: int, heads: int = HEADS, seed: int = 0) -> tuple[np.ndarray, ...]:
        return make_workload(length, heads, seed)


@pytest.fixture(scope="session")
def bench() -> Bench:
    return Bench()


def best_times(
    functions: dict[str, Callable[[], object]],
    repeat: int,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    """Best-of-``repeat`` seconds of each function, run interleaved (round robin).

    ``clock`` is wall time by default; ``time.process_time`` (the CPU time of all the
    process's threads) is less disturbed by other processes on a loaded machine.

    Each timed call follows a pause of :data:`SETTLE_SECONDS` and an untimed call of
    the same function: thread pools spin on after a call (OpenBLAS's for about 0.1 s,
    OpenMP's in torch) and would otherwise take the cores from whichever function runs
    next, charging one library's idle threads to another (seen here: 40 ms instead of
    23 ms for the fused pass at L = 1024 right after NumPy's exact attention).
    """
    best = dict.fromkeys(functions, float("inf"))
    for fn in functions.values():  # warm-up: compilation, caches, thread pools
        fn()
    for _ in range(repeat):
        for name, fn in functions.items():
            time.sleep(SETTLE_SECONDS)  # other libraries' threads stop spinning
            fn()  # this function's caches and threads are warm
            start = clock()
            fn()
            best[name] = min(best[name], clock() - start)
    return best


def make_workload(length: int, heads: int = HEADS, seed: int = 0) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    return tuple(
        rng.normal(size=(1, heads, length, HEAD_DIM)).astype(np.float32) for _ in range(3)
    )


@pytest.fixture(scope="session")
def feature_map() -> Any:
    import linattn as la

    return la.FeatureMap(HEAD_DIM, FEATURES, seed=0)


def pytest_sessionstart(session: pytest.Session) -> None:
    FIGURES.append(("load average at start (1, 5, 15 min)", _load()))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if len(FIGURES) <= 1:
        return
    FIGURES.append(("load average at end (1, 5, 15 min)", _load()))
    terminalreporter.section("linattn figures (ratios from one run)")
    width = max(len(name) for name, _ in FIGURES)
    for name, value in FIGURES:
        terminalreporter.write_line(f"{name:<{width}}  {value}")


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg()) + f" on {os.cpu_count()} cores"
