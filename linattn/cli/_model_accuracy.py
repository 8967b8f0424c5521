"""``linattn accuracy --model PATH|minilm``: a pretrained encoder with its attention replaced.

The figures come from :mod:`linattn.models.accuracy`; this module checks the request,
shows the progress, and draws the two tables and the plot.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from linattn.cli._console import Console, Table, progress
from linattn.cli._options import CommandError

__all__ = ["cosine_table", "layer_table", "plot_model_accuracy", "run"]


def _cell(value: float | None, digits: int = 3) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def layer_table(payload: dict[str, Any]) -> Table:
    """Per-layer relative error of attention outputs, one row per configuration."""
    rows = payload["results"]
    layers = next((len(r["layer_errors"]) for r in rows if r["available"]), 0)
    table = Table("Relative error of attention outputs per layer (exact hidden states)")
    table.add_column("configuration")
    for layer in range(layers):
        table.add_column(f"L{layer}", right=True)
    table.add_column("mean", right=True)
    family = None
    for row in rows:
        if family is not None and row["family"] != family:
            table.add_section()
        family = row["family"]
        if not row["available"]:
            table.add_row(row["config"], *(["n/a"] * layers), "not available")
            continue
        errors = row["layer_errors"]
        table.add_row(
            row["config"], *(_cell(e, 2) for e in errors), _cell(sum(errors) / layers, 2)
        )
    return table


def cosine_table(payload: dict[str, Any]) -> Table:
    """Mean and minimum embedding cosine to the exact model, and time per encode."""
    rows = payload["results"]
    table = Table(
        f"Sentence-embedding cosine to the exact model ({payload['texts']} texts, "
        f"{payload['long_texts']} of 128+ tokens, {payload['truncated_texts']} truncated at 256)"
    )
    table.add_column("configuration")
    for header in ("mean", "min", "mean 128+", "min 128+", "mean trunc", "min trunc"):
        table.add_column(header, right=True)
    table.add_column("encode s", right=True)
    table.add_column("attn s", right=True)
    table.add_row(
        "exact", *(["1.000"] * 6), _cell(payload["exact_encode_seconds"], 1),
        _cell(payload["exact_attention_seconds"], 1),
    )  # fmt: skip
    family = "exact"
    for row in rows:
        if row["family"] != family:
            table.add_section()
        family = row["family"]
        if not row["available"]:
            table.add_row(row["config"], "not available", *([""] * 7))
            continue
        cells = [
            _cell(row[f"{stat}_{group}"])
            for group in ("all", "long", "trunc")
            for stat in ("mean", "min")
        ]
        table.add_row(
            row["config"], *cells, _cell(row["encode_seconds"], 1),
            _cell(row["attention_seconds"], 1),
        )  # fmt: skip
    return table


def plot_model_accuracy(payload: dict[str, Any], path: Path) -> Path:
    """Per-layer error (left) and mean cosine on 128+ tokens (right), by configuration."""
    from matplotlib import colormaps

    from linattn.cli._plots import new_figure

    rows = [r for r in payload["results"] if r["available"]]
    families = list(dict.fromkeys(r["family"] for r in rows))
    colours = {f: colormaps["tab10"](i) for i, f in enumerate(families)}
    fig = new_figure(13, 5.5)
    left, right = fig.subplots(1, 2)
    for row in rows:
        left.plot(row["layer_errors"], marker="o", color=colours[row["family"]], alpha=0.7)
    for family in families:
        left.plot([], [], color=colours[family], label=family)
    left.set(xlabel="layer", ylabel="||A - A*|| / ||A*||", title="Attention error per layer")
    left.legend()
    labels = [r["config"] for r in rows]
    right.barh(labels, [r["mean_long"] for r in rows], color=[colours[r["family"]] for r in rows])
    right.invert_yaxis()
    right.set(xlim=(0, 1), xlabel="mean cosine to exact, texts of 128+ tokens")
    right.set_title("Sentence embeddings")
    fig.savefig(path, dpi=110)
    return path


def _fitted_configs(folder: Path) -> list[Any]:
    """Window + sinks and the fitted maps in ``folder`` (with the window and sink keys
    they were fitted for)."""
    from linattn.cli._convert import FITTED_FILE
    from linattn.models.accuracy import Config
    from linattn.transfer import load_maps

    path = Path(folder) if Path(folder).is_file() else Path(folder) / FITTED_FILE
    if not path.is_file():
        raise CommandError(
            f"--fitted {folder}: no {FITTED_FILE} there (`linattn convert` writes it; give "
            "its folder or the file)"
        )
    try:
        _, options = load_maps(path, model_fingerprint=None)
    except ImportError:
        raise CommandError(f"--fitted {folder}: reading it needs safetensors") from None
    except ValueError as error:
        raise CommandError(f"--fitted {folder}: {error}") from None
    window, sink_keys = options.get("window"), int(options.get("sink_keys", 1))
    return [
        Config("window+sinks", window=window, sinks=True, sink_keys=sink_keys),
        Config("fitted", window=window, sinks=True, sink_keys=sink_keys, fitted=str(path)),
    ]


def run(args: argparse.Namespace) -> int:
    """Load the model, measure every configuration, print the tables (or JSON)."""
    from linattn.models import ModelUnavailable, load_model
    from linattn.models.accuracy import default_configs, load_texts, measure

    if args.format == "csv":
        raise CommandError("argument --format: --model gives table or json; got csv")
    fitted_configs = None if args.fitted is None else _fitted_configs(args.fitted)
    if isinstance(args.texts, Path):  # (read before the model loads: its errors first)
        from linattn.cli._convert import read_texts

        texts = read_texts(args.texts, least=1)
    else:
        texts = load_texts(args.texts)
    try:
        model = load_model(args.model)
    except ModelUnavailable as error:
        raise CommandError(f"--model {args.model}: {error}") from None
    except ValueError as error:
        raise CommandError(f"--model {args.model}: {error}") from None
    configs = default_configs() if fitted_configs is None else fitted_configs
    batch_size = 20
    steps = math.ceil(len(texts) / batch_size) * (len(configs) + 1)
    with progress(args.format == "table") as bar:
        task = bar.add_task(f"{len(configs)} configurations x {len(texts)} texts", total=steps)
        measurement = measure(
            model, texts, configs, batch_size=batch_size, on_step=lambda: bar.advance(task)
        )
    payload = measurement.as_dict()
    payload["model"] = str(model.path)
    if args.json is not None:
        Path(args.json).write_text(json.dumps(payload, indent=1))
    if args.format == "json":
        print(json.dumps(payload, indent=1))
        return 0
    console = Console()
    console.print(layer_table(payload))
    console.print(cosine_table(payload))
    if args.plot is not None:
        console.print(f"wrote: {plot_model_accuracy(payload, Path(args.plot))}")
    return 0
