"""The benchmark behind ``linattn bench`` and ``demo``: plain functions, no I/O.

Times exact and linear attention as the sequence grows, measures their peak memory,
and finds the length where linear attention starts to win.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

import linattn as la
from linattn.cli._accuracy import Step, no_step
from linattn.cli._backends import ArrayLibrary

__all__ = [
    "METHODS",
    "MODES",
    "BenchRow",
    "BenchSetup",
    "Crossover",
    "benchmark",
    "calibration_note",
    "crossovers",
]


# -- speed and memory ------------------------------------------------------------


@dataclass(frozen=True)
class BenchRow:
    """Best time and peak memory of one method and mode at one sequence length."""

    length: int
    method: str
    mode: str
    seconds: float | None
    peak_bytes: int | None
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


METHODS = ("exact", "linear")
MODES = ("bidirectional", "causal")


@dataclass(frozen=True)
class BenchSetup:
    """The workload: ``(batch, heads, L, head_dim)`` inputs and the feature map of linear."""

    batch: int = 1
    heads: int = 8
    head_dim: int = 64
    num_features: int = 256
    kind: str = "positive"
    dtype: str = "float32"
    repeats: int = 3
    max_exact_length: int = 4096
    seed: int = 0


def benchmark(
    library: ArrayLibrary,
    lengths: Sequence[int],
    setup: BenchSetup,
    *,
    methods: Sequence[str] = METHODS,
    modes: Sequence[str] = MODES,
    on_step: Step = no_step,
) -> list[BenchRow]:
    """Time (median of ``setup.repeats``) and peak memory for each length, method and mode.

    Each method and mode is called once before timing at the first length (and at
    every length for JAX, which compiles per shape), so compile time is excluded.
    Peak memory comes from one extra call under ``library.peak_memory``.
    ``on_step`` is called once per (length, method, mode).  A feature map that needs
    query/key statistics (OPRF kinds; causal attention cannot compute them on the fly)
    is calibrated on each length's own queries and keys before timing, untimed.

    Examples
    --------
    >>> from linattn.cli._backends import load_library
    >>> rows = benchmark(load_library("numpy", "float32"), [8], BenchSetup(
    ...     heads=1, head_dim=4, num_features=8, kind="oprf", repeats=1))
    >>> [(r.method, r.mode) for r in rows][:2]
    [('exact', 'bidirectional'), ('exact', 'causal')]
    """
    base_map = la.FeatureMap(
        setup.head_dim,
        setup.num_features,
        kind=setup.kind,  # type: ignore[arg-type]
        seed=setup.seed,
    )
    rng = np.random.default_rng(setup.seed)
    warmed: set[tuple[str, str]] = set()
    rows = []
    for length in lengths:
        shape = (setup.batch, setup.heads, length, setup.head_dim)
        host_q, host_k = (0.5 * rng.standard_normal(shape) for _ in range(2))
        feature_map = base_map
        if base_map.needs_calibration:
            feature_map = base_map.calibrate(host_q, host_k)
        q, k = library.asarray(host_q), library.asarray(host_k)
        del host_q, host_k
        v = library.asarray(0.5 * rng.standard_normal(shape))
        for method in methods:
            for mode in modes:
                if method == "exact" and length > setup.max_exact_length:
                    rows.append(
                        BenchRow(length, method, mode, None, None, "skipped: > max exact length")
                    )
                    on_step()
                    continue
                call = _attention_call(method, mode == "causal", q, k, v, feature_map)
                if (method, mode) not in warmed or library.name == "jax":
                    library.wait(call())
                    warmed.add((method, mode))
                times = []
                for _ in range(setup.repeats):
                    start = time.perf_counter()
                    library.wait(call())
                    times.append(time.perf_counter() - start)
                gc.collect()
                with library.peak_memory() as peak:
                    out = call()
                    library.wait(out)
                    del out
                rows.append(BenchRow(length, method, mode, statistics.median(times), peak.bytes))
                on_step()
        del q, k, v
        gc.collect()
    return rows


def calibration_note(setup: BenchSetup) -> str | None:
    """How the benchmark fixes the feature map's statistics, or None when it has none."""
    probe = la.FeatureMap(setup.head_dim, setup.num_features, kind=setup.kind)  # type: ignore[arg-type]
    if not probe.needs_calibration:
        return None
    return (
        f"{setup.kind} statistics calibrated on each length's generated queries and keys "
        "before timing (FeatureMap.calibrate, not timed)"
    )


def _attention_call(
    method: str, causal: bool, q: Any, k: Any, v: Any, feature_map: la.FeatureMap
) -> Callable[[], Any]:
    if method == "exact":
        return lambda: la.softmax_attention(q, k, v, causal=causal)
    return lambda: la.linear_attention(q, k, v, feature_map, causal=causal)


@dataclass(frozen=True)
class Crossover:
    """Where linear attention starts to beat exact attention in one quantity."""

    mode: str
    quantity: str
    length: float | None
    text: str


def _crossing(points: list[tuple[int, float]]) -> tuple[float | None, str]:
    """The length from which linear attention wins at every longer length measured (the
    ratio linear / exact below 1 from there on), interpolated in log-log between the
    last length where it lost and the next; earlier lengths where it won are named (a
    win the next length takes back is within the noise, not a crossover)."""
    if not points:
        return None, "not measured"
    losing = [i for i, (_, ratio) in enumerate(points) if ratio >= 1]
    if not losing:
        return None, f"≤ {points[0][0]} (linear wins at every length measured)"
    last = losing[-1]
    if last == len(points) - 1:
        wins = [str(n) for n, ratio in points if ratio < 1]
        also = f"; linear won at {', '.join(wins)} only" if wins else ""
        return None, f"> {points[-1][0]} (exact wins at the longest length measured{also})"
    (before, ratio_before), (length, ratio) = points[last], points[last + 1]
    frac = math.log(ratio_before) / (math.log(ratio_before) - math.log(ratio))
    value = math.exp(math.log(before) + frac * (math.log(length) - math.log(before)))
    wins = [str(n) for n, r in points[:last] if r < 1]
    also = f" (linear also won at {', '.join(wins)}, then lost)" if wins else ""
    return value, f"≈ {value:,.0f}{also}"


def crossovers(rows: Sequence[BenchRow]) -> list[Crossover]:
    """Crossover lengths for time and memory, bidirectional and causal."""
    found = []
    for mode in MODES:
        for quantity, field in (("time", "seconds"), ("peak memory", "peak_bytes")):
            table: dict[tuple[str, int], float] = {}
            for r in rows:
                value = getattr(r, field)
                if r.mode == mode and value is not None:
                    table[(r.method, r.length)] = float(value)
            points = [
                (length, max(table[("linear", length)] / table[("exact", length)], 1e-12))
                for length in sorted({r.length for r in rows})
                if ("linear", length) in table and table.get(("exact", length), 0) > 0
            ]
            if not points and not any(r.mode == mode for r in rows):
                continue
            length, text = _crossing(points)
            found.append(Crossover(mode, quantity, length, text))
    return found
