"""Stitching (c), measured: per-layer fitted maps, then
:func:`linattn.integrations.transformers.refine` (a short fit of only the maps and far
weights, all layers together, against the exact model's final hidden states; model
frozen).

The per-layer fit is ``linattn.models.convert.convert_encoder`` on NumPy (stitching (a),
as ``benchmarks/transfer_minilm.py``), saved to ``--maps`` and reused when present.  Its
maps go on all-MiniLM-L6-v2 in transformers (``attn_implementation="linattn"``, window,
the first ``--sink-keys`` keys (:data:`linattn.transfer.SINK_KEYS` by default) and
``[SEP]`` exact: ``exact_keys="special"``), ``refine`` fits them on the FIT split and
keeps the step with the lowest last-hidden-state error on the VALIDATION split; the
figures are mean and minimum embedding cosines to the exact model on the TEST split
(``benchmarks/documents.py``; texts: also over those of 128+ tokens), measured on the
library's own path (the torch kernels executor), before and after.

    python benchmarks/transfer_end_to_end.py --data docs --window 16 --steps 60
    python benchmarks/transfer_end_to_end.py --data docs --window 16 --steps 100 --loss pooled

``--layers`` adds each layer's attention error on the TEST split, on the converted model's
own activations (``layer_errors(..., activations="converted")``), before and after.

``--exact-heads N`` gives the ``N`` heads per layer with the most fitted error on the
VALIDATION split exact attention (``convert(exact_heads=N)``'s choice), after the first row.

The first row is window + sinks alone (every far weight 0) on the same path and texts, the
baseline of the ``1 - cos`` ratios printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
import documents
from transformers import AutoModel

from linattn.integrations.transformers import layer_errors, refine, state_of
from linattn.integrations.transformers.state import update
from linattn.models import load_model, resolve_model_path
from linattn.models.convert import (
    attention_from_file,
    convert_encoder,
    length_batches,
    save_fitted,
)
from linattn.transfer import SINK_KEYS


def pooled(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    w = mask[..., None].to(hidden.dtype)
    emb = (hidden * w).sum(1) / w.sum(1).clamp_min(1e-9)
    return torch.nn.functional.normalize(emb, dim=-1)


def inputs(ids: np.ndarray, mask: np.ndarray) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask.astype(np.int64))}


def encode_times(model, maps, batches, repeats: int) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Median seconds to encode ``batches`` per configuration (interleaved rounds after one
    warm-up round), and each one's ratio to exact attention; the model comes back as it
    was."""
    modules = [layer.attention.self for layer in model.encoder.layer]
    heads = [state_of(m).exact_heads for m in modules]

    def configure(name: str) -> None:
        model.set_attn_implementation("sdpa" if name == "exact" else "linattn")
        for module, fm, exact in zip(modules, maps, heads, strict=True):
            g0 = name == "window + sinks"
            with_heads = name == "fitted + exact heads" and exact
            update(
                module,
                fitted=fm.with_parameters(far_weight=0.0) if g0 else fm,
                exact_heads=exact if with_heads else (),
            )

    names = ["exact", "window + sinks", "fitted"] + (["fitted + exact heads"] * any(heads))
    seconds: dict[str, list[float]] = {name: [] for name in names}
    with torch.no_grad():
        for round_ in range(repeats + 1):
            for name in names:
                configure(name)
                start = time.perf_counter()
                for b in batches:
                    model(**b)
                if round_:  # round 0 warms every path up
                    seconds[name].append(time.perf_counter() - start)
    configure("fitted + exact heads")
    median = {name: float(np.median(t)) for name, t in seconds.items()}
    return {
        **{f"{name} s": round(t, 3) for name, t in median.items()},
        **{f"{name} / exact": round(t / median["exact"], 3) for name, t in median.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", choices=("docs", "texts"), default="docs")
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--m", type=int, default=64)
    ap.add_argument(
        "--sink-keys", type=int, default=SINK_KEYS,
        help="the first keys of every row attended exactly (the conversion's default)",
    )  # fmt: skip
    ap.add_argument("--fit-steps", type=int, default=150, help="per-layer fit steps")
    ap.add_argument("--steps", type=int, default=60, help="end-to-end steps")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--loss", choices=("hidden", "pooled"), default="hidden")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--fit-rows", type=int, default=None)
    ap.add_argument(
        "--exact-heads", type=int, default=0,
        help="heads per layer attending exactly (those with the most fitted error on the "
        "VALIDATION split, as convert(exact_heads=) chooses them)",
    )  # fmt: skip
    ap.add_argument("--maps", default="/tmp/linattn-e2e-maps.safetensors")
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--time-repeats", type=int, default=0,
        help="also time encoding the TEST split: exact (SDPA), window + sinks, the fitted "
        "hybrid and (with --exact-heads) the fitted hybrid with exact heads, interleaved, "
        "this many rounds (medians, ratios to exact)",
    )  # fmt: skip
    ap.add_argument(
        "--layers", action="store_true",
        help="also each layer's attention error on the TEST split, on the converted "
        "model's own activations, before and after refining",
    )  # fmt: skip
    args = ap.parse_args()
    torch.manual_seed(0)
    build = documents.documents if args.data == "docs" else documents.committed_texts
    split = {name: build(name) for name in documents.SPLITS}
    limit = {"fit": args.fit_rows, "validation": None, "test": None}
    parts = {
        name: length_batches(b.input_ids, b.mask, np.arange(len(b))[: limit[name]], args.batch)
        for name, b in split.items()
    }
    encoder = load_model("minilm").encoder
    maps_path = Path(args.maps)
    if not maps_path.exists():
        start = time.perf_counter()
        done = convert_encoder(
            encoder, parts["fit"], parts["validation"], window=args.window,
            sink_keys=args.sink_keys, num_features=args.m,
            steps=args.fit_steps, progress=lambda line: None,
        )  # fmt: skip
        save_fitted(maps_path, done)
        print(f"# per-layer fit {time.perf_counter() - start:.0f} s -> {maps_path}", flush=True)
    fitted = attention_from_file(maps_path, encoder)
    if (fitted.window, fitted.sink_keys) != (args.window, args.sink_keys):
        raise SystemExit(
            f"--maps {maps_path} was fitted for window {fitted.window} and "
            f"{fitted.sink_keys} sink keys; got --window {args.window} --sink-keys "
            f"{args.sink_keys}"
        )
    model = AutoModel.from_pretrained(resolve_model_path("minilm")).eval()
    exact = {}
    with torch.no_grad():
        for name in ("validation", "test"):
            exact[name] = [model(**inputs(*b)).last_hidden_state for b in parts[name]]
    model.config.linattn = {
        "num_features": args.m, "window": args.window, "sink_keys": args.sink_keys,
        "exact_keys": "special",
    }  # fmt: skip
    model.set_attn_implementation("linattn")
    for layer, fm in zip(model.encoder.layer, fitted.maps, strict=True):
        update(layer.attention.self, fitted=fm)  # the NumPy fit's maps

    test_inputs = [inputs(*b) for b in parts["test"]]

    def layers() -> dict[str, list[float]]:
        """Per layer, relative attention error (heads combined) on the converted model's
        own activations: fitted, window + sinks on the same activations, their ratio."""
        out: dict[str, list[float]] = {"fitted": [], "window_sinks": [], "ratio": []}
        for entry in layer_errors(model, test_inputs, activations="converted"):
            n = entry["exact_squared_norm"]
            fitted, base = (
                float(np.sqrt((entry[key] ** 2 * n).sum() / n.sum()))
                for key in ("fitted", "exact_parts")
            )
            out["fitted"].append(round(fitted, 4))
            out["window_sinks"].append(round(base, 4))
            out["ratio"].append(round(fitted / base, 3))
        return out

    def row(step: str) -> dict:
        out: dict[str, object] = {"step": step}
        for name in ("validation", "test"):
            cos = []
            with torch.no_grad():
                for (ids, mask), hidden in zip(parts[name], exact[name], strict=True):
                    m = torch.tensor(mask)
                    got = model(**inputs(ids, mask)).last_hidden_state
                    cos.append((pooled(got, m) * pooled(hidden, m)).sum(-1))
            c = torch.cat(cos).numpy()
            out[f"{name}_mean"], out[f"{name}_min"] = float(c.mean()), float(c.min())
            long = np.concatenate([mask.sum(1) for _, mask in parts[name]]) >= 128
            if name == "test" and long.any() and not long.all():  # texts: 128+ tokens
                out["test_128_mean"], out["test_128_min"] = (
                    float(c[long].mean()), float(c[long].min()),
                )  # fmt: skip
        return out

    maps = [state_of(layer.attention.self).fitted for layer in model.encoder.layer]
    for layer, fm in zip(model.encoder.layer, maps, strict=True):  # g = 0: window + sinks
        update(layer.attention.self, fitted=fm.with_parameters(far_weight=0.0))
    results = [row("window + sinks")]
    print(json.dumps(results[-1]), flush=True)
    for layer, fm in zip(model.encoder.layer, maps, strict=True):
        update(layer.attention.self, fitted=fm)
    if args.exact_heads:  # ranked as LayerFit.error_shares: validation, exact activations
        val_inputs = [inputs(*b) for b in parts["validation"]]
        for layer, entry in zip(
            model.encoder.layer, layer_errors(model, val_inputs, activations="exact"), strict=True
        ):
            squared = entry["fitted"] ** 2 * entry["exact_squared_norm"]
            worst = np.argsort(-squared, kind="stable")[: args.exact_heads]
            update(layer.attention.self, exact_heads=tuple(sorted(int(h) for h in worst)))
    results.append(row("per-layer fit"))
    results[-1]["exact_heads"] = [
        list(state_of(layer.attention.self).exact_heads) for layer in model.encoder.layer
    ]
    if args.layers:
        results[-1]["layers"] = layers()
    print(json.dumps(results[-1]), flush=True)
    if args.time_repeats:
        results[-1]["encode"] = encode_times(model, maps, test_inputs, args.time_repeats)
        print(json.dumps(results[-1]["encode"]), flush=True)
    start = time.perf_counter()
    refine(
        model, [inputs(*b) for b in parts["fit"]], [inputs(*b) for b in parts["validation"]],
        steps=args.steps, learning_rate=args.lr, evaluate_every=10, loss=args.loss,
        progress=print,
    )  # fmt: skip
    record = model.__dict__["_linattn_conversion"]["refine"]
    seconds = time.perf_counter() - start
    results.append({**row("refined"), "kept_step": record["kept_step"], "seconds": seconds})
    if args.layers:
        results[-1]["layers"] = layers()
    print(json.dumps(results[-1]), flush=True)
    base = 1 - results[0]["test_mean"]
    for entry in results[1:]:
        entry["test_one_minus_cos_ratio"] = (1 - entry["test_mean"]) / base
        print(
            f"# {entry['step']}: 1 - cos = {entry['test_one_minus_cos_ratio']:.3f} of window + "
            "sinks' (test mean)"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("LINATTN_COMPILE", "foreground")  # (timed: kernels compile in the call)
    main()
