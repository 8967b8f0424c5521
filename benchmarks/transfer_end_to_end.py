"""Stitching (c), measured: per-layer fitted maps, then a short end-to-end fit of only the
maps and far weights against the exact model's final hidden states (model frozen).

The per-layer fit is ``linattn.models.convert.convert_encoder`` on NumPy (stitching (a),
as ``benchmarks/transfer_minilm.py``), saved to ``--maps`` and reused when present.  The
end-to-end step runs all-MiniLM-L6-v2 in transformers with a dense torch version of the
fitted hybrid (exact window, ``[CLS]`` sink and ``[SEP]``; ``g phi(q) . phi(k)`` on every
other key; the formula of ``linattn.fitted``), whose parameters are the only trainable
tensors: Adam on the mean squared error of the last hidden state over real tokens of the
FIT split, the step kept that gives the best mean embedding cosine on the VALIDATION
split, figures on the TEST split (``benchmarks/documents.py``).  A measurement, not a
library path: it decides whether (c) is worth building.

    python benchmarks/transfer_end_to_end.py --data docs --window 16 --steps 60
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
import documents
from transformers import AttentionInterface, AutoModel
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from linattn.integrations.transformers import key_mask_from
from linattn.models import load_model, resolve_model_path
from linattn.models.convert import (
    attention_from_file,
    convert_encoder,
    length_batches,
    save_fitted,
    sep_mask,
)

NAME = "linattn_end_to_end"
_CONTEXT: dict[str, object] = {}


class Maps(torch.nn.Module):
    """Every layer's fitted parameters as trainable tensors (``log g`` for ``g``)."""

    def __init__(self, fitted_maps: list) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList()
        for fm in fitted_maps:
            p = fm.parameters
            layer = torch.nn.Module()
            for name in ("query_weight", "query_bias", "key_weight", "key_bias"):
                layer.register_parameter(
                    name, torch.nn.Parameter(torch.tensor(getattr(p, name), dtype=torch.float32))
                )
            log_g = np.log(
                np.maximum(np.broadcast_to(p.far_weight, (p.key_weight.shape[0],)), 1e-30)
            )
            layer.log_g = torch.nn.Parameter(torch.tensor(log_g, dtype=torch.float32))
            self.layers.append(layer)


def _log_phi(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    u = torch.einsum("bhld,hdn->bhln", x, w) + b[None, :, None, :]
    return torch.log_softmax(torch.cat([u, -u], dim=-1), dim=-1)


def hybrid(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' attention signature; the fitted hybrid, dense, differentiable."""
    layer = _CONTEXT["index"][id(module)]
    maps, window = _CONTEXT["maps"].layers[layer], _CONTEXT["window"]
    key_mask, _ = key_mask_from(attention_mask, query.shape[-2], key.shape[-2])
    if key_mask is None:  # every key real
        keep = torch.ones((query.shape[0], 1, 1, key.shape[-2]), dtype=torch.bool)
    else:
        keep = key_mask.reshape(query.shape[0], 1, 1, -1)
    length = query.shape[-2]
    t = torch.arange(length)
    near = ((t[:, None] - t[None, :]).abs() < window) | (t[None, :] == 0)
    near = near[None, None] | _CONTEXT["sep"][:, None, None, :]
    logits = scaling * query @ key.transpose(-1, -2)
    lq = _log_phi(query, maps.query_weight, maps.query_bias)
    lk = _log_phi(key, maps.key_weight, maps.key_bias) + maps.log_g[None, :, None, None]
    mq, mk = lq.amax(-1, keepdim=True).detach(), lk.amax(-1, keepdim=True).detach()
    far = (
        torch.log((lq - mq).exp() @ (lk - mk).exp().transpose(-1, -2)) + mq + mk.transpose(-1, -2)
    )
    neg = torch.tensor(-torch.inf)
    scores = torch.where(near & keep, logits, torch.where(keep, far, neg))
    out = torch.softmax(scores, dim=-1) @ value
    return out.transpose(1, 2).contiguous(), None


def pooled(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    w = mask[..., None].to(hidden.dtype)
    emb = (hidden * w).sum(1) / w.sum(1).clamp_min(1e-9)
    return torch.nn.functional.normalize(emb, dim=-1)


def run(model, ids: np.ndarray, mask: np.ndarray) -> torch.Tensor:
    _CONTEXT["sep"] = torch.tensor(sep_mask(mask))
    out = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask.astype(np.int64)))
    return out.last_hidden_state


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", choices=("docs", "texts"), default="docs")
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--m", type=int, default=64)
    ap.add_argument("--fit-steps", type=int, default=150, help="per-layer fit steps")
    ap.add_argument("--steps", type=int, default=60, help="end-to-end steps")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--fit-rows", type=int, default=None)
    ap.add_argument("--maps", default="/tmp/linattn-e2e-maps.safetensors")
    ap.add_argument("--json", default=None)
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
            encoder, parts["fit"], parts["validation"], window=args.window, sink_keys=1,
            num_features=args.m, steps=args.fit_steps, progress=lambda line: None,
        )  # fmt: skip
        save_fitted(maps_path, done)
        print(f"# per-layer fit {time.perf_counter() - start:.0f} s -> {maps_path}", flush=True)
    fitted = attention_from_file(maps_path, encoder)
    maps = Maps(list(fitted.maps))
    model = AutoModel.from_pretrained(resolve_model_path("minilm")).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    exact = {}
    with torch.no_grad():
        for name in ("fit", "validation", "test"):
            exact[name] = [run(model, ids, mask) for ids, mask in parts[name]]
    AttentionInterface.register(NAME, hybrid)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
    _CONTEXT.update(
        maps=maps, window=args.window,
        index={id(layer.attention.self): i for i, layer in enumerate(model.encoder.layer)},
    )  # fmt: skip

    def cosines(name: str) -> np.ndarray:
        out = []
        with torch.no_grad():
            for (ids, mask), hidden in zip(parts[name], exact[name], strict=True):
                m = torch.tensor(mask)
                out.append((pooled(run(model, ids, mask), m) * pooled(hidden, m)).sum(-1))
        return torch.cat(out).numpy()

    def row(step: int) -> dict:
        test, val = cosines("test"), cosines("validation")
        return {
            "step": step,
            "validation_mean": float(val.mean()),
            "test_mean": float(test.mean()),
            "test_min": float(test.min()),
        }

    results = [row(0)]
    print(json.dumps(results[-1]), flush=True)
    best = (results[-1]["validation_mean"], {k: v.clone() for k, v in maps.state_dict().items()})
    optimiser = torch.optim.Adam(maps.parameters(), lr=args.lr)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        index = (step - 1) % len(parts["fit"])
        ids, mask = parts["fit"][index]
        rows = torch.tensor(mask)[..., None]
        hidden = run(model, ids, mask)
        loss = (((hidden - exact["fit"][index]) ** 2) * rows).sum() / rows.sum()
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        if step % 10 == 0 or step == args.steps:
            results.append(
                {**row(step), "loss": float(loss.detach()), "s": time.perf_counter() - start}
            )
            print(json.dumps(results[-1]), flush=True)
            if results[-1]["validation_mean"] > best[0]:
                best = (results[-1]["validation_mean"],
                        {k: v.clone() for k, v in maps.state_dict().items()})  # fmt: skip
    maps.load_state_dict(best[1])
    final = {**row(-1), "kept": "best validation", "seconds": time.perf_counter() - start}
    results.append(final)
    print(json.dumps(final), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
