"""Does the hybrid's far part earn its cost with one projection draw for every layer?

Issue 13: at w = 16 with sinks, random features for the far keys *lower* the MiniLM
embedding cosine (0.907-0.911 against 0.938 without them, docs/estimators.md), although
they lower every layer's attention error: independent errors in each layer compound.
This measures, on the texts of 128+ tokens, window + sinks alone against the hybrid
(positive features, m = 256 and 1024) with a fresh draw per layer and with one draw shared
by all layers, for two seeds.  Run (a few minutes per seed on 2 cores)::

    python benchmarks/accuracy_shared_draw.py [--texts 60] [--seeds 0 100]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from linattn.models import accuracy as acc
from linattn.models import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=60, help="texts of 128+ tokens")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 100])
    args = parser.parse_args()
    model = load_model("minilm")
    texts = acc.load_texts()
    lengths = model.tokenize(texts).key_mask.sum(axis=1)
    chosen = [t for t, n in zip(texts, lengths, strict=True) if n >= 128][: args.texts]
    configs = [acc.Config("window+sinks", window=16, sinks=True)]
    configs += [
        acc.Config("hybrid", kind="positive", num_features=m, window=16, sinks=True, shared_draw=s)
        for s in (False, True)
        for m in (256, 1024)
    ]
    print(f"{len(chosen)} texts of 128+ tokens")
    for seed in args.seeds:
        start = time.perf_counter()
        measured = acc.measure(
            model, chosen, configs if seed == args.seeds[0] else configs[1:], seed=seed
        )
        for result in measured.results:
            errors = np.round(result.layer_errors, 3).tolist()
            print(
                f"seed {seed:>4}  {result.config.label:<44} cosine mean "
                f"{result.cosines.mean():.4f} min {result.cosines.min():.4f}  "
                f"layer errors {errors}"
            )
        print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    os.environ.setdefault("LINATTN_COMPILE", "foreground")  # (timed: kernels compile in the call)
    main()
