"""linattn against its peers on one machine, in one run (issue 15, item 1).

Not a test: nothing collects it.  Set up the benchmark venv first (see ``README.md``)::

    bash benchmarks/peers/setup.sh /tmp/peers-venv PATH/TO/fast_attention.py
    /tmp/peers-venv/bin/python benchmarks/peers/run.py --out /tmp/peers

Workload: B=1, H=8, d=64, m=256 random features, float32, causal and bidirectional,
L = 1024, 4096, 16384 (``--lengths``); the same q, k, v (seed 0) for everyone, each in
its library's own layout, converted before timing.  Each implementation runs in a
process of its own, started once per (L, direction) and warmed up there (JAX's jit
compile and Numba's compile excluded); then the coordinator asks the processes in
turn, round after round (the order rotating), for one timed call each, so that the
machine's load falls on all alike.  Before each timed call a process sleeps
:data:`SETTLE` seconds (other processes' thread pools stop spinning) and makes one
untimed call (its own caches and threads warm), as ``benchmarks/conftest.py`` does.

Time: the median over the rounds of the timed calls' wall time (the minimum is kept
too).  Memory: the peak resident set (``VmHWM``, reset through
``/proc/self/clear_refs`` just before the timed call) minus the resident set just before
it (inputs resident, the previous output freed, after ``gc.collect()`` and glibc's
``malloc_trim(0)``), the largest over the rounds: the call's working memory, its output
included.  An implementation whose warm-up or timed call runs past ``--limit`` seconds
(default 120) is stopped and reported as skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import gc
import hashlib
import importlib.util
import json
import math
import os
import platform
import select
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
HEADS, HEAD_DIM, FEATURES = 8, 64, 256
SETTLE = 0.25
#: Seconds: a call at least this long is timed without an untimed call before it.
LONG_CALL = 5.0
MARK = "@@peers "

#: google-research's performer/fast_attention/jax/fast_attention.py, as benchmarked
#: (the repository's commit 8de59738d37133bc2537b62831674d3929da3c5b).
GOOGLE_FILE = HERE / "_vendor" / "fast_attention.py"
GOOGLE_SHA256 = "b1489c046864050f3165ddb8addb38a222364eae2f65f909458de236010c4261"

IMPLEMENTATIONS = [
    "linattn",
    "linattn-torch",
    "google-jax",
    "fast-transformers",
    "performer-pytorch",
    "performer-pytorch+ft-kernel",  # causal only (bidirectional: the same as the above)
    "numpy-naive",
]


# -- the workload ----------------------------------------------------------------------


def workload(length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q, k, v of shape (1, H, L, d), float32: the same for every implementation."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(1, HEADS, length, HEAD_DIM)).astype(np.float32) for _ in range(3))
    return q, k, v


def exact(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool) -> np.ndarray:
    """Softmax attention with scale d^-1/2 (float64): the reference for the error check."""
    s = np.einsum("bhid,bhjd->bhij", q.astype(np.float64), k.astype(np.float64))
    s /= math.sqrt(q.shape[-1])
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    s -= s.max(-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(-1, keepdims=True)
    return p @ v.astype(np.float64)


# -- the implementations: each returns (call, to_bhld) -----------------------------------
# ``call()`` computes attention on inputs already in its library's layout and returns once
# the result is ready; ``to_bhld(result)`` gives it back as a (1, H, L, d) NumPy array.


def make_linattn(q, k, v, causal):
    import linattn as la

    fm = la.FeatureMap(HEAD_DIM, FEATURES, seed=0)  # kind "positive" (FAVOR+), orthogonal
    plan = la.plan_attention(q, k, v, fm, causal=True).scan if causal else None
    info = {"plan": None if plan is None else f"{plan.path} fused={plan.fused}"}
    return (lambda: la.linear_attention(q, k, v, fm, causal=causal)), np.asarray, info


def make_linattn_torch(q, k, v, causal):
    import torch

    import linattn as la

    fm = la.FeatureMap(HEAD_DIM, FEATURES, seed=0)
    tq, tk, tv = (torch.from_numpy(x.copy()) for x in (q, k, v))
    if causal:
        plan = la.plan_attention(tq, tk, tv, fm, causal=True).scan
        path = f"{plan.path} fused={plan.fused}"
    else:
        path = f"fused={la.plan_attention(tq, tk, tv, fm).executor == 'fused-bidirectional'}"

    def call():
        with torch.inference_mode():
            return la.linear_attention(tq, tk, tv, fm, causal=causal)

    info = {"plan": path, "torch_threads": torch.get_num_threads()}
    return call, (lambda out: out.numpy()), info


@functools.cache  # (once a process: gin refuses to register its configurables twice)
def load_google(path: Path) -> Any:
    """google-research's fast_attention.py, imported from ``path`` unchanged.

    It runs under jax 0.10 and gin-config 0.5 as it is: no import or API rename was
    needed (checked 2026-12-01); a file whose SHA-256 differs from the one benchmarked
    is still used, with a warning in the results.
    """
    spec = importlib.util.spec_from_file_location("google_fast_attention", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_google(q, k, v, causal):
    import jax
    import jax.numpy as jnp

    path = Path(os.environ.get("PEERS_GOOGLE_FILE", GOOGLE_FILE))
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    fa = load_google(path)
    # Fixed features (redraw_features=False) like every other implementation here; the
    # rest are the defaults: orthogonal features, stabiliser 1e-6, renormalised, scan
    # unroll 1.  Layout: [batch, length, heads, channels] (attention over axis 1).
    attention = fa.make_fast_softmax_attention(
        HEAD_DIM, nb_features=FEATURES, redraw_features=False, unidirectional=causal
    )
    fn = jax.jit(attention)
    jq, jk, jv = (jnp.asarray(np.ascontiguousarray(x.transpose(0, 2, 1, 3))) for x in (q, k, v))
    info = {
        "jax": jax.__version__,
        "devices": str(jax.devices()),
        "sha256_matches": digest == GOOGLE_SHA256,
    }
    return (
        (lambda: fn(jq, jk, jv).block_until_ready()),
        (lambda out: np.asarray(out).transpose(0, 2, 1, 3)),
        info,
    )


def make_fast_transformers(q, k, v, causal):
    import torch
    from fast_transformers.attention import CausalLinearAttention, LinearAttention
    from fast_transformers.feature_maps import Favor
    from fast_transformers.masking import FullMask, LengthMask, TriangularCausalMask

    length = q.shape[2]
    # Favor(n_dims=256): 256 features, the antithetic pairs exp(+-w^T x) of 128 orthogonal
    # projections (fast-transformers' only FAVOR+ form); no stabiliser (its default).
    features = Favor.factory(n_dims=FEATURES)
    tq, tk, tv = (
        torch.from_numpy(np.ascontiguousarray(x.transpose(0, 2, 1, 3))) for x in (q, k, v)
    )
    if causal:
        layer = CausalLinearAttention(HEAD_DIM, feature_map=features)
        mask = TriangularCausalMask(length)
    else:
        layer = LinearAttention(HEAD_DIM, feature_map=features)
        mask = FullMask(length)
    lengths = LengthMask(torch.full((1,), length, dtype=torch.int64), max_len=length)

    def call():
        with torch.inference_mode():
            return layer(tq, tk, tv, mask, lengths, lengths)

    import fast_transformers

    info = {
        "version": getattr(fast_transformers, "__version__", "?"),
        "torch_threads": torch.get_num_threads(),
    }
    return call, (lambda out: out.numpy().transpose(0, 2, 1, 3)), info


def make_performer_pytorch(q, k, v, causal, kernel=False):
    import torch
    from performer_pytorch import FastAttention, performer_pytorch

    torch.manual_seed(0)
    # Defaults otherwise: softmax kernel (positive features, eps 1e-4), orthogonal, no
    # redraw inside forward.  Causal: FastAttention takes fast-transformers' kernel only
    # when its *CUDA* extension imports; on a CPU build it falls back to its chunked
    # pure-torch version (`causal_linear_attention_noncuda`, "memory inefficient").
    # ``kernel=True`` (performer-pytorch+ft-kernel) hands it fast-transformers' CPU
    # kernel instead (`causal_linear_attention`, CausalDotProduct).
    layer = FastAttention(dim_heads=HEAD_DIM, nb_features=FEATURES, causal=causal)
    if kernel:
        layer.causal_linear_fn = performer_pytorch.causal_linear_attention
    tq, tk, tv = (torch.from_numpy(x.copy()) for x in (q, k, v))

    def call():
        with torch.inference_mode():
            return layer(tq, tk, tv)

    info = {
        "torch_threads": torch.get_num_threads(),
        "causal_fn": getattr(getattr(layer, "causal_linear_fn", None), "__name__", None),
    }
    return call, (lambda out: out.numpy()), info


def naive_favor(q, k, v, w, causal, chunk=64):
    """FAVOR+ in plain NumPy, no stabiliser: phi(x) = exp(W x - |x|^2 / 2) / sqrt(m)."""
    m = w.shape[0]
    s = q.shape[-1] ** -0.25

    def phi(x):
        x = x * s
        return np.exp(x @ w.T - 0.5 * np.sum(x * x, -1, keepdims=True)) / np.sqrt(m)

    qf, kf = phi(q), phi(k)
    v1 = np.concatenate([v, np.ones_like(v[..., :1])], -1)  # [V | 1]: numerator, denominator
    if not causal:
        out = qf @ (kf.swapaxes(-1, -2) @ v1)
    else:  # chunk by chunk: the state of earlier chunks, then the masked chunk itself
        out = np.empty((*q.shape[:-1], v1.shape[-1]), q.dtype)
        state = np.zeros((*q.shape[:-2], m, v1.shape[-1]), q.dtype)
        for i in range(0, q.shape[-2], chunk):
            rows = slice(i, i + chunk)
            qc, kc, vc = qf[..., rows, :], kf[..., rows, :], v1[..., rows, :]
            scores = np.tril(qc @ kc.swapaxes(-1, -2))
            out[..., rows, :] = qc @ state + scores @ vc
            state += kc.swapaxes(-1, -2) @ vc
    return out[..., :-1] / out[..., -1:]


def make_numpy_naive(q, k, v, causal):
    import linattn as la

    w = np.asarray(la.FeatureMap(HEAD_DIM, FEATURES, seed=0).projection, np.float32)
    return (lambda: naive_favor(q, k, v, w, causal)), np.asarray, {}


MAKERS: dict[str, Callable[..., Any]] = {
    "linattn": make_linattn,
    "linattn-torch": make_linattn_torch,
    "google-jax": make_google,
    "fast-transformers": make_fast_transformers,
    "performer-pytorch": make_performer_pytorch,
    "performer-pytorch+ft-kernel": functools.partial(make_performer_pytorch, kernel=True),
    "numpy-naive": make_numpy_naive,
}


# -- the worker: one implementation at one (L, direction) --------------------------------


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _say(**message: Any) -> None:
    sys.stdout.write(MARK + json.dumps(message) + "\n")
    sys.stdout.flush()


def worker(name: str, length: int, causal: bool, check: bool) -> None:
    libc = ctypes.CDLL("libc.so.6")
    q, k, v = workload(length)
    start = time.perf_counter()
    call, to_bhld, info = MAKERS[name](q, k, v, causal)
    first = time.perf_counter()
    out = call()  # compile (JAX jit, Numba), thread pools, caches
    first = time.perf_counter() - first
    error = None
    if check:
        ref = exact(q, k, v, causal)
        got = to_bhld(out).astype(np.float64)
        error = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    del out
    call()
    _say(ready=True, setup_s=time.perf_counter() - start, first_call_s=first,
         rel_error=error, info=info)  # fmt: skip
    last = first
    for line in sys.stdin:
        if line.strip() != "run":
            break
        time.sleep(SETTLE)
        if last < LONG_CALL:
            call()  # untimed: this implementation's threads and caches warm
        gc.collect()
        libc.malloc_trim(0)
        before = _status("VmRSS:")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak (VmHWM) from here on
        t = time.perf_counter()
        out = call()
        t = time.perf_counter() - t
        peak = _status("VmHWM:")
        del out
        last = t
        _say(time_s=t, rss_before=before, peak=peak)


# -- the coordinator ---------------------------------------------------------------------


class Worker:
    def __init__(
        self, name: str, length: int, causal: bool, check: bool, threads: int | None
    ) -> None:
        self.name = name
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
        if threads:
            env.update(thread_environment(threads))
        args = [sys.executable, __file__, "--worker", name, "--length", str(length)]
        args += ["--causal"] * causal + ["--check"] * check
        self.process = subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=env,
        )  # fmt: skip
        self.stderr: list[str] = []

    def read(self, limit: float) -> dict[str, Any]:
        assert self.process.stdout is not None
        deadline = time.monotonic() + limit
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.name}: no answer within {limit:.0f} s")
            ready, _, _ = select.select([self.process.stdout], [], [], left)
            if not ready:
                continue
            line = self.process.stdout.readline()
            if not line:
                err = self.process.stderr.read() if self.process.stderr else ""
                raise RuntimeError(f"{self.name} exited: {err[-3000:]}")
            if line.startswith(MARK):
                return json.loads(line[len(MARK) :])

    def ask(self, limit: float) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write("run\n")
        self.process.stdin.flush()
        return self.read(limit)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            assert self.process.stdin is not None
            self.process.stdin.write("stop\n")
            self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def thread_environment(threads: int) -> dict[str, str]:
    """Every library's thread count: OpenMP (torch, fast-transformers), OpenBLAS and MKL
    (NumPy, SciPy's BLAS that linattn's kernels call), Numba, XLA (JAX)."""
    n = str(threads)
    env = dict.fromkeys(
        ["OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"], n
    )
    flags = f"--xla_cpu_multi_thread_eigen={'true' if threads > 1 else 'false'}"
    env["XLA_FLAGS"] = f"{flags} intra_op_parallelism_threads={n}"
    return env


def measure(
    names: list[str],
    length: int,
    causal: bool,
    rounds: int,
    limit: float,
    log: Any,
    threads: int | None = None,
) -> dict[str, Any]:
    if not causal:  # (without causal attention the variant is performer-pytorch itself)
        names = [name for name in names if name != "performer-pytorch+ft-kernel"]
    check = length <= 1024
    results: dict[str, Any] = {}
    workers: list[Worker] = []
    for name in names:
        w = Worker(name, length, causal, check, threads)
        try:
            results[name] = {"warmup": w.read(2 * limit + 60)}  # (imports, compile: twice)
            workers.append(w)
        except (TimeoutError, RuntimeError) as error:
            w.close()
            results[name] = {"skipped": str(error)}
        log(f"  {name}: {results[name]}")
    for r in range(rounds):
        order = workers[r % len(workers) :] + workers[: r % len(workers)] if workers else []
        for w in order:
            if "skipped" in results[w.name]:
                continue
            try:
                answer = w.ask(2 * limit + 2 * SETTLE)
            except (TimeoutError, RuntimeError) as error:
                results[w.name]["skipped"] = str(error)
                w.close()
                continue
            results[w.name].setdefault("calls", []).append(answer)
        log(f"  round {r + 1}/{rounds} done, load {os.getloadavg()[0]:.2f}")
    for w in workers:
        w.close()
    for entry in results.values():
        calls = entry.get("calls", [])
        if calls and "skipped" not in entry:
            times = [c["time_s"] for c in calls]
            entry["median_ms"] = 1e3 * statistics.median(times)
            entry["min_ms"] = 1e3 * min(times)
            entry["peak_growth_mib"] = max(c["peak"] - c["rss_before"] for c in calls) / 2**20
    return results


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)),
    }
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    versions = {}
    for module in ("numpy", "numba", "torch", "jax", "jaxlib", "linattn", "performer_pytorch"):
        with contextlib.suppress(Exception):
            versions[module] = __import__(module).__version__
    with contextlib.suppress(Exception):
        from importlib.metadata import version

        versions["pytorch-fast-transformers"] = version("pytorch-fast-transformers")
        versions["performer-pytorch"] = version("performer-pytorch")
    info["versions"] = versions
    return info


def table(data: dict[str, Any]) -> str:
    names = data["implementations"]
    lines = []
    for direction in data["results"]:  # the directions measured
        lines += [f"**{direction}** (median ms / peak MiB above inputs / time ÷ linattn's)", ""]
        header = "| implementation | " + " | ".join(f"L = {n}" for n in data["lengths"]) + " |"
        lines += [header, "|---|" + "---:|" * len(data["lengths"])]
        for name in names:
            cells = []
            for length in data["lengths"]:
                entry = data["results"][direction][str(length)].get(name, {})
                base = data["results"][direction][str(length)].get("linattn", {})
                if "median_ms" not in entry:
                    cells.append("skipped" if "skipped" in entry else "–")
                    continue
                ratio = entry["median_ms"] / base["median_ms"] if "median_ms" in base else math.nan
                time_ms, memory = entry["median_ms"], entry["peak_growth_mib"]
                cells.append(f"{time_ms:.1f} ms / {memory:.0f} MiB / {ratio:.2f}x")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    errors = []
    for direction in data["results"]:  # the directions measured
        for name in names:
            entry = data["results"][direction].get("1024", {}).get(name, {})
            error = entry.get("warmup", {}).get("rel_error")
            if error is not None:
                errors.append(f"{name} {direction} {error:.3f}")
    if errors:
        lines += ["Relative error against exact softmax attention at L = 1024 (one draw of "
                  "features each): " + "; ".join(errors) + ".", ""]  # fmt: skip
    load = data["load_average"]
    lines.append(
        f"Load average (1, 5, 15 min): {load['start']} at the start, {load['end']} at the end."
    )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker")
    parser.add_argument("--length", type=int)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--lengths", default="1024,4096,16384")
    parser.add_argument("--only", default=",".join(IMPLEMENTATIONS))
    parser.add_argument("--directions", default="bidirectional,causal")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--limit", type=float, default=120.0, help="seconds per call at most")
    parser.add_argument("--out", default="peers-results")
    parser.add_argument(
        "--threads", type=int, help="threads for every library (default: their own defaults)"
    )
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.length, args.causal, args.check)
        return

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = args.only.split(",")
    lengths = [int(x) for x in args.lengths.split(",")]

    def log(text: str) -> None:
        print(time.strftime("%H:%M:%S"), text, flush=True)

    data: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": " ".join([Path(sys.executable).as_posix(), *sys.argv]),
        "workload": {"batch": 1, "heads": HEADS, "head_dim": HEAD_DIM, "features": FEATURES},
        "rounds": args.rounds,
        "threads": args.threads or "library defaults",
        "machine": machine(),
        "implementations": names,
        "lengths": lengths,
        "load_average": {"start": " ".join(f"{x:.2f}" for x in os.getloadavg())},
        "results": {},
    }
    for direction in args.directions.split(","):
        data["results"][direction] = {}
        for length in lengths:
            log(f"{direction} L={length}")
            data["results"][direction][str(length)] = measure(
                names, length, direction == "causal", args.rounds, args.limit, log, args.threads
            )
            (out / "peers.json").write_text(json.dumps(data, indent=1))
    data["load_average"]["end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    (out / "peers.json").write_text(json.dumps(data, indent=1))
    (out / "peers.md").write_text(table(data))
    print(table(data))


if __name__ == "__main__":
    main()
