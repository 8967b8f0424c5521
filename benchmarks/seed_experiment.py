"""The seed's experiment done right (docs/algorithm.md, section 15): attention MSE against m.

Run: ``python benchmarks/seed_experiment.py`` (about 20 s).  n=64, d=32,
Q, K ~ 0.3 N(0, 1), V ~ N(0, 1) (seed 42), float64, bidirectional; mean over 50
projection draws; m counts output features (equal cost for every estimator).
"""

from __future__ import annotations

import os

import numpy as np

import linattn as la

ESTIMATORS = {
    "positive-iid": {"kind": "positive", "orthogonal": False},
    "positive-orthogonal": {"kind": "positive", "orthogonal": True},
    "hyperbolic-orthogonal": {"kind": "hyperbolic", "orthogonal": True},
}
M_VALUES = (32, 64, 128, 256, 512)
DRAWS = 50


def main() -> None:
    rng = np.random.default_rng(42)
    n, d = 64, 32
    q, k = 0.3 * rng.normal(size=(n, d)), 0.3 * rng.normal(size=(n, d))
    v = rng.normal(size=(n, d))
    exact = la.softmax_attention(q, k, v)
    table = {}
    for name, options in ESTIMATORS.items():
        table[name] = [
            np.mean(
                [
                    np.mean(
                        (
                            la.linear_attention(q, k, v, la.FeatureMap(d, m, seed=s, **options))
                            - exact
                        )
                        ** 2
                    )
                    for s in range(DRAWS)
                ]
            )
            for m in M_VALUES
        ]
    print("| m | " + " | ".join(ESTIMATORS) + " |")
    print("| ---: |" + " ---: |" * len(ESTIMATORS))
    for i, m in enumerate(M_VALUES):
        print(f"| {m} | " + " | ".join(f"{table[e][i]:.2e}" for e in ESTIMATORS) + " |")
    slopes = {e: np.polyfit(np.log(M_VALUES), np.log(table[e]), 1)[0] for e in ESTIMATORS}
    print("fitted log-log slope: " + ", ".join(f"{e} {s:.2f}" for e, s in slopes.items()))


if __name__ == "__main__":
    os.environ.setdefault("LINATTN_COMPILE", "foreground")  # (timed: kernels compile in the call)
    main()
