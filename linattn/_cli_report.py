"""How the command line shows results: rich tables, PNG plots (matplotlib, Agg), CSV and JSON.

Plots use matplotlib's object interface with the Agg canvas (no pyplot, no
display, no global backend switch), so they work on headless machines and in tests.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich import box
from rich.table import Table

from linattn._cli_studies import AccuracyRow, BenchRow, Crossover, fitted_slope

__all__ = [
    "accuracy_table",
    "bench_tables",
    "compact_table",
    "crossover_table",
    "key_value_table",
    "plot_accuracy",
    "plot_bench",
    "plot_demo",
    "write_csv",
    "write_json",
]

MIB = 2**20


def compact_table(title: str) -> Table:
    """Compact tables without vertical rules: results fit in 80 columns."""
    return Table(
        title=title,
        title_justify="left",
        title_style="bold",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
    )


def key_value_table(title: str, pairs: Mapping[str, str]) -> Table:
    """A two-column table (used for machine info and settings)."""
    table = Table(
        title=title, show_header=False, title_justify="left", title_style="bold", box=None
    )
    table.add_column(style="bold")
    table.add_column()
    for key, value in pairs.items():
        table.add_row(key, value)
    return table


def _ordered(rows: Sequence[Any], attribute: str) -> list[Any]:
    return list(dict.fromkeys(getattr(r, attribute) for r in rows))


def _short(value: float) -> str:
    """``5.96e-04`` -> ``5.96e-4``: narrow cells keep tables inside 80 columns."""
    mantissa, exponent = f"{value:.2e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def accuracy_table(rows: Sequence[AccuracyRow], metric: str, title: str) -> Table:
    """Rows: m, then the fitted slope; columns: estimators; cells: mean ± standard error."""
    estimators = _ordered(rows, "estimator")
    table = compact_table(title)
    table.add_column("m", justify="right")
    for estimator in estimators:
        table.add_column(estimator.replace("-", "\n"), justify="right")
    cells = {(r.estimator, r.num_features): r for r in rows if r.metric == metric}
    for m in _ordered(rows, "num_features"):
        values = []
        for estimator in estimators:
            row = cells.get((estimator, m))
            if row is None:
                values.append("")
                continue
            relative = row.standard_error / row.mean if row.mean > 0 else math.nan
            values.append(f"{_short(row.mean)} ±{100 * relative:.0f}%")
        table.add_row(str(m), *values)
    slopes = [fitted_slope(rows, estimator, metric) for estimator in estimators]
    table.add_section()
    table.add_row("slope", *("" if math.isnan(s) else f"{s:+.2f}" for s in slopes))
    return table


def _format_ratio(exact: float | None, linear: float | None) -> str:
    if exact is None or linear is None or linear <= 0:
        return "—"
    return f"{exact / linear:.2f}×"


def bench_tables(rows: Sequence[BenchRow], repeats: int) -> list[Table]:
    """One table per mode: time and peak memory of exact and linear, and their ratios."""
    tables = []
    columns = (("seconds", "ms", 1e3), ("peak_bytes", "MiB", 1 / MIB))
    for mode in _ordered(rows, "mode"):
        table = compact_table(f"{mode.capitalize()}: time (best of {repeats}) and peak memory")
        table.add_column("L", justify="right")
        for _, unit, _ in columns:
            table.add_column(f"exact\n{unit}", justify="right")
            table.add_column(f"linear\n{unit}", justify="right")
            table.add_column("exact ÷\nlinear", justify="right")
        cells = {(r.length, r.method): r for r in rows if r.mode == mode}
        for length in _ordered(rows, "length"):
            values = [f"{length:,}"]
            for field, _, scale in columns:
                exact, linear = (
                    getattr(cells[(length, method)], field) if (length, method) in cells else None
                    for method in ("exact", "linear")
                )
                for value in (exact, linear):
                    values.append("—" if value is None else f"{value * scale:,.1f}")
                values.append(_format_ratio(exact, linear))
            table.add_row(*values)
        tables.append(table)
    return tables


def crossover_table(found: Sequence[Crossover]) -> Table:
    """The length from which linear attention beats exact attention."""
    table = compact_table("Crossover: linear beats exact from length")
    table.add_column("mode")
    table.add_column("quantity")
    table.add_column("L", justify="right")
    for c in found:
        table.add_row(c.mode, c.quantity, c.text)
    return table


# -- files ----------------------------------------------------------------------------


def write_csv(rows: Sequence[Any], path: Path) -> Path:
    """One CSV line per result row (dataclasses with ``as_dict``)."""
    dicts = [r.as_dict() for r in rows]
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(dicts[0]) if dicts else [])
        writer.writeheader()
        writer.writerows(dicts)
    return path


def write_json(payload: Any, path: Path) -> Path:
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n", encoding="utf-8")
    return path


# -- plots ----------------------------------------------------------------------------

COLORS = {"exact": "tab:red", "linear": "tab:blue"}
STYLES = {"bidirectional": "-", "causal": "--"}


def _figure(width: float, height: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _accuracy_axes(ax: Any, rows: Sequence[AccuracyRow], metric: str, ylabel: str) -> None:
    for estimator in _ordered(rows, "estimator"):
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
    for method in _ordered(rows, "method"):
        for mode in _ordered(rows, "mode"):
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
    figure = _figure(4.5 * len(metrics), 3.4)
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
    figure = _figure(9, 3.4)
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
    figure = _figure(12, 3.4)
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
