"""PNG plots of the results: matplotlib's object interface on the Agg canvas.

No pyplot, no display, no global backend switch: plots work on headless machines
and in tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from linattn.cli._accuracy import AccuracyRow
from linattn.cli._benchmark import BenchRow, Crossover
from linattn.cli._report import MIB, ordered

__all__ = ["new_figure", "plot_accuracy", "plot_bench", "plot_demo"]

# -- plots ----------------------------------------------------------------------------

COLORS = {"exact": "tab:red", "linear": "tab:blue"}
STYLES = {"bidirectional": "-", "causal": "--"}


def new_figure(width: float, height: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _accuracy_axes(ax: Any, rows: Sequence[AccuracyRow], metric: str, ylabel: str) -> None:
    for estimator in ordered(rows, "estimator"):
        points = [r for r in rows if r.estimator == estimator and r.metric == metric]
        ax.errorbar(
            [r.num_features for r in points],
            [r.mean for r in points],
            yerr=[r.standard_error for r in points],
            marker="o",
            markersize=3,
            capsize=2,
            label=estimator,
        )
    features = sorted({r.num_features for r in rows})
    top = [r.mean for r in rows if r.metric == metric and r.num_features == features[0]]
    if len(features) > 1 and top and max(top) > 0:
        guide = 1.0 if metric == "mse" else 0.5
        ax.plot(
            features,
            [max(top) * (m / features[0]) ** -guide for m in features],
            color="gray",
            linestyle=":",
            label=rf"$\propto m^{{-{guide:g}}}$",
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("random features m")
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)


def _bench_axes(ax: Any, rows: Sequence[BenchRow], field: str, scale: float, ylabel: str) -> None:
    for method in ordered(rows, "method"):
        for mode in ordered(rows, "mode"):
            points = [
                (r.length, getattr(r, field))
                for r in rows
                if r.method == method and r.mode == mode and getattr(r, field) is not None
            ]
            if points:
                ax.plot(
                    [p[0] for p in points],
                    [
                        max(p[1], 1) * scale if field == "peak_bytes" else p[1] * scale
                        for p in points
                    ],
                    color=COLORS.get(method),
                    linestyle=STYLES.get(mode, "-"),
                    marker="o",
                    markersize=3,
                    label=f"{method} {mode}",
                )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length L")
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)


def _mark_crossovers(ax: Any, found: Sequence[Crossover], quantity: str) -> None:
    for c in found:
        if c.quantity == quantity and c.length is not None:
            ax.axvline(
                c.length,
                color="gray",
                linestyle=STYLES.get(c.mode, "-"),
                alpha=0.6,
                label=f"crossover, {c.mode}",
            )


def plot_accuracy(rows: Sequence[AccuracyRow], path: Path, title: str) -> Path:
    """Error against m, log-log, one line per estimator, standard errors as bars."""
    labels = {"mse": "attention output MSE", "tv": "total variation of attention rows"}
    metrics = [metric for metric in labels if any(r.metric == metric for r in rows)]
    figure = new_figure(4.5 * len(metrics), 3.4)
    axes = figure.subplots(1, len(metrics), squeeze=False)[0]
    for ax, metric in zip(axes, metrics, strict=True):
        _accuracy_axes(ax, rows, metric, labels[metric])
    axes[0].legend(fontsize=7)
    figure.suptitle(title, fontsize=10)
    figure.savefig(path)
    return path


def plot_bench(
    rows: Sequence[BenchRow], found: Sequence[Crossover], path: Path, title: str
) -> Path:
    """Time and peak memory against L, exact and linear, bidirectional and causal."""
    figure = new_figure(9, 3.4)
    left, right = figure.subplots(1, 2)
    _bench_axes(left, rows, "seconds", 1e3, "time (ms)")
    _bench_axes(right, rows, "peak_bytes", 1 / MIB, "peak memory (MiB)")
    _mark_crossovers(left, found, "time")
    _mark_crossovers(right, found, "peak memory")
    left.legend(fontsize=7)
    figure.suptitle(title, fontsize=10)
    figure.savefig(path)
    return path


def plot_demo(
    accuracy: Sequence[AccuracyRow],
    bench: Sequence[BenchRow],
    found: Sequence[Crossover],
    path: Path,
    title: str,
) -> Path:
    """The one-picture summary: error vs m, time vs L, memory vs L."""
    figure = new_figure(12, 3.4)
    first, second, third = figure.subplots(1, 3)
    _accuracy_axes(first, accuracy, "mse", "attention output MSE")
    first.legend(fontsize=7)
    first.set_title("error vs exact softmax", fontsize=9)
    _bench_axes(second, bench, "seconds", 1e3, "time (ms)")
    _mark_crossovers(second, found, "time")
    second.legend(fontsize=7)
    second.set_title("time", fontsize=9)
    _bench_axes(third, bench, "peak_bytes", 1 / MIB, "peak memory (MiB)")
    _mark_crossovers(third, found, "peak memory")
    third.set_title("peak memory", fontsize=9)
    figure.suptitle(title, fontsize=10)
    figure.savefig(path)
    return path
