"""Two checkouts of linattn side by side: the same workloads, each in a fresh process,
A B A B ... (the order alternating by round), the ratio B / A per round and its median.

For refactors that must not slow anything: the Python around each compiled pass (the
plan, the checks, the executors) is what changes, so the workloads are the calls where
it shows, at sizes where the passes themselves dominate too.  Run from anywhere::

    git worktree add /tmp/before <commit>
    python benchmarks/ab_checkouts.py /tmp/before . --rounds 6
    python benchmarks/ab_checkouts.py /tmp/before . --rounds 6 --torch

Each process imports the checkout it is given (``PYTHONPATH``) and prints its medians
(milliseconds, the median of 7 repeats) as one JSON line; a first run of each checkout compiles its
kernels into the cache.  Plan costs alone: ``--plans`` (microseconds per plan, best of 7).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

WORKLOAD = r"""
import json, statistics, sys, time, warnings
import numpy as np
import linattn as la

warnings.simplefilter("ignore")
rng = np.random.default_rng(0)
which = sys.argv[1]


def median_ms(f, reps, pick=statistics.median):
    for _ in range(3):
        f()
    times = []
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(reps):
            f()
        times.append((time.perf_counter() - t) / reps * 1e3)
    return pick(times)


def fitted(heads, d, m):
    weights = rng.standard_normal((heads, d, m // 2)).astype(np.float32) * 0.1
    return la.FeatureMap.fitted(weights, tied=True, far_weight=0.5)


out = {}
if which == "numpy":
    fm = la.FeatureMap(64, 256, seed=0)
    big = [rng.standard_normal((1, 8, 4096, 64), dtype=np.float32) for _ in range(3)]
    mid = [x[..., :1024, :] for x in big]
    _, state = la.linear_attention(*(x[..., :256, :] for x in big), fm, causal=True,
                                   return_state=True)
    step = [x[..., 256:257, :] for x in big]
    hedge = fitted(8, 64, 64)
    out["causal_4k"] = median_ms(lambda: la.linear_attention(*big, fm, causal=True), 5)
    out["bidirectional_4k"] = median_ms(lambda: la.linear_attention(*big, fm), 5)
    out["hybrid_causal_4k"] = median_ms(
        lambda: la.linear_attention(*big, fm, causal=True, window=64, sink_keys=4), 5)
    out["fitted_hybrid_1k"] = median_ms(
        lambda: la.linear_attention(*mid, hedge, window=16, sink_keys=4), 5)
    out["decode_step"] = median_ms(
        lambda: la.linear_attention(*step, fm, causal=True, state=state, return_state=True),
        400)
elif which == "torch":
    import torch

    torch.set_num_threads(2)
    fm, hedge = la.FeatureMap(32, 64, seed=0), fitted(12, 32, 64)
    q, k, v = (torch.from_numpy(rng.standard_normal((8, 12, 128, 32), dtype=np.float32))
               for _ in range(3))
    mask = torch.ones(8, 1, 128, dtype=torch.bool)
    with torch.inference_mode():
        out["torch_dense_hybrid_128"] = median_ms(
            lambda: la.linear_attention(q, k, v, hedge, key_mask=mask, window=16,
                                        sink_keys=4), 20)
        out["torch_kernels_hybrid_128"] = median_ms(
            lambda: la.linear_attention(q, k, v, fm, key_mask=mask, window=16, sink_keys=4),
            20)
        out["torch_fused_causal_128"] = median_ms(
            lambda: la.linear_attention(q, k, v, fm, causal=True), 20)
else:  # the plans alone, in microseconds
    from linattn import _plan
    from linattn._call import normalise_call

    fm = la.FeatureMap(64, 128, seed=0)
    x = [rng.standard_normal((1, 4, 257, 64), dtype=np.float32) for _ in range(3)]
    _, state = la.linear_attention(*(a[..., :256, :] for a in x), fm, causal=True,
                                   return_state=True)
    calls = {
        "plan_decode_step": normalise_call(*(a[..., 256:, :] for a in x), fm, causal=True,
                                           state=state, return_state=True),
        "plan_fused_causal_32": normalise_call(*(a[..., :32, :] for a in x), fm, causal=True),
        "plan_hybrid_32": normalise_call(*(a[..., :32, :] for a in x), fm, causal=True,
                                         window=8, sink_keys=1),
    }
    choose = getattr(_plan, "chosen", _plan.plan_call)  # (what runs a call, where it exists)
    for name, call in calls.items():
        out[name] = median_ms(lambda call=call: choose(call), 2000, min) * 1e3
print(json.dumps(out))
"""


def run(checkout: Path, which: str) -> dict[str, float]:
    env = dict(
        os.environ, PYTHONPATH=str(checkout), OMP_NUM_THREADS="2", LINATTN_COMPILE="foreground"
    )
    done = subprocess.run(
        [sys.executable, "-c", WORKLOAD, which],
        cwd=checkout, env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a", type=Path, help="the checkout to compare against (A)")
    parser.add_argument("b", type=Path, help="the checkout measured (B)")
    parser.add_argument("--rounds", type=int, default=6)
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--torch", action="store_const", const="torch", dest="which")
    group.add_argument("--plans", action="store_const", const="plans", dest="which")
    args = parser.parse_args()
    which = args.which or "numpy"
    a, b = args.a.resolve(), args.b.resolve()
    for checkout in (a, b):  # (compiles each checkout's kernels into the cache)
        run(checkout, which)
    ratios: dict[str, list[float]] = {}
    rows = []
    for r in range(args.rounds):
        order = [("A", a), ("B", b)] if r % 2 == 0 else [("B", b), ("A", a)]
        row = {tag: run(path, which) for tag, path in order}
        rows.append(row)
        for name in row["A"]:
            ratios.setdefault(name, []).append(row["B"][name] / row["A"][name])
        cells = "  ".join(f"{n} {row['A'][n]:.3f}/{row['B'][n]:.3f}" for n in row["A"])
        print(f"round {r}: {cells}", flush=True)
    unit = "us" if which == "plans" else "ms"
    for name, values in ratios.items():
        a_median = statistics.median(row["A"][name] for row in rows)
        b_median = statistics.median(row["B"][name] for row in rows)
        print(
            f"{name:<26} A {a_median:9.3f} {unit}  B {b_median:9.3f} {unit}  "
            f"B/A median {statistics.median(values):.3f} "
            f"(min {min(values):.3f}, max {max(values):.3f})"
        )


if __name__ == "__main__":
    os.environ.setdefault("LINATTN_COMPILE", "foreground")  # (timed: kernels compile in the call)
    main()
