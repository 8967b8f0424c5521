"""How the command line shows results: tables of text (drawn by ``_console``), CSV and JSON."""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from linattn.cli._accuracy import AccuracyRow, fitted_slope
from linattn.cli._benchmark import BenchRow, Crossover
from linattn.cli._console import Table

__all__ = [
    "accuracy_table",
    "bench_tables",
    "compact_table",
    "crossover_table",
    "csv_text",
    "json_text",
    "key_value_table",
    "ordered",
    "write_csv",
    "write_json",
]

MIB = 2**20


def compact_table(title: str) -> Table:
    """A table with a header row; narrow cells keep results inside 80 columns."""
    return Table(title)


def key_value_table(title: str, pairs: Mapping[str, str]) -> Table:
    """A two-column table (used for machine info and settings)."""
    table = Table(title, show_header=False)
    table.add_column()
    table.add_column()
    for key, value in pairs.items():
        table.add_row(key, value)
    return table


def ordered(rows: Sequence[Any], attribute: str) -> list[Any]:
    return list(dict.fromkeys(getattr(r, attribute) for r in rows))


def _short(value: float) -> str:
    """``5.96e-04`` -> ``5.96e-4``: narrow cells keep tables inside 80 columns."""
    mantissa, exponent = f"{value:.2e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def accuracy_table(rows: Sequence[AccuracyRow], metric: str, title: str) -> Table:
    """Rows: m, then the fitted slope; columns: estimators; cells: mean ± standard error."""
    estimators = ordered(rows, "estimator")
    table = compact_table(title)
    table.add_column("m", right=True)
    for estimator in estimators:
        table.add_column(estimator.replace("-", "\n"), right=True)
    cells = {(r.estimator, r.num_features): r for r in rows if r.metric == metric}
    for m in ordered(rows, "num_features"):
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
    for mode in ordered(rows, "mode"):
        table = compact_table(f"{mode.capitalize()}: time (median of {repeats}) and peak memory")
        table.add_column("L", right=True)
        for _, unit, _ in columns:
            table.add_column(f"exact\n{unit}", right=True)
            table.add_column(f"linear\n{unit}", right=True)
            table.add_column("exact ÷\nlinear", right=True)
        cells = {(r.length, r.method): r for r in rows if r.mode == mode}
        for length in ordered(rows, "length"):
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
    table.add_column("L", right=True)
    for c in found:
        table.add_row(c.mode, c.quantity, c.text)
    return table


# -- files ----------------------------------------------------------------------------


def csv_text(rows: Sequence[Any]) -> str:
    """One CSV line per result row (dataclasses with ``as_dict``), under a header."""
    dicts = [r.as_dict() for r in rows]
    handle = io.StringIO(newline="")
    writer = csv.DictWriter(handle, fieldnames=list(dicts[0]) if dicts else [])
    writer.writeheader()
    writer.writerows(dicts)
    return handle.getvalue()


def json_text(payload: Any) -> str:
    """The payload as indented JSON (anything unusual written as its ``str``)."""
    return json.dumps(payload, indent=2, default=str) + "\n"


def write_csv(rows: Sequence[Any], path: Path) -> Path:
    with path.open("w", newline="", encoding="utf-8") as handle:
        handle.write(csv_text(rows))
    return path


def write_json(payload: Any, path: Path) -> Path:
    path.write_text(json_text(payload), encoding="utf-8")
    return path
