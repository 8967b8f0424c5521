"""One-command GPU check of the Numba CUDA kernels: correctness, then speed against flash.

Usage::

    python benchmarks/gpu_check.py            # on a machine with a CUDA GPU (< 5 min on an H200)
    python benchmarks/gpu_check.py --dry-run  # CUDA simulator, tiny shapes, NumPy only

1. Correctness, on every GPU library installed (CuPy, torch CUDA): the kernel's
   forward (``outputs_aug``, ``kv_out``, ``log_shift_out``) against the
   array-API path on the same library and inputs (float64 within 1e-10,
   float32 within 1e-5, relative to each array's scale), causality bit-exact;
   the backward against autograd of the array-API path on torch CUDA (an
   invariant loss, so held-constant stabilisers give the same gradients); the
   torch autograd route through ``linattn_numba._torch``; end-to-end dispatch.
2. Speed at B=4, H=16, d=64, m=256, float32 and bfloat16 inputs, L = 4K ... 64K:
   the kernel (on precomputed log-features, and end to end with features), the
   array-API path on CuPy, and ``torch.nn.functional.scaled_dot_product_attention
   (is_causal=True)`` (flash attention for bfloat16); and the first L at which
   the kernel beats it.  Times are medians of CUDA-event timings, all in one run.

Exits non-zero if any correctness check fails.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

FAILURES: list[str] = []


def report(name: str, ok: bool, detail: str = "") -> None:
    print(f"  [{'ok' if ok else 'FAIL'}] {name}{': ' + detail if detail else ''}", flush=True)
    if not ok:
        FAILURES.append(name)


def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """max |a - e| / max |e| over finite entries; inf if the non-finite patterns differ."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    if actual.shape != expected.shape:
        return math.inf
    finite = np.isfinite(expected)
    if not np.array_equal(finite, np.isfinite(actual)):
        return math.inf
    if not np.array_equal(actual[~finite], expected[~finite]):
        return math.inf
    scale = float(np.max(np.abs(expected[finite]), initial=0.0)) or 1.0
    return float(np.max(np.abs(actual[finite] - expected[finite]), initial=0.0)) / scale


def random_inputs(
    rng: np.random.Generator, batch: int, length: int, m: int, dv: int, *, state: bool
) -> tuple[np.ndarray, ...]:
    """Log-features (one masked key), ``[V | 1]`` and a state, in float64 on the host."""
    lq = rng.normal(size=(batch, length, m)) - 3.0
    lk = rng.normal(size=(batch, length, m)) - 3.0
    lk[:, min(2, length - 1), :] = -np.inf
    va = np.concatenate([rng.normal(size=(batch, length, dv)), np.ones((batch, length, 1))], -1)
    if state:
        kv = np.abs(rng.normal(size=(batch, m, dv + 1)))
        mu = rng.normal(size=(batch, m))
    else:
        kv = np.zeros((batch, m, dv + 1))
        mu = np.full((batch, m), -np.inf)
    return lq, lk, va, kv, mu


def invariant_cotangents(
    out: np.ndarray, mu_out: np.ndarray, r_out: np.ndarray, r_state: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Cotangents of ``sum(o r_out) + sum(exp(mu) S r_state)`` (stabiliser-free quantities)."""
    den = out[..., -1:]
    o = out[..., :-1] / den
    d_out = np.concatenate([r_out / den, -np.sum(r_out * o, -1, keepdims=True) / den], -1)
    return d_out, np.exp(mu_out)[..., None] * r_state


# --------------------------------------------------------------------------------------
# Correctness


def check_library(
    name: str,
    to_lib: Callable[[np.ndarray], Any],
    to_host: Callable[[Any], np.ndarray],
    xp: Any,
    shapes: list[tuple[int, int, int, int, int]],
) -> None:
    """Forward and causality of ``gpu.forward(name, ...)`` against the array-API path on ``xp``."""
    from linattn import causal as array_api
    from linattn_numba import gpu

    rng = np.random.default_rng(0)
    print(f"\n== {name}: forward against the array-API path on {name}", flush=True)
    for batch, length, m, dv, chunk in shapes:
        for dtype, tol in (("float64", 1e-10), ("float32", 1e-5)):
            host = tuple(
                a.astype(dtype) for a in random_inputs(rng, batch, length, m, dv, state=True)
            )
            args = tuple(to_lib(a) for a in host)
            got = gpu.forward(name, *args, chunk)
            want = array_api.causal(xp, args[0], None, args[1], None, *args[2:], chunk)
            errors = [
                relative_error(to_host(g), to_host(w)) for g, w in zip(got, want, strict=True)
            ]
            types_ok = all(type(g) is type(args[0]) for g in got)
            report(
                f"{name} forward B={batch} L={length} m={m} dv={dv} C={chunk} {dtype}",
                types_ok and max(errors) <= tol,
                "errors " + ", ".join(f"{e:.1e}" for e in errors) + f" (tol {tol:g})",
            )
    batch, length, m, dv, chunk = shapes[0]
    host = random_inputs(rng, batch, length, m, dv, state=True)
    before = to_host(gpu.forward(name, *(to_lib(a) for a in host), chunk)[0])
    cut = length // 2
    changed = [a.copy() for a in host]
    changed[1][:, cut + 1 :] += 5.0
    changed[2][:, cut + 1 :, :-1] = 1e3
    after = to_host(gpu.forward(name, *(to_lib(a) for a in changed), chunk)[0])
    report(
        f"{name} causality bit-exact", np.array_equal(after[:, : cut + 1], before[:, : cut + 1])
    )


def check_backward_torch(shape: tuple[int, int, int, int, int]) -> None:
    """The backward kernel, and the autograd route, against autograd of the array-API path."""
    import array_api_compat.torch as xp
    import torch

    from linattn import causal as array_api
    from linattn_numba import gpu

    print("\n== torch CUDA: backward against autograd of the array-API path", flush=True)
    batch, length, m, dv, chunk = shape
    rng = np.random.default_rng(1)
    host = random_inputs(rng, batch, length, m, dv, state=True)
    r_out = rng.normal(size=(batch, length, dv))
    r_state = rng.normal(size=(batch, m, dv + 1))
    dev = torch.device("cuda")

    def reference() -> list[np.ndarray]:
        ts = [torch.tensor(a, device=dev, requires_grad=i < 4) for i, a in enumerate(host)]
        out, kv, mu = array_api.causal(xp, ts[0], None, ts[1], None, *ts[2:], chunk)
        o = out[..., :-1] / out[..., -1:]
        loss = (o * torch.tensor(r_out, device=dev)).sum() + (
            torch.exp(mu)[..., None] * kv * torch.tensor(r_state, device=dev)
        ).sum()
        loss.backward()
        return [t.grad.cpu().numpy() for t in ts[:4]]

    want = reference()
    args = [torch.tensor(a, device=dev) for a in host]
    out, _, mu_out = gpu.forward("torch", *args, chunk)
    cot = invariant_cotangents(out.cpu().numpy(), mu_out.cpu().numpy(), r_out, r_state)
    got = gpu.backward("torch", *args, chunk, *(torch.tensor(c, device=dev) for c in cot))
    errors = [relative_error(g.cpu().numpy(), w) for g, w in zip(got, want, strict=True)]
    report(
        "backward kernel (d lq, d lk, d va, d kv) float64",
        max(errors) <= 1e-9,
        ", ".join(f"{e:.1e}" for e in errors),
    )

    try:
        ts = [torch.tensor(a, device=dev, requires_grad=i < 4) for i, a in enumerate(host)]
        out, kv, mu = gpu.causal_kernel("torch")(*ts, chunk)
        o = out[..., :-1] / out[..., -1:]
        loss = (o * torch.tensor(r_out, device=dev)).sum() + (
            torch.exp(mu)[..., None] * kv * torch.tensor(r_state, device=dev)
        ).sum()
        loss.backward()
        errors = [relative_error(t.grad.cpu().numpy(), w) for t, w in zip(ts, want, strict=False)]
        report(
            "torch autograd through the kernel",
            max(errors) <= 1e-9,
            ", ".join(f"{e:.1e}" for e in errors),
        )
    except Exception as error:  # report, do not hide: the check fails
        report("torch autograd through the kernel", False, f"{type(error).__name__}: {error}")


def check_dispatch(name: str, q: Any, k: Any, v: Any) -> None:
    """``linear_attention(backend="numba")`` reaches the CUDA kernel; agrees with the array API."""
    import linattn as la

    print(f"\n== {name}: end-to-end dispatch", flush=True)
    fm = la.FeatureMap(q.shape[-1], 266, seed=0)
    try:
        a = la.linear_attention(q, k, v, fm, causal=True, backend="numba")
        b = la.linear_attention(q, k, v, fm, causal=True, backend="array_api")
        from linattn._xp import to_host

        err = relative_error(to_host(a), to_host(b))
        report(
            f"{name} linear_attention(backend='numba') == array_api (m=266)",
            err <= 1e-5,
            f"{err:.1e}",
        )
    except Exception as error:
        report(
            f"{name} linear_attention(backend='numba')", False, f"{type(error).__name__}: {error}"
        )


# --------------------------------------------------------------------------------------
# Timing


def cuda_time(
    fn: Callable[[], Any], sync: Callable[[], None], repeats: int, budget_s: float
) -> float:
    """Median wall time (s) of ``fn`` after one warm-up, synchronising around each call."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
        if sum(times) > budget_s:
            break
    return statistics.median(times)


def timing(lengths: list[int], repeats: int, *, dry_run: bool) -> None:
    """The speed table; in a dry run, tiny shapes on NumPy in the simulator."""
    import linattn as la

    batch, heads, d, m = (1, 2, 8, 8) if dry_run else (4, 16, 64, 256)
    rng = np.random.default_rng(2)
    fm = la.FeatureMap(d, m, seed=0)
    have_torch = have_cupy = False
    if not dry_run:
        try:
            import torch

            have_torch = torch.cuda.is_available()
        except ImportError:
            pass
        try:
            import cupy

            have_cupy = cupy.cuda.runtime.getDeviceCount() > 0
        except Exception:
            pass
    chunk = 4 if dry_run else 64
    print(
        f"\n== speed: B={batch}, H={heads}, d={d}, m={m}, chunk {chunk}; median seconds, "
        f"repeats={repeats}",
        flush=True,
    )
    header = (
        f"{'dtype':9} {'L':>6} {'kernel':>9} {'kernel+feat':>12} {'array-api':>10} "
        f"{'sdpa':>9} {'sdpa/kernel':>11}"
    )
    print(header)
    for dtype in ("float32",) if dry_run else ("float32", "bfloat16"):
        overtakes = None
        skip: set[str] = set()
        for length in lengths:
            row: dict[str, float] = {}
            x = [rng.normal(size=(batch, heads, length, d)).astype(np.float32) for _ in range(3)]
            if dry_run:
                row.update(_time_simulator(x, fm, m, chunk, repeats))
            else:
                row.update(_time_gpu(x, fm, dtype, repeats, have_torch, have_cupy, skip))
            if (
                "kernel+feat" in row
                and "sdpa" in row
                and overtakes is None
                and row["kernel+feat"] < row["sdpa"]
            ):
                overtakes = length
            ratio = (
                row["sdpa"] / row["kernel+feat"]
                if {"sdpa", "kernel+feat"} <= row.keys()
                else math.nan
            )

            def cell(key: str, width: int, row: dict[str, float] = row) -> str:
                return f"{row[key]:{width}.4f}" if key in row else f"{'-':>{width}}"

            print(
                f"{dtype:9} {length:>6} {cell('kernel', 9)} {cell('kernel+feat', 12)} "
                f"{cell('array-api', 10)} {cell('sdpa', 9)} {ratio:11.2f}",
                flush=True,
            )
        if not dry_run:
            print(
                f"  {dtype}: kernel (with features) overtakes SDPA "
                f"{'at L = ' + str(overtakes) if overtakes else 'at no L measured'}"
            )


def _time_simulator(
    x: list[np.ndarray], fm: Any, m: int, chunk: int, repeats: int
) -> dict[str, float]:
    """The dry run's timings: kernel (simulated) and array-API path, both on NumPy."""
    import linattn as la
    from linattn_numba import gpu

    q, k, v = x
    lq = np.asarray(fm.signed_log_features(q)[0])
    lk = np.asarray(fm.signed_log_features(k)[0])
    va = np.concatenate([v, np.ones_like(v[..., :1])], -1)
    kv = np.zeros((*q.shape[:2], m, v.shape[-1] + 1), np.float32)
    mu = np.full((*q.shape[:2], m), -np.inf, np.float32)
    return {
        "kernel": cuda_time(
            lambda: gpu.forward("numpy", lq, lk, va, kv, mu, chunk), lambda: None, repeats, 60
        ),
        "array-api": cuda_time(
            lambda: la.linear_attention(
                q, k, v, fm, causal=True, chunk_size=chunk, backend="array_api"
            ),
            lambda: None,
            repeats,
            60,
        ),
    }


def _time_gpu(
    x: list[np.ndarray],
    fm: Any,
    dtype: str,
    repeats: int,
    have_torch: bool,
    have_cupy: bool,
    skip: set[str],
) -> dict[str, float]:
    import linattn as la
    from linattn_numba import gpu

    row: dict[str, float] = {}
    budget = 20.0
    if have_torch:
        import torch

        tdtype = getattr(torch, dtype)
        q, k, v = (torch.tensor(a, device="cuda").to(tdtype) for a in x)
        sync = torch.cuda.synchronize
        with torch.no_grad():
            lq = fm.signed_log_features(q)[0].float().contiguous()
            lk = fm.signed_log_features(k)[0].float().contiguous()
            va = torch.cat([v.float(), torch.ones_like(v[..., :1], dtype=torch.float32)], -1)
            kv = torch.zeros((*lq.shape[:2], lq.shape[-1], va.shape[-1]), device="cuda")
            mu = torch.full(lq.shape[:2] + lq.shape[-1:], -math.inf, device="cuda")

            def with_features() -> Any:
                """What linear_attention does around the kernel, without depending on dispatch."""
                log_q = fm.signed_log_features(q)[0]
                log_k = fm.signed_log_features(k)[0]
                values = torch.cat(
                    [v.float(), torch.ones_like(v[..., :1], dtype=torch.float32)], -1
                )
                out = gpu.forward("torch", log_q, log_k, values, kv, mu, 64)[0]
                return (out[..., :-1] / out[..., -1:]).to(q.dtype)

            measures = {
                "kernel": lambda: gpu.forward("torch", lq, lk, va, kv, mu, 64),
                "kernel+feat": with_features,
                "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=True
                ),
            }
            for key, fn in measures.items():
                if key in skip:
                    continue
                try:
                    row[key] = cuda_time(fn, sync, repeats, budget)
                except Exception as error:
                    print(f"  {key} failed: {type(error).__name__}: {error}", flush=True)
                    skip.add(key)
                    torch.cuda.empty_cache()
                if row.get(key, 0.0) > budget:
                    skip.add(key)
            del lq, lk, va, kv, mu
            torch.cuda.empty_cache()
    if have_cupy and "array-api" not in skip:
        import cupy

        cdtype = np.float32 if dtype == "float32" else np.float16  # CuPy has no bfloat16
        q, k, v = (cupy.asarray(a, dtype=cdtype) for a in x)
        try:
            row["array-api"] = cuda_time(
                lambda: la.linear_attention(q, k, v, fm, causal=True, backend="array_api"),
                cupy.cuda.Device().synchronize,
                repeats,
                budget,
            )
        except Exception as error:
            print(f"  array-api failed: {type(error).__name__}: {error}", flush=True)
            skip.add("array-api")
        if row.get("array-api", 0.0) > budget:
            skip.add("array-api")
        del q, k, v
        cupy.get_default_memory_pool().free_all_blocks()
    return row


# --------------------------------------------------------------------------------------


def dry_run() -> None:
    print("dry run: CUDA simulator, tiny shapes, NumPy arrays (no CuPy, no torch CUDA)")
    import linattn_numba._cuda as lcuda

    if not lcuda.SIMULATOR:
        raise SystemExit("--dry-run needs NUMBA_ENABLE_CUDASIM=1 set before numba is imported")
    check_library("numpy", lambda a: a, np.asarray, np, [(2, 7, 6, 3, 4)])
    from linattn import causal as array_api
    from linattn_numba import gpu

    print("\n== numpy (simulator): backward through held-constant stabilisers", flush=True)
    rng = np.random.default_rng(3)
    host = random_inputs(rng, 1, 6, 5, 2, state=True)
    out, _, mu_out = gpu.forward("numpy", *host, 4)
    r_out, r_state = rng.normal(size=(1, 6, 2)), rng.normal(size=(1, 5, 3))
    got = gpu.backward("numpy", *host, 4, *invariant_cotangents(out, mu_out, r_out, r_state))
    h, numeric = 1e-6, np.zeros_like(host[2])

    def loss(va: np.ndarray) -> float:
        o, kv, mu = array_api.causal(np, host[0], None, host[1], None, va, *host[3:], 4)
        return float(
            np.sum(o[..., :-1] / o[..., -1:] * r_out)
            + np.sum(np.exp(mu)[..., None] * kv * r_state)
        )

    for index in np.ndindex(host[2].shape):
        plus, minus = host[2].copy(), host[2].copy()
        plus[index] += h
        minus[index] -= h
        numeric[index] = (loss(plus) - loss(minus)) / (2 * h)
    err = relative_error(got[2], numeric)
    report("d values_aug against central differences", err <= 1e-6, f"{err:.1e}")
    timing([8, 16], repeats=1, dry_run=True)


def full_run(repeats: int, lengths: list[int]) -> None:
    from linattn_numba import _cuda as lcuda

    print(f"CUDA status: {lcuda.status()}")
    if lcuda.status() != "available":
        raise SystemExit("no usable GPU: run with --dry-run for the simulator check")
    shapes = [(2, 300, 266, 64, 64), (3, 129, 1024, 256, 100), (1, 1, 17, 5, 64)]
    started = time.perf_counter()
    try:
        import cupy
    except ImportError:
        cupy = None
    try:
        import torch

        has_torch = torch.cuda.is_available()
    except ImportError:
        has_torch = False
    if cupy is not None:
        import array_api_compat.cupy as cxp

        check_library("cupy", cupy.asarray, cupy.asnumpy, cxp, shapes)
    else:
        print("\n(CuPy not installed: CuPy checks and the array-API CuPy timing are skipped)")
    if has_torch:
        import array_api_compat.torch as txp

        check_library(
            "torch",
            lambda a: torch.tensor(a, device="cuda"),
            lambda t: t.cpu().numpy(),
            txp,
            shapes,
        )
        check_backward_torch((2, 150, 266, 32, 64))
        x = [torch.randn(2, 3, 200, 64, device="cuda") for _ in range(3)]
        check_dispatch("torch", *x)
    if cupy is not None:
        x = [cupy.random.standard_normal((2, 3, 200, 64), dtype=np.float32) for _ in range(3)]
        check_dispatch("cupy", *x)
    print(f"\ncorrectness checks took {time.perf_counter() - started:.1f} s")
    timing(lengths, repeats, dry_run=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="run under the CUDA simulator with tiny shapes on NumPy",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536]
    )
    args = parser.parse_args(argv)
    if args.dry_run:
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"  # before numba is first imported
        dry_run()
    else:
        full_run(args.repeats, args.lengths)
    if FAILURES:
        print(f"\n{len(FAILURES)} check(s) FAILED: {', '.join(FAILURES)}")
        return 1
    print("\ndry run passed" if args.dry_run else "\nall checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
