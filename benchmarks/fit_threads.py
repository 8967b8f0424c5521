"""The per-layer fit's time with each batch's pieces on threads against one thread.

Fits all six layers of the NumPy all-MiniLM-L6-v2 (``linattn.models.convert``,
stitching (a), w = 16 + sinks, m = 64) on the first ``--fit-rows`` fit texts, twice per
round: the pieces of each batch (:data:`linattn.transfer.PIECES`) on a thread pool, as
:func:`linattn.transfer.fit_layer` runs them on a machine with two cores or more, and
the same pieces one after another, in alternating order.  The two fits are equal to the
last bit; the ratio of their times is taken within each round.

    python benchmarks/fit_threads.py --data texts --fit-rows 100 --batch 8 --rounds 2
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import documents
from transfer_minilm import batches

from linattn import transfer
from linattn.models import load_model
from linattn.models.convert import convert_encoder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", choices=("docs", "texts"), default="texts")
    ap.add_argument("--fit-rows", type=int, default=100)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    encoder = load_model("minilm").encoder
    build = documents.documents if args.data == "docs" else documents.committed_texts
    fit = batches(build("fit"), args.batch, args.fit_rows)
    validation = batches(build("validation"), args.batch, None)
    cores = transfer.threads.cores
    print(
        f"# {args.data}: {sum(len(i) for i, _ in fit)} fit rows, {transfer.threads.cores()} cores"
    )
    for round_ in range(args.rounds):
        seconds, fits = {}, {}
        order = [("threads", cores), ("one thread", lambda: 1)]
        for name, threads in order if round_ % 2 else order[::-1]:  # (alternating)
            transfer.threads.cores = threads  # (what fit_layer reads)
            start = time.perf_counter()
            done = convert_encoder(
                encoder, fit, validation, window=16, sink_keys=transfer.SINK_KEYS, num_features=64,
                steps=args.steps, progress=lambda line: None,
            )  # fmt: skip
            seconds[name] = time.perf_counter() - start
            fits[name] = done.fits
        transfer.threads.cores = cores
        weights = [[f.feature_map.parameters.query_weight for f in fits[n]] for n in fits]
        same = all(map(np.array_equal, *weights))
        ratio = seconds["one thread"] / seconds["threads"]
        print(
            f"round {round_}: threads {seconds['threads']:.1f} s, one thread "
            f"{seconds['one thread']:.1f} s, ratio {ratio:.2f}; equal fits: {same}",
            flush=True,
        )


if __name__ == "__main__":
    os.environ.setdefault("LINATTN_COMPILE", "foreground")  # (timed: kernels compile in the call)
    main()
