"""Exact heads, measured (a prototype, not a library option): the fitted hybrid with the
``N`` heads per layer that carry the most fitted error running exact softmax attention.

The per-layer error that stays after fitting sits in a few heads that look one key up
(``docs/estimators.md``, "Where the error stays"); DuoAttention (Xiao et al. 2024) keeps
full attention for such "retrieval" heads and window + sinks for the rest.  This script
asks what that buys on all-MiniLM-L6-v2 with the fitted maps of
``benchmarks/transfer_end_to_end.py`` (``--maps``, made there): the heads are chosen on
the VALIDATION split (largest ``fitted error**2 x exact output norm**2`` per layer, on the
exact model's activations), every figure is on the TEST split: mean / min embedding
cosine to the exact model, and per layer the attention error relative to window +
sinks' on the converted model's own activations.  With ``--steps`` the maps are refined
(:func:`linattn.integrations.transformers.refine`, ``loss="pooled"``) with the exact
heads in place.  Cost: an exact head is quadratic in length; ``N`` of 12 heads per layer
take ``N / 12`` of exact attention's time and memory beside the linear part.

    python benchmarks/transfer_exact_heads.py --data docs --maps /tmp/maps-docs16.safetensors
    python benchmarks/transfer_exact_heads.py --data texts --fit-rows 100 --batch 8 \
        --maps /tmp/maps-texts16.safetensors --steps 100
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
import documents
from transfer_end_to_end import inputs, pooled
from transformers import AutoModel

from linattn.integrations import transformers_refine
from linattn.integrations.transformers import layer_errors, refine
from linattn.integrations.transformers_convert import FITTED, exact_attention, hooked
from linattn.models import load_model, resolve_model_path
from linattn.models.convert import attention_from_file, length_batches

EXACT: dict[int, list[int]] = {}  # id(attention module) -> its exact heads
ERRORS: dict[int, np.ndarray] = {}  # id(module) -> [fitted sq err, w+s sq err, norm]


class ExactHeads(transformers_refine._Hook):
    """refine's hook (the fitted hybrid, dense or the library's path), ``EXACT`` heads
    replaced by exact attention; with ``measure``, each layer's errors summed."""

    measure = False

    def __call__(self, call):  # type: ignore[no-untyped-def]
        out = super().__call__(call)
        heads = EXACT.get(id(call.module), [])
        if not heads and not self.measure:
            return out
        exact = exact_attention(call).to(out.dtype)
        if heads:
            keep = torch.zeros(out.shape[-2], dtype=torch.bool)
            keep[heads] = True
            out = torch.where(keep[:, None], exact, out)
        if self.measure:
            layer = self.layers[id(call.module)]
            saved = layer.values["log_far_weight"]
            layer.values["log_far_weight"] = torch.full_like(saved, -1e4)  # g = 0
            base = super().__call__(call)
            layer.values["log_far_weight"] = saved
            mask = call.key_mask
            if mask is None:
                mask = torch.ones(out.shape[0], 1, out.shape[1], dtype=torch.bool)
            rows = mask[:, 0, :, None, None].to(out.dtype)  # (B, L, 1, 1)
            got = [((x - exact) ** 2 * rows).sum().item() for x in (out, base)]
            got.append(((exact**2) * rows).sum().item())
            ERRORS[id(call.module)] = ERRORS.get(id(call.module), 0) + np.array(got)
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", choices=("docs", "texts"), default="docs")
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--m", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--fit-rows", type=int, default=None)
    ap.add_argument("--maps", required=True)
    ap.add_argument("--heads", default="0,1,2", help="exact heads per layer, each measured")
    ap.add_argument("--steps", type=int, default=0, help="refine steps with the exact heads")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    build = documents.documents if args.data == "docs" else documents.committed_texts
    split = {name: build(name) for name in documents.SPLITS}
    limit = {"fit": args.fit_rows, "validation": None, "test": None}
    parts = {
        name: [
            inputs(*x)
            for x in length_batches(
                b.input_ids, b.mask, np.arange(len(b))[: limit[name]], args.batch
            )
        ]
        for name, b in split.items()
    }  # fmt: skip
    encoder = load_model("minilm").encoder
    fitted = attention_from_file(args.maps, encoder)
    model = AutoModel.from_pretrained(resolve_model_path("minilm")).eval()
    with torch.no_grad():
        exact = [model(**b).last_hidden_state for b in parts["test"]]
    settings = {
        "num_features": args.m, "window": args.window, "sink_keys": 1, "exact_keys": "special",
    }  # fmt: skip
    model.config.linattn = settings
    model.set_attn_implementation("linattn")
    modules = [layer.attention.self for layer in model.encoder.layer]
    for module, fm in zip(modules, fitted.maps, strict=True):
        module.__dict__[FITTED] = fm
    # heads ranked per layer on the VALIDATION split, exact activations
    order = [
        np.argsort(-(e["fitted"] ** 2 * e["exact_squared_norm"]))
        for e in layer_errors(model, parts["validation"], activations="exact")
    ]

    def evaluate(label: str) -> dict:
        layers = {
            id(m): transformers_refine._layer(m, torch.float32, torch.device("cpu"))
            for m in modules
        }  # fmt: skip
        hook = ExactHeads(layers, settings)
        hook.measure = True
        ERRORS.clear()
        cos = []
        with torch.no_grad(), hooked(hook):
            for b, h in zip(parts["test"], exact, strict=True):
                got = model(**b).last_hidden_state
                m = b["attention_mask"]
                cos.append((pooled(got, m) * pooled(h, m)).sum(-1))
        c = torch.cat(cos).numpy()
        errors = [ERRORS[id(m)] for m in modules]
        row = {
            "case": label, "test_mean": float(c.mean()), "test_min": float(c.min()),
            "layer_ratio": [round(float(np.sqrt(e[0] / e[1])), 3) for e in errors],
            "exact_heads": [EXACT.get(id(m), []) for m in modules],
        }  # fmt: skip
        print(json.dumps(row), flush=True)
        return row

    results = []
    for n in (int(x) for x in args.heads.split(",")):
        EXACT.clear()
        for module, ranked in zip(modules, order, strict=True):
            EXACT[id(module)] = [int(h) for h in ranked[:n]]
        results.append(evaluate(f"per-layer fit, {n} exact heads"))
    if args.steps:
        transformers_refine._Hook = ExactHeads  # refine runs with the last EXACT heads
        refine(
            model, parts["fit"], parts["validation"], steps=args.steps, loss="pooled",
            evaluate_every=10, progress=print,
        )  # fmt: skip
        results.append(evaluate(f"refined, {n} exact heads"))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
