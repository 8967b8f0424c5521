"""Where the dense form of a fitted call beats the library's path (``DENSE_MAX_LENGTH``).

One MiniLM-sized attention call (12 heads, d = 32, m = 64, window 16 + 1 sink + an exact
key per row, the last row a quarter padded), forward and backward in q, k, v and every
map parameter, timed for ``linattn.torch.fitted_attention`` forced to the library's path
(``dense=False``: forward ``linear_attention``, backward
``linear_attention_vjp(parameters=True)``) and to its dense form (``dense=True``:
``linattn._fitted_call.dense_hybrid``, torch autograd), best of three, in one run; and
their largest output difference.  ``bare`` times ``dense_hybrid`` called directly, without
``fitted_attention``'s checks: ``dense / bare`` is what the checks cost a call.

    python benchmarks/refine_attention_speed.py --batch 8 --lengths 128 256 384 512
    python benchmarks/refine_attention_speed.py --batch 8 --lengths 32 64 128 --repeats 15
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from linattn._fitted_call import dense_hybrid
from linattn.torch import fitted_attention


def measure(batch: int, length: int, repeats: int = 3) -> None:
    """Time both at one length and print a line."""
    heads, d, half = 12, 32, 32
    torch.manual_seed(0)
    q, k, v = (torch.randn(batch, heads, length, d, requires_grad=True) for _ in "qkv")
    key_mask = torch.ones(batch, 1, length, dtype=torch.bool)
    key_mask[-1, :, -length // 4 :] = False
    exact = torch.zeros(batch, 1, length, dtype=torch.bool)
    exact[:, :, length // 2] = True
    eye = torch.eye(d)[:, :half].repeat(heads, 1, 1)
    p = {
        "query_weight": eye.clone().requires_grad_(),
        "query_bias": torch.zeros(heads, half, requires_grad=True),
        "key_weight": eye.clone().requires_grad_(),
        "key_bias": torch.zeros(heads, half, requires_grad=True),
    }
    log_g = torch.zeros(heads, requires_grad=True)
    options = {"window": 16, "sink_keys": 1}

    def call(dense: bool) -> torch.Tensor:
        out = fitted_attention(
            q, k, v, **p, far_weight=log_g.exp(), key_mask=key_mask,
            exact_key_mask=exact, dense=dense, **options,
        )  # fmt: skip
        return out.transpose(1, 2)

    def library() -> torch.Tensor:
        return call(False)

    def fitted_dense() -> torch.Tensor:
        return call(True)

    def bare() -> torch.Tensor:
        out = dense_hybrid(
            q, k, v, p["query_weight"], p["query_bias"], key_weight=p["key_weight"],
            key_bias=p["key_bias"], far_weight=log_g.exp(), key_mask=key_mask,
            exact_key_mask=exact, **options,
        )  # fmt: skip
        return out.transpose(1, 2)

    grad = torch.randn(batch, length, heads, d)
    times = {}
    for name, run in (("library", library), ("dense", fitted_dense), ("bare", bare)):
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            out = run()
            torch.autograd.grad((out * grad).sum(), [q, k, v, *p.values(), log_g])
            best = min(best, time.perf_counter() - start)
        times[name] = best
    # (with gradients on: without, the library's path is the dense form's executor too)
    difference = float((fitted_dense() - library()).detach().abs().max())
    print(
        f"L={length}: library {times['library']:.3f} s, dense {times['dense']:.3f} s "
        f"(library / dense {times['library'] / times['dense']:.2f}), max |diff| "
        f"{difference:.1e}; bare dense_hybrid {times['bare']:.4f} s (dense / bare "
        f"{times['dense'] / times['bare']:.3f})",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="best of this many calls")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for length in args.lengths:
        measure(args.batch, length, args.repeats)


if __name__ == "__main__":
    os.environ.setdefault("LINATTN_COMPILE", "foreground")  # (timed: kernels compile in the call)
    main()
