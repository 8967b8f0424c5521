"""Speed of the fitted hybrid (m = 64) against the random-feature hybrid (m = 256), CPU kernels.

One process, the same inputs, ``window`` + 1 sink exact; best of ``--repeats`` after a
warm-up call (compilation excluded); the ratio fitted / random is the figure (taken in
one run: the machine is shared and noisy).  Prints the executor the plan chose for each.

    python benchmarks/fitted_speed.py                 # L = 16384, w = 64, 4 heads, d = 64
    python benchmarks/fitted_speed.py --length 4096 --repeats 2
    python benchmarks/fitted_speed.py --alone         # no exact parts: feature maps alone
    python benchmarks/fitted_speed.py --decode --length 512   # one-token steps after a state

With ``--alone`` the maps run without window or sinks: the random maps on the fused
passes, the fitted map on the log-feature path (the compiled causal scan), which is what
the fused passes not computing fitted features costs.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

import linattn as la


def best(call, repeats: int) -> float:
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--alone", action="store_true", help="no window or sinks")
    ap.add_argument("--decode", action="store_true", help="one-token steps after a state")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    shape = (1, args.heads, args.length, args.head_dim)
    q, k, v = (rng.normal(size=shape).astype(np.float32) for _ in range(3))
    d = args.head_dim
    random = la.FeatureMap(d, 256, kind="hyperbolic", seed=0)
    params = la.fitted.initial_parameters(d, 64, heads=args.heads, seed=0)
    fitted = la.FeatureMap.fitted(
        params.query_weight, params.query_bias, key_weight=params.key_weight,
        key_bias=params.key_bias, far_weight=np.full(args.heads, 3.0),
    )  # fmt: skip
    if args.decode:
        decode(q, k, v, fitted, la.FeatureMap(d, 64, kind="hyperbolic", seed=0), args.repeats)
        return
    maps = [("random m=256", random), ("fitted m=64", fitted)]
    parts = {"window": args.window, "sink_keys": 1}
    if args.alone:
        maps.insert(1, ("random m=64", la.FeatureMap(d, 64, kind="hyperbolic", seed=0)))
        parts = {}
    exact = "no exact parts" if args.alone else f"window={args.window} + 1 sink"
    print(f"# L={args.length}, heads={args.heads}, d={d}, {exact}, float32")
    for causal in (True, False):
        seconds = {}
        for name, fm in maps:
            options = {"causal": causal, **parts}
            plan = la.plan_attention(q, k, v, fm, **options)
            seconds[name] = best(
                lambda fm=fm, o=options: la.linear_attention(q, k, v, fm, **o), args.repeats
            )
            mode = "causal" if causal else "bidirectional"
            print(f"{mode:13s} {name:13s} {seconds[name]:8.3f} s  ({plan.executor})")
        ratio = seconds["fitted m=64"] / seconds["random m=256"]
        print(f"{'':13s} fitted / random m=256: {ratio:.2f} (goal <= 1)")
        if args.alone:
            ratio = seconds["fitted m=64"] / seconds["random m=64"]
            print(f"{'':13s} fitted / random m=64: {ratio:.2f}")


def decode(q, k, v, fitted, random, repeats: int) -> None:
    """Milliseconds per one-token causal step after a state of all of ``q``'s tokens."""
    print(f"# decoding one token after {q.shape[-2]} (no exact parts), {q.shape[1]} heads")
    step = [x[..., :1, :] for x in (q, k, v)]
    for name, fm in (("random m=64", random), ("fitted m=64", fitted)):
        _, state = la.linear_attention(q, k, v, fm, causal=True, return_state=True)
        options = {"causal": True, "state": state, "return_state": True}
        plan = la.plan_attention(*step, fm, **options)
        seconds = best(lambda fm=fm, o=options: [la.linear_attention(*step, fm, **o)
                                                 for _ in range(100)], repeats)  # fmt: skip
        print(f"{name:13s} {seconds * 10:8.3f} ms a step  ({plan.executor})")


if __name__ == "__main__":
    os.environ.setdefault("LINATTN_COMPILE", "foreground")  # (timed: kernels compile in the call)
    main()
