"""What the log-normaliser option costs: ``favor_causal`` with and without it, one run.

Calls alternate (off, on, off, on, ...) so that both see the same machine load; prints
the best time of each and their ratio.  Default workload: causal, L = 16384, H = 8,
d = 64, m = 256, float32.

    python benchmarks/log_normaliser_cost.py [--length 16384] [--heads 8] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

import linattn as la
from linattn_numba import cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    shape = (args.heads, args.length, args.dim)
    q, k, v = (rng.normal(size=shape).astype(np.float32) for _ in range(3))
    fm = la.FeatureMap(args.dim, args.features, seed=0)
    assert fm.projection is not None
    m = args.features
    kv = np.zeros((args.heads, m, args.dim + 1), np.float32)
    mu = np.full((args.heads, m), -np.inf, np.float32)

    def call(on: bool) -> float:
        start = time.perf_counter()
        cpu.favor_causal(
            q, k, v, fm.projection, hyperbolic=False, scale=fm.scale, key_mask=None,
            kv=kv, log_shift=mu, chunk_size=64, return_log_normaliser=on,
        )  # fmt: skip
        return time.perf_counter() - start

    call(False), call(True)  # compile both
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.repeat):
        for on in (False, True):
            times[on].append(call(on))
    off, on = min(times[False]), min(times[True])
    print(f"L={args.length} H={args.heads} d={args.dim} m={m} float32, best of {args.repeat}")
    print(f"off {off * 1e3:.1f} ms   on {on * 1e3:.1f} ms   on/off {on / off:.3f}")


if __name__ == "__main__":
    os.environ.setdefault("LINATTN_COMPILE", "foreground")  # (timed: kernels compile in the call)
    main()
