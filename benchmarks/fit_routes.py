"""The same conversion by its two routes, timed: ``linattn convert``'s (the NumPy BERT,
:func:`linattn.models.convert.convert_encoder`) and the transformers integration's
(:func:`linattn.integrations.transformers.convert` on ``BertModel``), on the same texts,
batches, steps and exact parts, in the order A B A (so drift shows).

all-MiniLM-L6-v2 from the packaged folder, the first ``--texts`` texts of
``linattn/models/texts.txt`` cut at 256 tokens, every 4th a validation text, batches of
8, window 16 + 4 sinks + ``[SEP]`` exact, m = 64.

    python benchmarks/fit_routes.py --texts 48 --steps 30
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np


def numpy_route(texts: list[str], steps: int) -> float:
    from linattn.models import load_model
    from linattn.models.convert import convert_encoder, length_batches

    model = load_model("minilm")
    tokens = model.tokenize(texts)
    index = np.arange(len(texts))
    held = index % 4 == 3
    start = time.perf_counter()
    convert_encoder(
        model.encoder,
        length_batches(tokens.input_ids, tokens.key_mask, index[~held], 8),
        length_batches(tokens.input_ids, tokens.key_mask, index[held], 8),
        window=16, sink_keys=4, num_features=64, steps=steps, progress=lambda line: None,
    )  # fmt: skip
    return time.perf_counter() - start


def transformers_route(texts: list[str], steps: int) -> float:
    import torch
    import transformers

    import linattn.integrations.transformers as lt
    from linattn.models import load_model, resolve_model_path
    from linattn.models.convert import length_batches

    folder = resolve_model_path("minilm")
    model = transformers.BertModel.from_pretrained(folder, local_files_only=True).eval()
    tokens = load_model("minilm").tokenize(texts)  # (the same ids and batches as above)
    index = np.arange(len(texts))
    held = index % 4 == 3

    def batches(rows: np.ndarray) -> list[dict[str, torch.Tensor]]:
        return [
            {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask).long()}
            for ids, mask in length_batches(tokens.input_ids, tokens.key_mask, rows, 8)
        ]

    start = time.perf_counter()
    lt.convert(
        model, batches(index[~held]), batches(index[held]), window=16, sink_keys=4,
        num_features=64, steps=steps, exact_keys="sep", progress=lambda line: None,
    )  # fmt: skip
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--texts", type=int, default=48)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    from linattn.models.accuracy import load_texts

    texts = load_texts(args.texts)
    a1 = numpy_route(texts, args.steps)
    b = transformers_route(texts, args.steps)
    a2 = numpy_route(texts, args.steps)
    print(
        f"linattn convert route {a1:.1f} s, transformers route {b:.1f} s, linattn convert "
        f"route {a2:.1f} s: transformers / convert = {b / ((a1 + a2) / 2):.2f}"
    )


if __name__ == "__main__":
    os.environ.setdefault("LINATTN_COMPILE", "foreground")
    main()
