"""Where the dense form of a short fitted hybrid beats the one-pass kernels
(``linattn.hybrid.dense.MAX_LENGTH``).

One MiniLM-sized call on torch CPU tensors, no gradient (batch 8, 12 heads, d = 32, a
fitted map of m = 64 with a far weight per head, window 16 + 1 sink + an exact key per
row, the last batch row a quarter padded), timed for ``linear_attention`` as the plan
runs it (``dense-hybrid`` up to ``MAX_LENGTH`` tokens) and forced onto the compiled
kernels (``backend="numba"``: ``torch-kernels``, what ran before), best of
``--repeats``, in one run; their largest output difference; and torch's exact
``scaled_dot_product_attention`` of the same shape, for scale.

``--grad``: forward and backward in q, k and v (the kernels' custom operators'
backward against torch's autograd through the dense form).

``--jax``: the same call on JAX arrays (CPU), jitted, forward and ``jax.grad`` in q, k
and v, as the plan runs it (``dense-hybrid``) and forced onto the portable parts
(``backend="array_api"``: ``hybrid-parts``, what ran before); no exact key per row.

    python benchmarks/dense_hybrid_speed.py
    python benchmarks/dense_hybrid_speed.py --lengths 128 512 --causal --repeats 20
    python benchmarks/dense_hybrid_speed.py --jax --causal --lengths 128 256 384 512
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

import linattn as la


def best(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def measure(
    length: int, causal: bool, repeats: int, batch: int = 8, grad: bool = False
) -> dict[str, object]:
    """One length: milliseconds per path, the kernels' time over the dense form's;
    ``grad``: forward and backward in q, k and v."""
    heads, d, half = 12, 32, 32
    generator = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(batch, heads, length, d, generator=generator).requires_grad_(grad)
        for _ in "qkv"
    )
    key_mask = torch.ones(batch, 1, length, dtype=torch.bool)
    key_mask[-1, :, -length // 4 :] = False
    rng = np.random.default_rng(0)
    weight = np.eye(d)[:, :half] + 0.1 * rng.normal(size=(heads, d, half))
    bias = 0.1 * rng.normal(size=(heads, half))
    fm = la.FeatureMap.fitted(
        weight, bias, key_weight=weight, key_bias=bias, far_weight=np.full(heads, 0.5)
    )
    options: dict[str, object] = {"window": 16, "sink_keys": 1, "key_mask": key_mask}
    if causal:
        options["causal"] = True
    else:
        exact = torch.zeros(batch, 1, length, dtype=torch.bool)
        exact[:, :, length // 2] = True
        options["exact_key_mask"] = exact
    plan = la.plan_attention(q, k, v, fm, **options).executor
    cotangent = torch.randn(batch, heads, length, d, generator=generator)

    def run(call):  # type: ignore[no-untyped-def]
        if not grad:
            with torch.inference_mode():
                return call()
        return torch.autograd.grad((call() * cotangent).sum(), [q, k, v])

    def sdpa() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=key_mask[:, :, None, :], is_causal=False
        )

    def planned() -> torch.Tensor:
        return la.linear_attention(q, k, v, fm, **options)

    def kernels() -> torch.Tensor:
        return la.linear_attention(q, k, v, fm, backend="numba", **options)

    times = {name: best(lambda f=f: run(f), repeats) for name, f in
             (("plan", planned), ("kernels", kernels), ("sdpa", sdpa))}  # fmt: skip
    with torch.set_grad_enabled(grad):  # (the plan differs with and without)
        difference = (planned() - kernels()).detach().abs().max()
    return {
        "L": length, "causal": causal, "grad": grad, "plan": plan,
        "plan ms": round(times["plan"] * 1e3, 2), "kernels ms": round(times["kernels"] * 1e3, 2),
        "kernels / plan": round(times["kernels"] / times["plan"], 2),
        "sdpa ms": round(times["sdpa"] * 1e3, 2), "max |diff|": float(difference),
    }  # fmt: skip


def measure_jax(length: int, causal: bool, repeats: int, batch: int = 8) -> dict[str, object]:
    """One length on JAX arrays: milliseconds per path, forward and gradient."""
    import jax
    import jax.numpy as jnp

    heads, d, half = 12, 32, 32
    rng = np.random.default_rng(0)
    q, k, v = (
        jnp.asarray(rng.normal(size=(batch, heads, length, d)), dtype=jnp.float32) for _ in "qkv"
    )
    mask = np.ones((batch, 1, length), dtype=bool)
    mask[-1, :, -length // 4 :] = False
    key_mask = jnp.asarray(mask)
    weight = np.eye(d)[:, :half] + 0.1 * rng.normal(size=(heads, d, half))
    bias = 0.1 * rng.normal(size=(heads, half))
    fm = la.FeatureMap.fitted(
        weight, bias, key_weight=weight, key_bias=bias, far_weight=np.full(heads, 0.5)
    )
    options = {"window": 16, "sink_keys": 1, "causal": causal}

    def attend(backend):  # type: ignore[no-untyped-def]
        def call(q, k, v, key_mask):  # type: ignore[no-untyped-def]
            return la.linear_attention(q, k, v, fm, key_mask=key_mask, backend=backend, **options)

        def loss(q, k, v, key_mask):  # type: ignore[no-untyped-def]
            return jnp.sum(call(q, k, v, key_mask) ** 2)

        return jax.jit(call), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

    times = {}
    for name, backend in (("plan", None), ("parts", "array_api")):
        forward, gradient = attend(backend)
        for mode, fn in (("forward", forward), ("grad", gradient)):
            times[f"{name} {mode}"] = best(
                lambda fn=fn: jax.block_until_ready(fn(q, k, v, key_mask)), repeats
            )
    plan = la.plan_attention(q, k, v, fm, key_mask=key_mask, **options).executor
    difference = jnp.abs(attend(None)[0](q, k, v, key_mask) - attend("array_api")[0](
        q, k, v, key_mask)).max()  # fmt: skip
    return {
        "L": length, "causal": causal, "plan": plan,
        **{f"{key} ms": round(t * 1e3, 1) for key, t in times.items()},
        "parts / plan forward": round(times["parts forward"] / times["plan forward"], 2),
        "parts / plan grad": round(times["parts grad"] / times["plan grad"], 2),
        "max |diff|": float(difference),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 256, 384, 512, 768])
    ap.add_argument("--causal", action="store_true", help="also causal calls (no exact keys)")
    ap.add_argument("--only-causal", action="store_true", help="causal calls only")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--jax", action="store_true", help="JAX arrays (jitted), not torch")
    ap.add_argument(
        "--grad", action="store_true", help="torch: forward and backward in q, k and v"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for causal in (True,) if args.only_causal else (False, True) if args.causal else (False,):
        for length in args.lengths:
            if args.jax:
                print(measure_jax(length, causal, args.repeats), flush=True)
            else:
                print(measure(length, causal, args.repeats, grad=args.grad), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("LINATTN_COMPILE", "foreground")  # (timed: kernels compile in the call)
    main()
