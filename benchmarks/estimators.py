"""Estimator comparison at equal feature count (issue: lower-variance estimators).

Run: ``python benchmarks/estimators.py`` (about a minute).  Prints Markdown tables of
attention-output MSE and total-variation distance of attention rows against exact
softmax attention, mean ± standard deviation over 20 projection seeds, on:

* the seed experiment (L=64, d=32, Q, K ~ 0.3 N(0, 1));
* isotropic queries/keys with E|x|^2 = 0.5, 1, 2 for x = d^(-1/4) q (L=256, d=64);
* anisotropic per-coordinate scales (E|x|^2 = 1, anisotropy 1; same logits).

Each row is also one ``linattn accuracy`` call (the same study), e.g.
``linattn accuracy --estimators hyperbolic_oprf-orf-rebalanced --num-features 128
--seeds 20 --length 256 --head-dim 64 --input-scale 0.354 --anisotropy 1``.
"""

from __future__ import annotations

import math
import os

from linattn.cli._accuracy import accuracy_study, parse_estimator
from linattn.cli._backends import load_library

ESTIMATORS = [
    "positive-iid",
    "positive-orf",
    "hyperbolic-orf",
    "oprf-orf",
    "hyperbolic_oprf-orf",
    "positive-orf-rebalanced",
    "hyperbolic-orf-rebalanced",
    "hyperbolic_oprf-orf-rebalanced",
    "trigonometric-orf",
]
NUM_FEATURES = 128
SEEDS = 20


def _scale_for_energy(energy: float, head_dim: int) -> float:
    # x = d^(-1/4) q and q ~ S N(0, I): E|x|^2 = S^2 sqrt(d).
    return math.sqrt(energy / math.sqrt(head_dim))


SETTINGS = {
    "seed experiment": {"length": 64, "head_dim": 32, "input_scale": 0.3},
    "isotropic E‖x‖²=0.5": {
        "length": 256,
        "head_dim": 64,
        "input_scale": _scale_for_energy(0.5, 64),
    },
    "isotropic E‖x‖²=1": {"length": 256, "head_dim": 64, "input_scale": _scale_for_energy(1, 64)},
    "isotropic E‖x‖²=2": {"length": 256, "head_dim": 64, "input_scale": _scale_for_energy(2, 64)},
    "anisotropic (A=1, E‖x‖²=1)": {
        "length": 256,
        "head_dim": 64,
        "input_scale": _scale_for_energy(1, 64),
        "anisotropy": 1.0,
    },
}


def main() -> None:
    library = load_library("numpy", "float64")
    estimators = [parse_estimator(e) for e in ESTIMATORS]
    results: dict[str, dict[str, dict[str, tuple[float, float]]]] = {"mse": {}, "tv": {}}
    for name, options in SETTINGS.items():
        rows = accuracy_study(library, estimators, [NUM_FEATURES], draws=SEEDS, **options)
        for row in rows:
            results[row.metric].setdefault(name, {})[row.estimator] = (row.mean, row.std)
    for metric, title in (("mse", "attention output MSE"), ("tv", "total variation of rows")):
        print(f"\n{title}, m = {NUM_FEATURES}, mean ± sd over {SEEDS} seeds\n")
        print("| estimator | " + " | ".join(SETTINGS) + " |")
        print("| --- |" + " ---: |" * len(SETTINGS))
        for estimator in ESTIMATORS:
            cells = []
            for name in SETTINGS:
                mean, std = results[metric][name][estimator]
                best = min(v[0] for v in results[metric][name].values())
                cell = f"{mean:.2e} ± {std:.0e}" if metric == "mse" else f"{mean:.4f} ± {std:.4f}"
                cells.append(f"**{cell}**" if mean == best else cell)
            print(f"| {estimator} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    os.environ.setdefault("LINATTN_COMPILE", "foreground")  # (timed: kernels compile in the call)
    main()
