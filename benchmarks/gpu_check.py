"""The first GPU run of the Numba CUDA kernels: checks that cannot waste the GPU's time.

Usage, from the repository root, with nothing but the machine's Python (and, if
``array_api_compat`` or numba-cuda's CUDA wheels are missing, a folder of wheels)::

    python benchmarks/gpu_check.py --out "$OUT" [--wheels wheels/] [--sanitizer]
    python benchmarks/gpu_check.py --simulator --tiny --out /tmp/check   # no GPU: the test

Sections, each its own process under its own timeout (the whole run fits
``--budget``, 420 s by default), in this order:

``preflight``
    the CUDA paths numba-cuda finds (driver, libNVVM, libdevice, NVRTC), then one
    probe kernel compiled and launched (it calls libdevice); nothing else runs if
    it fails.
``correctness``
    every library present (``numpy`` through host copies; CuPy; torch CUDA), float64
    and float32, against a NumPy float64 reference on the host: forward
    (``outputs_aug``, ``kv_out``, ``log_shift_out``), backward against CPU torch
    float64 autograd of the array-API path, causality (bit-exact).  Every output is
    poisoned with NaN before each call (memory a kernel forgets to write shows), and
    every float32 call runs twice and must be bit-identical (races show).  Each
    forward design is checked (``gpu.DESIGNS``; the BLAS one's checks start ``blas``).
``long``
    one check at L = 16384 (``--tiny``: 64): the float32 kernel's normalised outputs
    against float64 on the host, ``max|o32 - o64| / max|o64| <= 1e-5`` per head.
``timing``
    B = 1, H = 8, d = 64, m = 256, L = 4K, 16K, 64K, 128K as time allows: the kernel
    forward and forward + backward on log-features, the same with the feature map
    (torch autograd), the per-kernel breakdown (CUDA events), torch's SDPA (flash for
    bfloat16; float32) forward and forward + backward, and a measured matrix-product
    ceiling (square and chunk-shaped batched products).  Both forward designs are
    timed (``kernel ...`` and ``blas ...``; the BLAS design's float32 products without
    TF32), the BLAS one with its own breakdown (kernels and each matmul shape).
``sanitizer`` (``--sanitizer``)
    ``compute-sanitizer`` memcheck and racecheck over a small forward and backward.

Every result is appended to ``OUT/results.jsonl`` as one JSON object per line as
soon as it is known (``section``, ``check``, ``ok``, ``value``, ``limit``,
``detail`` and the shape); each section's output goes to ``OUT/<section>.log``; a
summary table prints last (and goes to ``OUT/summary.txt``).  Exit status 1 if any
check failed or a section did not finish.

Bootstrap (stdlib only, before anything is imported): the repository root goes on
``sys.path`` (Python puts ``benchmarks/`` there, not the root), missing
distributions are installed from ``--wheels`` with ``pip --no-index --no-deps
--target`` (or unpacked, if pip is absent), and the sections run with
``PYTHONPATH`` and ``LD_LIBRARY_PATH`` pointing at them: cuda-pathfinder, which
numba-cuda asks for libNVVM and NVRTC, cannot see ``--target`` wheels otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TIMEOUTS = {"preflight": 60, "correctness": 110, "long": 70, "timing": 150, "sanitizer": 45}
"""Seconds each section may take; together 435 s, cut to the run's ``--budget``."""
REEXEC = "LINATTN_GPU_CHECK_ENV"
PREFIX = {"kernels": "", "blas": "blas "}  # check names of each forward design


# --------------------------------------------------------------------------------------
# Bootstrap: only the standard library, before numba or linattn is imported.


def wheel_distribution(wheel: Path) -> str:
    """The distribution a wheel file installs, normalised (``array_api_compat``)."""
    return wheel.name.split("-")[0].replace("-", "_").replace(".", "_").lower()


def installed(distribution: str) -> bool:
    from importlib import metadata

    try:
        metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return importlib.util.find_spec(distribution) is not None
    return True


def install_wheels(wheels: Path, site: Path, log: Callable[[str], None]) -> list[str]:
    """Install every wheel in ``wheels`` whose distribution is missing, into ``site``."""
    missing = [
        w for w in sorted(wheels.glob("*.whl")) if not installed(wheel_distribution(w))
    ]  # fmt: skip
    if not missing:
        return []
    site.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps"]
    command += ["--target", str(site), "--upgrade", *map(str, missing)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        # No pip on the image: a wheel is a zip of the files --no-deps would install.
        log(f"pip failed ({done.stderr.strip()[-300:]}); unpacking the wheels instead")
        for wheel in missing:
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(site)
    return [w.name for w in missing]


def library_dirs(site: Path) -> list[str]:
    """Folders of shared libraries in NVIDIA's wheels under ``site`` (``nvidia/cu13/lib``...)."""
    found = set()
    for library in (site / "nvidia").glob("**/*.so*") if (site / "nvidia").is_dir() else ():
        found.add(str(library.parent))
    return sorted(found)


def section_env(site: Path, simulator: bool) -> dict[str, str]:
    """The environment the sections run in: the repository and ``site`` importable, the
    wheels' shared libraries on ``LD_LIBRARY_PATH`` (set before the process starts, which
    is the only time the dynamic loader reads it)."""
    env = dict(os.environ)
    paths = [str(ROOT), *([str(site)] if site.is_dir() else [])]
    env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [env.get("PYTHONPATH")])])
    libs = library_dirs(site)
    if libs:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            [*libs, *filter(None, [env.get("LD_LIBRARY_PATH")])]
        )
    if simulator:
        env["NUMBA_ENABLE_CUDASIM"] = "1"
    env[REEXEC] = "1"
    return env


def ensure_section_env(site: Path, simulator: bool) -> None:
    """Re-execute this process once if it was started without :func:`section_env`."""
    sys.path[:0] = [str(ROOT), *([str(site)] if site.is_dir() else [])]
    if os.environ.get(REEXEC) == "1":
        return
    env = section_env(site, simulator)
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


# --------------------------------------------------------------------------------------
# Results: one JSON line each, written as soon as known.


class Results:
    def __init__(self, out: Path, section: str) -> None:
        self.path = out / "results.jsonl"
        self.section = section
        self.failed = 0

    def emit(self, check: str, ok: bool | None, **fields: Any) -> None:
        record = {"section": self.section, "check": check, "ok": ok, **fields}
        line = json.dumps(record, default=_plain)
        with self.path.open("a") as f:
            f.write(line + "\n")
            f.flush()
        mark = {True: "ok", False: "FAIL", None: "--"}[ok]
        extra = {k: v for k, v in record.items() if k not in ("section", "check", "ok")}
        print(f"  [{mark}] {check} {json.dumps(extra, default=_plain)}", flush=True)
        self.failed += ok is False

    @contextlib.contextmanager
    def guard(self, check: str) -> Iterator[None]:
        """Record an exception as a failed check and go on with the next one."""
        try:
            yield
        except Exception as error:  # the run must go on: report and continue
            self.emit(check, False, detail=f"{type(error).__name__}: {str(error)[:500]}")


def _plain(x: Any) -> Any:
    return x.item() if hasattr(x, "item") else str(x)


# --------------------------------------------------------------------------------------
# Shared by the sections (imported after the environment is set).


def relative_error(actual: Any, expected: Any) -> float:
    """max |a - e| / max |e| over finite entries; inf if shapes or non-finite entries differ."""
    import numpy as np

    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    if a.shape != e.shape:
        return math.inf
    finite = np.isfinite(e)
    if not np.array_equal(finite, np.isfinite(a)) or not np.array_equal(a[~finite], e[~finite]):
        return math.inf
    scale = float(np.max(np.abs(e[finite]), initial=0.0)) or 1.0
    return float(np.max(np.abs(a[finite] - e[finite]), initial=0.0)) / scale


def random_inputs(rng: Any, batch: int, length: int, m: int, dv: int) -> tuple[Any, ...]:
    """Log-features (one masked key), ``[V | 1]`` and a prior state, float64 on the host."""
    import numpy as np

    lq = rng.normal(size=(batch, length, m)) - 3.0
    lk = rng.normal(size=(batch, length, m)) - 3.0
    lk[:, min(2, length - 1), :] = -np.inf
    va = np.concatenate([rng.normal(size=(batch, length, dv)), np.ones((batch, length, 1))], -1)
    kv = np.abs(rng.normal(size=(batch, m, dv + 1)))
    mu = rng.normal(size=(batch, m))
    mu[:, 0], kv[:, 0] = -np.inf, 0.0  # a feature that has seen no key yet
    return lq, lk, va, kv, mu


def host_reference(args: tuple[Any, ...], chunk: int) -> tuple[Any, ...]:
    """The array-API path on NumPy float64 (inputs as given, already rounded)."""
    import numpy as np

    from linattn import causal as array_api

    lq, lk, va, kv, mu = (np.asarray(a, dtype=np.float64) for a in args)
    return array_api.causal(np, lq, None, lk, None, va, kv, mu, chunk)


class Library:
    """One array library on the device: transfers, synchronisation, NaN-poisoned outputs."""

    def __init__(self, name: str) -> None:
        self.name = name
        if name == "torch":
            import torch

            self.to = lambda a: torch.tensor(a, device="cuda")
            self.host = lambda t: t.detach().cpu().numpy()
            self.sync = torch.cuda.synchronize
        elif name == "cupy":
            import cupy

            self.to, self.host = cupy.asarray, cupy.asnumpy
            self.sync = cupy.cuda.Device().synchronize
        else:
            import numpy as np

            self.to, self.host, self.sync = (lambda a: a), np.asarray, (lambda: None)

    def poison(self) -> None:
        """Every array the kernels' host code allocates starts as NaN, not as zeros."""
        import numpy as np

        from linattn_numba import gpu

        lib = gpu.LIBRARIES[self.name]
        original = type(lib).empty

        def empty(shape: tuple[int, ...], dtype: str, device: int | None) -> Any:
            x = original(lib, shape, dtype, device)
            if self.name == "numpy":
                x.copy_to_device(np.full(shape, np.nan, dtype=dtype))
            elif self.name == "cupy":
                x.fill(math.nan)
            else:
                x.fill_(math.nan)
            return x

        lib.empty = empty  # type: ignore[method-assign]


def libraries(simulator: bool) -> list[str]:
    names = ["numpy"]
    if simulator:
        return names
    with contextlib.suppress(Exception):
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            names.append("cupy")
    with contextlib.suppress(Exception):
        import torch

        if torch.cuda.is_available():
            names.append("torch")
    return names


def invariant_cotangents(ref: tuple[Any, ...], r_out: Any, r_state: Any) -> tuple[Any, Any]:
    """Cotangents of ``sum(o r_out) + sum(exp(mu) S r_state)``, both stabiliser-free."""
    import numpy as np

    out, _, mu_out = ref
    den = out[..., -1:]
    o = out[..., :-1] / den
    d_out = np.concatenate([r_out / den, -np.sum(r_out * o, -1, keepdims=True) / den], -1)
    return d_out, np.exp(mu_out)[..., None] * r_state


def torch_reference_grads(args: tuple[Any, ...], chunk: int, r_out: Any, r_state: Any) -> list:
    """Gradients of the invariant loss by CPU torch float64 autograd of the array-API path."""
    import array_api_compat.torch as xp
    import torch

    from linattn import causal as array_api

    ts = [torch.tensor(a, dtype=torch.float64, requires_grad=i < 4) for i, a in enumerate(args)]
    out, kv, mu = array_api.causal(xp, ts[0], None, ts[1], None, *ts[2:], chunk)
    o = out[..., :-1] / out[..., -1:]
    loss = (o * torch.tensor(r_out)).sum() + (
        torch.exp(mu)[..., None] * kv * torch.tensor(r_state)
    ).sum()
    loss.backward()
    return [t.grad.numpy() for t in ts[:4]]


# --------------------------------------------------------------------------------------
# Sections.


def preflight(res: Results, opts: argparse.Namespace) -> None:
    import platform

    import numpy as np

    from linattn_numba.gpu import target as _cuda

    res.emit("python", None, detail=f"{platform.python_version()} {sys.executable}")
    for part, (path, note) in _cuda.toolchain().items():
        res.emit(f"found {part}", path is not None, detail=f"{path} ({note})")
    paths = os.environ.get("LD_LIBRARY_PATH", "")
    res.emit("LD_LIBRARY_PATH", None, detail=paths or "(unset)")
    status = _cuda.status()
    res.emit("status", status == "available", detail=status)
    if status != "available":
        return
    if not _cuda.SIMULATOR:
        with res.guard("device"):
            dev = _cuda.cuda.get_current_device()
            from numba.cuda.cudadrv import driver, nvvm

            res.emit(
                "device", None, detail=f"{dev.name} cc {dev.compute_capability}, driver "
                f"CUDA {driver.get_version()}, NVVM {nvvm.NVVM().get_version()}",
            )  # fmt: skip

    with res.guard("probe kernel"):
        seconds = _cuda.probe()
        res.emit("probe kernel", True, value=seconds, detail="compiled, launched, read back")
    with res.guard("first forward (compiles the float32 kernels)"):
        from linattn_numba import gpu

        started = time.perf_counter()
        args = tuple(
            a.astype(np.float32) for a in random_inputs(np.random.default_rng(0), 1, 9, 5, 2)
        )
        gpu.forward("numpy", *args, 4)
        res.emit("first forward compile+run", True, value=time.perf_counter() - started)
    for name in ("linattn", "linattn_numba", "torch", "cupy", "array_api_compat"):
        spec = importlib.util.find_spec(name)
        res.emit(f"import {name}", None, detail=str(spec.origin) if spec else "absent")


def correctness(res: Results, opts: argparse.Namespace) -> None:
    import numpy as np

    from linattn_numba import gpu

    # (B, L, m, d_v, chunk): odd sizes cross tile edges; m = 1024 and d_v = 256 the big ones.
    full = [(2, 300, 266, 64, 64), (3, 129, 1024, 256, 100), (1, 1, 17, 5, 64)]
    full.append((4, 1000, 256, 64, 64))
    shapes = [(2, 9, 5, 3, 4), (1, 7, 4, 2, 16)] if opts.tiny else full
    rng = np.random.default_rng(0)
    tol = {"float64": 1e-10, "float32": 1e-5}
    grad_tol = {"float64": 1e-9, "float32": 1e-5}
    for name in libraries(opts.simulator):
        lib = Library(name)
        lib.poison()
        for batch, length, m, dv, chunk in shapes:
            shape = {"lib": name, "B": batch, "L": length, "m": m, "dv": dv, "C": chunk}
            host64 = random_inputs(rng, batch, length, m, dv)
            r_out = rng.normal(size=(batch, length, dv))
            r_state = rng.normal(size=(batch, m, dv + 1))
            for dtype in ("float64", "float32"):
                host = tuple(a.astype(dtype) for a in host64)
                ref = host_reference(host, chunk)  # float64, on the rounded inputs
                for design in gpu.DESIGNS:
                    check = f"{PREFIX[design]}forward {dtype}"
                    with res.guard(f"{check} {shape}"):
                        calls = 2 if dtype == "float32" else 1
                        runs = [
                            [lib.host(x) for x in
                             gpu.forward(name, *map(lib.to, host), chunk, design, False)]
                            for _ in range(calls)
                        ]  # fmt: skip
                        errors = [relative_error(g, w) for g, w in zip(runs[0], ref, strict=True)]
                        res.emit(
                            check, max(errors) <= tol[dtype], value=max(errors),
                            limit=tol[dtype], detail=f"out, kv, mu: {errors}", **shape,
                        )  # fmt: skip
                        if calls == 2:
                            same = all(
                                np.array_equal(a, b, equal_nan=True)
                                for a, b in zip(*runs, strict=True)
                            )  # fmt: skip
                            res.emit(f"{check} run twice bit-identical", same, **shape)
                with res.guard(f"backward {dtype} {shape}"):
                    cot = invariant_cotangents(ref, r_out, r_state)
                    want = torch_reference_grads(host, chunk, r_out, r_state)
                    dev_cot = [lib.to(c.astype(dtype)) for c in cot]
                    args = [lib.to(a) for a in host]
                    runs = [
                        [lib.host(g) for g in gpu.backward(name, *args, chunk, *dev_cot)]
                        for _ in range(2 if dtype == "float32" else 1)
                    ]
                    errors = [relative_error(g, w) for g, w in zip(runs[0], want, strict=True)]
                    res.emit(
                        f"backward {dtype} vs torch float64 autograd",
                        max(errors) <= grad_tol[dtype], value=max(errors), limit=grad_tol[dtype],
                        detail=f"d lq, d lk, d va, d kv: {errors}", **shape,
                    )  # fmt: skip
                    if len(runs) == 2:
                        same = all(
                            np.array_equal(a, b, equal_nan=True)
                            for a, b in zip(*runs, strict=True)
                        )  # fmt: skip
                        res.emit(f"backward {dtype} run twice bit-identical", same, **shape)
                for design in gpu.DESIGNS:
                    check = f"{PREFIX[design]}causality {dtype} bit-exact"
                    with res.guard(f"{check} {shape}"):
                        cut = length // 2
                        changed = [a.copy() for a in host]
                        changed[0][:, cut + 1 :] += 1.0
                        changed[1][:, cut + 1 :] += 5.0
                        changed[2][:, cut + 1 :, :-1] = 1e3
                        before, after = (
                            lib.host(gpu.forward(name, *map(lib.to, x), chunk, design, False)[0])
                            for x in (host, changed)
                        )
                        same = np.array_equal(after[:, : cut + 1], before[:, : cut + 1])
                        res.emit(check, bool(same), **shape)
        if name == "torch":
            torch_routes(res, shapes[0])


def torch_routes(res: Results, shape: tuple[int, ...]) -> None:
    """The custom operator (autograd) and ``linear_attention`` dispatch on torch CUDA."""
    import numpy as np
    import torch

    import linattn as la
    from linattn_numba import libraries

    batch, length, m, dv, chunk = shape
    rng = np.random.default_rng(5)
    host = random_inputs(rng, batch, length, m, dv)
    r_out, r_state = rng.normal(size=(batch, length, dv)), rng.normal(size=(batch, m, dv + 1))
    with res.guard("torch autograd through the kernel"):
        want = torch_reference_grads(host, chunk, r_out, r_state)
        ts = [torch.tensor(a, device="cuda", requires_grad=i < 4) for i, a in enumerate(host)]
        out, kv, mu = libraries.cuda_causal_kernel("torch")(*ts, chunk)
        o = out[..., :-1] / out[..., -1:]
        loss = (o * torch.tensor(r_out, device="cuda")).sum()
        loss = loss + (torch.exp(mu)[..., None] * kv * torch.tensor(r_state, device="cuda")).sum()
        loss.backward()
        errors = [relative_error(t.grad.cpu().numpy(), w) for t, w in zip(ts, want, strict=False)]
        res.emit("torch autograd through the kernel", max(errors) <= 1e-9, value=max(errors),
                 limit=1e-9)  # fmt: skip
    with res.guard("linear_attention(backend='numba') on torch CUDA"):
        q, k, v = (rng.normal(size=(2, 3, 200, 64)).astype(np.float32) for _ in range(3))
        fm = la.FeatureMap(64, 266, seed=0)
        want = la.linear_attention(*(x.astype(np.float64) for x in (q, k, v)), fm, causal=True,
                                   backend="array_api")  # fmt: skip
        got = la.linear_attention(*(torch.tensor(x, device="cuda") for x in (q, k, v)), fm,
                                  causal=True, backend="numba")  # fmt: skip
        err = relative_error(got.cpu().numpy(), want)
        res.emit("linear_attention(backend='numba') float32 vs host float64", err <= 1e-5,
                 value=err, limit=1e-5)  # fmt: skip


def long_check(res: Results, opts: argparse.Namespace) -> None:
    """The float32 kernel at L = 16384 against float64 on the host, per head."""
    import numpy as np

    import linattn as la
    from linattn_numba import gpu

    heads, length, d, m, chunk = (2, 40, 4, 6, 16) if opts.tiny else (4, 16384, 64, 256, 64)
    lib = Library(libraries(opts.simulator)[-1])
    lib.poison()
    rng = np.random.default_rng(7)
    q, k, v = (rng.normal(size=(heads, length, d)) for _ in range(3))
    fm = la.FeatureMap(d, m, seed=0)
    lq = np.asarray(fm.signed_log_features(q)[0], dtype=np.float32)
    lk = np.asarray(fm.signed_log_features(k)[0], dtype=np.float32)
    va = np.concatenate([v, np.ones((heads, length, 1))], -1).astype(np.float32)
    kv = np.zeros((heads, m, d + 1), np.float32)
    mu = np.full((heads, m), -np.inf, np.float32)
    args = (lq, lk, va, kv, mu)
    shape = {"lib": lib.name, "H": heads, "L": length, "d": d, "m": m, "C": chunk}
    with res.guard(f"long L={length}"):
        out64 = host_reference(args, chunk)[0]
        o64 = out64[..., :-1] / out64[..., -1:]
    for design in gpu.DESIGNS:
        with res.guard(f"{PREFIX[design]}long L={length}"):
            started = time.perf_counter()
            runs = [
                lib.host(gpu.forward(lib.name, *map(lib.to, args), chunk, design, False)[0])
                for _ in range(2)
            ]
            device_s = time.perf_counter() - started
            res.emit(f"{PREFIX[design]}long run twice bit-identical",
                     bool(np.array_equal(*runs, equal_nan=True)), **shape)  # fmt: skip
            o32 = runs[0][..., :-1] / runs[0][..., -1:]
            per_head = [relative_error(o32[h], o64[h]) for h in range(heads)]
            res.emit(
                f"{PREFIX[design]}long float32 vs host float64, worst head",
                max(per_head) <= 1e-5, value=max(per_head), limit=1e-5,
                detail=f"per head {per_head}; {device_s:.1f} s", **shape,
            )  # fmt: skip


class Breakdown:
    """Per-kernel device time of the launches inside the ``with`` (CUDA events on a GPU)."""

    def __init__(self, simulator: bool) -> None:
        self.events = not simulator
        self.totals: dict[str, float] = {}
        self.pending: list[tuple[str, Any, Any]] = []

    def __enter__(self) -> Breakdown:
        from linattn_numba.gpu import blas as _gpu_blas
        from linattn_numba.gpu import host
        from linattn_numba.gpu import target as _cuda

        self.original = original = host._Launcher.__call__
        cuda = _cuda.cuda

        def record(stream: Any, name: str, call: Callable[[], Any]) -> Any:
            if self.events:
                start, end = cuda.event(), cuda.event()
                start.record(stream)
                result = call()
                end.record(stream)
                self.pending.append((name, start, end))
                return result
            started = time.perf_counter()
            result = call()
            self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - started
            return result

        def timed(launcher: Any, name: str, *args: Any) -> None:
            self.stream = launcher.stream  # (the matmuls run on it too)
            record(launcher.stream, name, lambda: original(launcher, name, *args))

        def timed_matmul(matmul: Callable[..., Any]) -> Callable[..., Any]:
            def product(a: Any, b: Any, ta: bool, tb: bool) -> Any:
                sa, sb = tuple(a.shape), tuple(b.shape)  # (the simulator's shapes: no [-1])
                rows, inner = (sa[-1], sa[-2]) if ta else (sa[-2], sa[-1])
                cols = sb[-2] if tb else sb[-1]
                label = f"matmul ({rows} x {inner})({inner} x {cols})"
                return record(self.stream, label, lambda: matmul(a, b, ta, tb))

            return product

        self.matmuls = dict(_gpu_blas.MATMULS)
        for library, matmul in self.matmuls.items():
            _gpu_blas.MATMULS[library] = timed_matmul(matmul)
        host._Launcher.__call__ = timed  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        from linattn_numba.gpu import blas as _gpu_blas
        from linattn_numba.gpu import host
        from linattn_numba.gpu import target as _cuda

        host._Launcher.__call__ = self.original  # type: ignore[method-assign]
        _gpu_blas.MATMULS.update(self.matmuls)
        for name, start, end in self.pending:
            end.synchronize()
            seconds = _cuda.cuda.event_elapsed_time(start, end) / 1e3
            self.totals[name] = self.totals.get(name, 0.0) + seconds


def median_time(fn: Callable[[], Any], sync: Callable[[], None], repeats: int) -> float:
    """Median wall seconds of ``fn`` (synchronised) after one warm-up call."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def timing(res: Results, opts: argparse.Namespace) -> None:
    import linattn as la

    deadline = time.perf_counter() + opts.section_budget - 10
    names = libraries(opts.simulator)
    name = "torch" if "torch" in names else names[-1]
    lib = Library(name)
    heads, d, m, chunk = (1, 4, 5, 4) if opts.tiny else (8, 64, 256, 64)
    lengths = [8, 16] if opts.tiny else [4096, 16384, 65536, 131072]
    repeats = 1 if opts.tiny else 5
    fm = la.FeatureMap(d, m, seed=0)
    if name == "torch":
        matmul_ceiling(res, heads, m, d, chunk, 16384)
    previous = None
    for length in lengths:
        if previous is not None:
            spent, last = previous
            if time.perf_counter() + 3 * spent * length / last > deadline:
                res.emit("skipped (time)", None, L=length)
                break
        started = time.perf_counter()
        shape = {"lib": name, "B": 1, "H": heads, "L": length, "d": d, "m": m, "C": chunk}
        with res.guard(f"timing L={length}"):
            time_length(res, lib, fm, shape, repeats, opts)
        previous = (time.perf_counter() - started, length)


def _device_inputs(lib: Library, shape: dict[str, Any], fm: Any) -> dict[str, Any]:
    import numpy as np

    heads, length, d, m = shape["H"], shape["L"], shape["d"], shape["m"]
    if lib.name == "torch":
        import torch

        q, k, v = (torch.randn(1, heads, length, d, device="cuda") for _ in range(3))
        with torch.no_grad():
            lq = fm.signed_log_features(q)[0].float().contiguous()
            lk = fm.signed_log_features(k)[0].float().contiguous()
        va = torch.cat([v, torch.ones_like(v[..., :1])], -1)
        kv = torch.zeros(1, heads, m, d + 1, device="cuda")
        mu = torch.full((1, heads, m), -math.inf, device="cuda")
        d_out = torch.randn_like(va)
    else:
        rng = np.random.default_rng(3)
        q, k, v = (
            lib.to(rng.normal(size=(1, heads, length, d)).astype(np.float32)) for _ in "qkv"
        )
        lq = fm.signed_log_features(q)[0]
        lk = fm.signed_log_features(k)[0]
        host_v = lib.host(v)
        va = lib.to(np.concatenate([host_v, np.ones_like(host_v[..., :1])], -1))
        kv = lib.to(np.zeros((1, heads, m, d + 1), np.float32))
        mu = lib.to(np.full((1, heads, m), -np.inf, np.float32))
        d_out = lib.to(rng.normal(size=(1, heads, length, d + 1)).astype(np.float32))
    return {"q": q, "k": k, "v": v, "lq": lq, "lk": lk, "va": va, "kv": kv, "mu": mu,
            "d_out": d_out}  # fmt: skip


def time_length(
    res: Results, lib: Library, fm: Any, shape: dict[str, Any], repeats: int, opts: Any
) -> None:
    """Every timing at one sequence length, each emitted as soon as measured."""
    import linattn as la
    from linattn_numba import gpu

    x = _device_inputs(lib, shape, fm)
    chunk, name = shape["C"], lib.name
    kernel_args = (x["lq"], x["lk"], x["va"], x["kv"], x["mu"])

    def forward(design: str = "kernels") -> Any:
        return gpu.forward(name, *kernel_args, chunk, design, False)

    def forward_backward(design: str = "kernels") -> Any:
        forward(design)  # (backward is the kernels' in both designs)
        return gpu.backward(name, *kernel_args, chunk, x["d_out"], None)

    measures: dict[str, Callable[[], Any]] = {
        "kernel forward": forward,
        "kernel forward+backward": forward_backward,
        "blas forward": lambda: forward("blas"),
        "blas forward+backward": lambda: forward_backward("blas"),
    }
    if name == "torch":
        measures.update(_torch_measures(x, fm, chunk))
    for label, fn in measures.items():
        with res.guard(f"{label} {shape}"):
            seconds = median_time(fn, lib.sync, repeats)
            res.emit(label, None, value=seconds, unit="s", **shape)
    with res.guard(f"per-kernel breakdown {shape}"):
        with Breakdown(opts.simulator) as split:
            forward_backward()
            lib.sync()
        for kernel, seconds in sorted(split.totals.items(), key=lambda kv: -kv[1]):
            res.emit(f"kernel {kernel} (fwd+bwd)", None, value=seconds, unit="s", **shape)
    with res.guard(f"blas per-kernel breakdown {shape}"):
        with Breakdown(opts.simulator) as split:
            forward("blas")
            lib.sync()
        for kernel, seconds in sorted(split.totals.items(), key=lambda kv: -kv[1]):
            res.emit(f"blas {kernel} (fwd)", None, value=seconds, unit="s", **shape)
    if name == "numpy" and opts.tiny:
        with res.guard("array-API path (numpy)"):
            q, k, v = (lib.host(x[n]) for n in "qkv")
            seconds = median_time(
                lambda: la.linear_attention(q, k, v, fm, causal=True, chunk_size=chunk,
                                            backend="array_api"),
                lambda: None, repeats,
            )  # fmt: skip
            res.emit("array-API path forward", None, value=seconds, unit="s", **shape)


def _torch_measures(x: dict[str, Any], fm: Any, chunk: int) -> dict[str, Callable[[], Any]]:
    """Feature map + kernel through torch autograd, and SDPA in bfloat16 and float32."""
    import torch
    import torch.nn.functional as F

    import linattn as la

    q, k, v = x["q"], x["k"], x["v"]
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    grad = torch.randn_like(v)

    def features_forward() -> Any:
        with torch.no_grad():
            return la.linear_attention(q, k, v, fm, causal=True, chunk_size=chunk,
                                       backend="numba")  # fmt: skip

    def features_forward_backward() -> Any:
        out = la.linear_attention(*leaves, fm, causal=True, chunk_size=chunk, backend="numba")
        out.backward(grad)

    def sdpa(dtype: Any, backward: bool) -> Callable[[], Any]:
        qs, ks, vs = (t.detach().to(dtype).requires_grad_(backward) for t in (q, k, v))
        g = grad.to(dtype)

        def run() -> Any:
            if backward:
                F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).backward(g)
                return None
            with torch.no_grad():
                return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)

        return run

    return {
        "features+kernel forward": features_forward,
        "features+kernel forward+backward": features_forward_backward,
        "sdpa bf16 forward": sdpa(torch.bfloat16, False),
        "sdpa bf16 forward+backward": sdpa(torch.bfloat16, True),
        "sdpa fp32 forward": sdpa(torch.float32, False),
        "sdpa fp32 forward+backward": sdpa(torch.float32, True),
    }


def matmul_ceiling(res: Results, heads: int, m: int, d: int, chunk: int, length: int) -> None:
    """What the vendor BLAS reaches: square products, and the chunk products' own shape."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 here
    sync = torch.cuda.synchronize
    for dtype, label in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        with res.guard(f"matmul square {label}"):
            a = torch.randn(8192, 8192, device="cuda", dtype=dtype)
            seconds = median_time(lambda a=a: a @ a, sync, 5)
            res.emit(f"matmul 8192^2 {label}", None, value=2 * 8192**3 / seconds / 1e12,
                     unit="TFLOP/s")  # fmt: skip
    with res.guard("matmul chunk-shaped fp32"):
        count = heads * (length // chunk)
        phi = torch.randn(count, m, chunk, device="cuda")
        va = torch.randn(count, chunk, d + 1, device="cuda")
        seconds = median_time(lambda: torch.bmm(phi, va), sync, 5)
        res.emit(
            "matmul (H*L/C) x (m x C)(C x d+1) fp32", None, value=seconds, unit="s",
            detail=f"{2 * count * m * chunk * (d + 1) / seconds / 1e12:.1f} TFLOP/s", L=length,
        )  # fmt: skip


def sanitizer(res: Results, opts: argparse.Namespace) -> None:
    if opts.simulator:
        res.emit("compute-sanitizer", None, detail="skipped: the simulator has no device code")
        return
    tool = shutil.which("compute-sanitizer") or next(
        (str(p) for p in Path(sys.prefix).glob("**/bin/compute-sanitizer")), None
    )
    if tool is None:
        res.emit("compute-sanitizer", None, detail="skipped: not found on PATH")
        return
    for check in ("memcheck", "racecheck"):
        command = [tool, "--tool", check, "--error-exitcode", "9", sys.executable, __file__,
                   "--section", "sanitized", "--out", str(opts.out)]  # fmt: skip
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=20,
                                  check=False)  # fmt: skip
            tail = (done.stdout + done.stderr)[-800:]
            res.emit(f"compute-sanitizer {check}", done.returncode == 0, detail=tail)
        except subprocess.TimeoutExpired:
            res.emit(f"compute-sanitizer {check}", None, detail="timed out (20 s)")


def sanitized(res: Results, opts: argparse.Namespace) -> None:
    """A small forward and backward for compute-sanitizer to watch."""
    import numpy as np

    from linattn_numba import gpu

    host = tuple(
        a.astype(np.float32) for a in random_inputs(np.random.default_rng(1), 2, 40, 20, 5)
    )
    gpu.forward("numpy", *host, 16)
    gpu.backward("numpy", *host, 16, np.ones_like(host[2]), None)


SECTIONS: dict[str, Callable[[Results, argparse.Namespace], None]] = {
    "preflight": preflight,
    "correctness": correctness,
    "long": long_check,
    "timing": timing,
    "sanitizer": sanitizer,
    "sanitized": sanitized,
}


# --------------------------------------------------------------------------------------
# The run: sections as processes, then the summary.


def run_sections(opts: argparse.Namespace) -> int:
    out = opts.out
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.jsonl"
    if results.exists():
        results.replace(out / "results.previous.jsonl")
    log = Results(out, "run")
    added = install_wheels(opts.wheels, opts.site, print) if opts.wheels else []
    log.emit("bootstrap", True, detail=f"installed {added or 'nothing'} into {opts.site}",
             library_dirs=library_dirs(opts.site))  # fmt: skip
    env = section_env(opts.site, opts.simulator)
    deadline = time.perf_counter() + opts.budget
    order = ["preflight", "correctness", "long", "timing"] + (
        ["sanitizer"] if opts.sanitizer else []
    )
    for name in order:
        remaining = deadline - time.perf_counter()
        limit = min(TIMEOUTS[name], remaining)
        if limit < 10:
            log.emit(f"section {name}", None, detail="skipped: the run's budget is spent")
            continue
        ok, seconds, detail = run_one(name, limit, opts, env)
        log.emit(f"section {name}", ok, value=seconds, limit=limit, detail=detail)
        if name == "preflight" and not ok:
            log.emit("remaining sections", None, detail="skipped: the preflight failed")
            break
    return summary(out)


def run_one(
    name: str, limit: float, opts: argparse.Namespace, env: dict[str, str]
) -> tuple[bool, float, str]:
    """One section in its own process (and process group, killed whole on timeout)."""
    command = [sys.executable, __file__, "--section", name, "--out", str(opts.out),
               "--section-budget", str(limit), "--site", str(opts.site)]  # fmt: skip
    command += ["--tiny"] * opts.tiny + ["--simulator"] * opts.simulator
    print(f"\n== {name} (timeout {limit:.0f} s)", flush=True)
    started = time.perf_counter()
    with (opts.out / f"{name}.log").open("w") as logfile:
        child = subprocess.Popen(command, env=env, stdout=logfile, stderr=subprocess.STDOUT,
                                 start_new_session=True)  # fmt: skip
        try:
            code = child.wait(timeout=limit)
            detail = f"exit {code}"
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, 9)
            child.wait()
            code, detail = -9, f"timed out after {limit:.0f} s (results so far are kept)"
    seconds = time.perf_counter() - started
    print((opts.out / f"{name}.log").read_text()[-6000:], end="", flush=True)
    return code == 0, seconds, detail


def summary(out: Path) -> int:
    """The table of every result, last; exit status 1 if any check failed."""
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    lines = [f"{'section':12} {'check':58} {'ok':4} {'value':>11} {'limit':>8}  detail"]
    for r in rows:
        ok = {True: "ok", False: "FAIL", None: ""}[r.get("ok")]
        value = r.get("value")
        value_s = f"{value:11.4g}" if isinstance(value, int | float) else f"{'':11}"
        limit = r.get("limit")
        limit_s = f"{limit:8.2g}" if isinstance(limit, int | float) else f"{'':8}"
        where = " ".join(f"{k}={r[k]}" for k in ("lib", "L") if k in r)
        detail = (where + " " + str(r.get("detail", ""))).strip()[:90]
        lines.append(
            f"{r['section']:12} {r['check'][:58]:58} {ok:4} {value_s} {limit_s}  {detail}"
        )
    lines += timing_table(rows)
    failed = sum(r.get("ok") is False for r in rows)
    lines.append(f"\n{failed} check(s) failed" if failed else "\nall checks passed")
    text = "\n".join(lines)
    (out / "summary.txt").write_text(text + "\n")
    print("\n== summary\n" + text, flush=True)
    return 1 if failed else 0


def timing_table(rows: list[dict[str, Any]]) -> list[str]:
    """Milliseconds by sequence length, and how the kernel compares with flash SDPA (bf16)."""
    timed = [r for r in rows if r["section"] == "timing" and r.get("unit") == "s" and "L" in r]
    columns = [
        c for c in ("kernel forward", "kernel forward+backward", "blas forward",
                    "blas forward+backward", "features+kernel forward",
                    "features+kernel forward+backward", "sdpa bf16 forward",
                    "sdpa bf16 forward+backward", "sdpa fp32 forward")
        if any(r["check"] == c for r in timed)
    ]  # fmt: skip
    if not columns:
        return []
    table = {(r["L"], r["check"]): r["value"] for r in timed}
    lines = ["\ntiming (ms)  " + " | ".join(columns)]
    for length in sorted({r["L"] for r in timed}):
        cells = [table.get((length, c)) for c in columns]
        text = " | ".join(f"{c * 1e3:.3f}" if c is not None else "-" for c in cells)
        sdpa, ours = (
            table.get((length, "sdpa bf16 forward")),
            table.get((length, "kernel forward")),
        )
        ratio = f"  sdpa-bf16/kernel forward {sdpa / ours:.2f}x" if sdpa and ours else ""
        blas = table.get((length, "blas forward"))
        ratio += f"  sdpa-bf16/blas forward {sdpa / blas:.2f}x" if sdpa and blas else ""
        lines.append(f"L={length:<8} {text}{ratio}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-check-out")))
    parser.add_argument("--wheels", type=Path, default=None, help="folder of wheels to install")
    parser.add_argument("--site", type=Path, default=Path("/tmp/linattn-gpu-check-site"))
    parser.add_argument("--simulator", action="store_true", help="NUMBA_ENABLE_CUDASIM=1")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (for the simulator)")
    parser.add_argument("--sanitizer", action="store_true", help="run compute-sanitizer")
    parser.add_argument("--budget", type=float, default=420.0, help="seconds for the run")
    parser.add_argument("--section", choices=sorted(SECTIONS), help=argparse.SUPPRESS)
    parser.add_argument("--section-budget", type=float, default=150.0, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    opts.out = opts.out.resolve()
    if opts.section is None:
        return run_sections(opts)
    ensure_section_env(opts.site, opts.simulator)
    res = Results(opts.out, opts.section)
    try:
        SECTIONS[opts.section](res, opts)
    except Exception as error:  # a section that cannot start still leaves its reason
        res.emit(f"{opts.section} aborted", False, detail=f"{type(error).__name__}: {error}")
    return 1 if res.failed else 0


if __name__ == "__main__":
    os.environ.setdefault("LINATTN_COMPILE", "foreground")  # (timed: kernels compile in the call)
    sys.exit(main())
