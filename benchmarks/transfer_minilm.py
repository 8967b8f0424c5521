"""Fitted attention (attention transfer) on all-MiniLM-L6-v2, NumPy only, on the test split.

Every attention layer of the NumPy MiniLM (``linattn.models``) is converted with
:func:`linattn.models.convert.convert_encoder` (per-head Hedgehog maps and far weights
fitted to each layer's exact attention, model weights frozen) on the FIT split,
early-stopped on the VALIDATION split, and measured on the TEST split
(``benchmarks/documents.py``: splits by topic, disjoint by text).  For each window it
reports, on the test split:

* end to end: mean and minimum cosine of the sentence embeddings to the exact model's
  (all rows, rows of 128+ tokens), and the Spearman correlation of all pair
  similarities with the exact model's (a downstream measure);
* per layer: the relative attention-output error ``||A - A*|| / ||A*||`` over real
  query rows of all heads, on the converted model's own activations, against window +
  sinks on the same activations;
* the fit's wall time and the test split's encode time;

for window + sinks (the first ``--sink-keys`` keys, :data:`linattn.transfer.SINK_KEYS` by
default, and ``[SEP]`` exact), the hybrid with random features
(hyperbolic, m = 256), the hybrid with fitted maps (each ``--m``) and, with
``--alone``, fitted maps with no exact parts.

    python benchmarks/transfer_minilm.py --data docs --window 16 --m 64
    python benchmarks/transfer_minilm.py --data texts --window 4 16 64 --m 32 64 128
    python benchmarks/transfer_minilm.py --quick            # seconds: the mechanics only
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import documents

import linattn as la
from linattn.models import load_model
from linattn.models.bert import exact_attention
from linattn.models.convert import FittedAttention, convert_encoder, length_batches
from linattn.transfer import SINK_KEYS


def batches(
    batch: documents.Batch, size: int, limit: int | None
) -> list[tuple[np.ndarray, np.ndarray]]:
    """The first ``limit`` rows (file order), in batches by length."""
    return length_batches(batch.input_ids, batch.mask, np.arange(len(batch))[:limit], size)


def encode(encoder, parts, attention) -> tuple[np.ndarray, float]:
    """Embeddings of ``parts`` and the seconds they took, after one untimed batch (the
    first call compiles the kernels it needs)."""
    encoder.encode(*parts[0], attention)
    start = time.perf_counter()
    emb = np.concatenate([encoder.encode(ids, mask, attention) for ids, mask in parts])
    return emb, time.perf_counter() - start


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    iu = np.triu_indices(len(a), 1)
    x, y = (a @ a.T)[iu], (b @ b.T)[iu]
    rx, ry = np.argsort(np.argsort(x)), np.argsort(np.argsort(y))
    return float(np.corrcoef(rx, ry)[0, 1])


def layer_errors(encoder, parts, attention, reference) -> tuple[np.ndarray, np.ndarray]:
    """Per layer, relative error of ``attention`` and of ``reference`` against exact
    attention, on the activations of the model running ``attention``."""
    layers = encoder.config.num_layers
    err = np.zeros((2, layers))
    norm = np.zeros(layers)
    for ids, mask in parts:
        hidden = encoder.embed(ids)
        rows = mask[:, None, :, None]
        for layer in range(layers):
            q, k, v = encoder.qkv(hidden, layer)
            exact = exact_attention(q, k, v, mask, layer)
            ours = attention(q, k, v, mask, layer)
            base = reference(q, k, v, mask, layer)
            err[0, layer] += float((((ours - exact) * rows) ** 2).sum())
            err[1, layer] += float((((base - exact) * rows) ** 2).sum())
            norm[layer] += float(((exact * rows) ** 2).sum())
            hidden = encoder.finish_layer(hidden, np.asarray(ours, np.float32), layer)
    return np.sqrt(err[0] / norm), np.sqrt(err[1] / norm)


def summary(emb: np.ndarray, exact: np.ndarray, lengths: np.ndarray) -> dict:
    cos = (emb * exact).sum(-1)
    long = lengths >= 128
    return {
        "mean": float(cos.mean()),
        "min": float(cos.min()),
        "mean_128": float(cos[long].mean()) if long.any() else float("nan"),
        "min_128": float(cos[long].min()) if long.any() else float("nan"),
        "spearman": spearman(emb, exact),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", choices=("docs", "texts"), default="docs")
    ap.add_argument("--window", type=int, nargs="+", default=[16])
    ap.add_argument("--m", type=int, nargs="+", default=[64])
    ap.add_argument(
        "--sink-keys", type=int, default=SINK_KEYS,
        help="the first keys of every row attended exactly, in every configuration",
    )  # fmt: skip
    ap.add_argument("--stitch", choices=("exact", "converted"), nargs="+", default=["exact"])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--fit-rows", type=int, default=None, help="the first N fit rows")
    ap.add_argument("--random", action="store_true", help="also the random-feature hybrid")
    ap.add_argument("--alone", action="store_true", help="also fitted maps with no exact parts")
    ap.add_argument("--layers", action="store_true", help="per-layer attention errors")
    ap.add_argument("--quick", action="store_true", help="few rows and steps")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.quick:
        args.steps, args.fit_rows = 10, 4
    model = load_model("minilm")
    encoder = model.encoder
    build = documents.documents if args.data == "docs" else documents.committed_texts
    split = {name: build(name) for name in documents.SPLITS}
    limit = {
        "fit": args.fit_rows,
        "validation": 4 if args.quick else None,
        "test": 4 if args.quick else None,
    }
    parts = {name: batches(split[name], args.batch, limit[name]) for name in split}
    test_lengths = np.concatenate([mask.sum(1) for _, mask in parts["test"]])
    exact_emb, exact_seconds = encode(encoder, parts["test"], exact_attention)
    threads = os.environ.get("OMP_NUM_THREADS", "?")
    print(
        f"# {args.data}: fit {sum(len(i) for i, _ in parts['fit'])} rows, validation "
        f"{sum(len(i) for i, _ in parts['validation'])}, test {len(test_lengths)} "
        f"(tokens {test_lengths.min()}-{test_lengths.max()}); steps {args.steps}, batch "
        f"{args.batch}, lr {args.lr}; OMP_NUM_THREADS={threads}; exact encode "
        f"{exact_seconds:.1f} s"
    )
    results = []
    for window in args.window:
        base = FittedAttention([None] * encoder.config.num_layers, window, args.sink_keys)
        emb, seconds = encode(encoder, parts["test"], base)
        row = {
            "config": f"w{window}+sinks",
            "window": window,
            **summary(emb, exact_emb, test_lengths),
        }
        row["encode_s"] = seconds
        results.append(row)
        print(json.dumps(row))
        if args.random:
            maps = [
                la.FeatureMap(encoder.config.head_dim, 256, kind="hyperbolic", seed=layer)
                for layer in range(encoder.config.num_layers)
            ]
            attention = FittedAttention(maps, window, args.sink_keys)
            emb, seconds = encode(encoder, parts["test"], attention)
            row = {"config": f"w{window}+sinks+random m256", "window": window}
            row.update(summary(emb, exact_emb, test_lengths), encode_s=seconds)
            results.append(row)
            print(json.dumps(row))
        for m in args.m:
            for stitch in args.stitch:
                start = time.perf_counter()
                done = convert_encoder(
                    encoder, parts["fit"], parts["validation"], window=window,
                    sink_keys=args.sink_keys, num_features=m, stitch=stitch,
                    steps=args.steps, learning_rate=args.lr,
                    progress=lambda line: None,
                )  # fmt: skip
                fit_seconds = time.perf_counter() - start
                emb, seconds = encode(encoder, parts["test"], done.attention)
                row = {"config": f"w{window}+sinks+fitted m{m} ({stitch})", "window": window}
                row.update(summary(emb, exact_emb, test_lengths), encode_s=seconds)
                row["fit_s"] = fit_seconds
                row["steps"] = [f.steps for f in done.fits]
                row["exact_only_heads"] = [int(f.exact_only.sum()) for f in done.fits]
                if args.layers:
                    ours, theirs = layer_errors(encoder, parts["test"], done.attention, base)
                    row["layer_error"] = [round(float(x), 4) for x in ours]
                    row["layer_error_window_sinks"] = [round(float(x), 4) for x in theirs]
                    row["layer_ratio"] = [
                        round(float(a / b), 3) for a, b in zip(ours, theirs, strict=True)
                    ]
                results.append(row)
                print(json.dumps(row))
    if args.alone:
        for m in args.m:
            start = time.perf_counter()
            done = convert_encoder(
                encoder, parts["fit"], parts["validation"], window=None, sink_keys=0,
                exact_sep=False, num_features=m, steps=args.steps, learning_rate=args.lr,
                progress=lambda line: None,
            )  # fmt: skip
            fit_seconds = time.perf_counter() - start
            emb, seconds = encode(encoder, parts["test"], done.attention)
            row = {"config": f"fitted m{m} alone", "window": None}
            row.update(summary(emb, exact_emb, test_lengths), encode_s=seconds, fit_s=fit_seconds)
            results.append(row)
            print(json.dumps(row))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("LINATTN_COMPILE", "foreground")  # (timed: kernels compile in the call)
    main()
