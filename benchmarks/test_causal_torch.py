"""torch CPU tensors on the fused causal pass against NumPy's (issue 15, item 2); run
``pytest benchmarks/test_causal_torch.py --benchmark-only``.

Workload: B=1, H=8, d=64, m=256 ("positive" features), float32, L=16384, causal.
Paths, forward (``la.linear_attention``):

* ``numpy fused``: NumPy arrays, the fused pass (``linattn_numba.cpu.favor_causal``);
* ``torch fused``: torch CPU tensors (NumPy views of the same memory), the same kernel
  through ``linattn::causal_fused_forward``;
* ``torch old``: the route torch tensors took before (features in torch, then
  ``linattn::causal_forward`` on ``L x m`` log-features), forced by making
  ``linattn._dispatch.scan.fused_pass`` answer False.

Forward and backward: ``torch fused`` and ``torch old`` are the forward plus
``torch.autograd.grad`` of ``sum(g * out)`` for ``q``, ``k``, ``v``; ``numpy fused`` is
``linattn_numba.cpu.fused_causal.forward`` then
``linattn_numba.cpu.fused_causal_backward.backward`` (the same two kernels without torch);
``numpy vjp`` is ``la.linear_attention_vjp`` (gradients only: the fused passes now) and
``numpy vjp old`` the same forced onto its former route (log-features, then the unfused
kernels on ``L x m`` arrays).  Goal: torch within 10 % of NumPy, time and peak
memory.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest

pytest.importorskip("linattn_numba.cpu.fused_causal")
torch = pytest.importorskip("torch")

LENGTH = 16384

#: The paths, shared by the timing and the memory probe (which runs them in a fresh
#: process): ``make(q, k, v, g)`` with NumPy inputs returns a function of no arguments.
PATHS = textwrap.dedent(
    """
    from unittest import mock

    import numpy as np
    import torch

    import linattn as la
    from linattn import _dispatch
    from linattn_numba.cpu import fused_causal, fused_causal_backward

    FM = la.FeatureMap(64, 256, seed=0)


    def old_route():
        return mock.patch.object(_dispatch.scan, "fused_pass", lambda x, feature_map: False)


    def torch_forward(q, k, v):
        return la.linear_attention(q, k, v, FM, causal=True)


    def torch_backward(q, k, v, g):
        x = [t.requires_grad_() for t in (q, k, v)]
        out = torch_forward(*x)
        return (out.detach(), *torch.autograd.grad(out, x, g))


    def numpy_backward(q, k, v, g):
        state = np.zeros((1, 8, 256, 65), np.float32), np.full((1, 8, 256), -np.inf, np.float32)
        options = dict(hyperbolic=False, scale=FM.scale, chunk_size=64)
        out, *_ = fused_causal.forward(q, k, v, FM.projection, *state, **options)
        grads = fused_causal_backward.backward(q, k, v, FM.projection, *state, out, g, **options)
        return (out, *grads)


    def old_numpy(q, k, v, g):
        with old_route():
            return la.linear_attention_vjp(q, k, v, FM, g, causal=True)


    def old_torch(function):
        def run(*args):
            with old_route():
                return function(*args)
        return run


    def make(name, q, k, v, g):
        t = [torch.from_numpy(x) for x in (q, k, v, g)]  # (views: no copies)
        return {
            "forward numpy fused": lambda: la.linear_attention(q, k, v, FM, causal=True),
            "forward torch fused": lambda: torch_forward(*t[:3]),
            "forward torch old": lambda: old_torch(torch_forward)(*t[:3]),
            "backward numpy fused": lambda: numpy_backward(q, k, v, g),
            "backward numpy vjp": lambda: la.linear_attention_vjp(q, k, v, FM, g, causal=True),
            "backward numpy vjp old": lambda: old_numpy(q, k, v, g),
            "backward torch fused": lambda: torch_backward(*(x.detach() for x in t)),
            "backward torch old": lambda: old_torch(torch_backward)(*(x.detach() for x in t)),
        }[name]
    """
)

NAMES = [
    "forward numpy fused",
    "forward torch fused",
    "forward torch old",
    "backward numpy fused",
    "backward numpy vjp",
    "backward numpy vjp old",
    "backward torch fused",
    "backward torch old",
]


def _paths() -> dict[str, Any]:
    namespace: dict[str, Any] = {}
    exec(compile(PATHS, "<paths>", "exec"), namespace)
    return namespace


def inputs(bench: Any) -> tuple[np.ndarray, ...]:
    q, k, v = bench.workload(LENGTH)
    g = np.random.default_rng(1).normal(size=v.shape).astype(np.float32)
    return q, k, v, g


@pytest.mark.parametrize("stage", ["forward", "backward"])
def test_time(benchmark: Any, stage: str, bench: Any) -> None:
    """Goal: ``torch fused`` within 10 % of ``numpy fused``; faster than ``torch old``."""
    make = _paths()["make"]
    arrays = inputs(bench)
    names = [name for name in NAMES if name.startswith(stage)]
    functions = {name: make(name, *arrays) for name in names}
    times = bench.best_times(functions, repeat=5)
    for name in names:
        bench.record(benchmark, f"L={LENGTH} {name} time", 1e3 * times[name], "ms")
    fused = times[f"{stage} numpy fused"]
    bench.record(benchmark, f"L={LENGTH} {stage} torch fused / numpy fused time",
                 times[f"{stage} torch fused"] / fused)  # fmt: skip
    bench.record(benchmark, f"L={LENGTH} {stage} torch old / torch fused time",
                 times[f"{stage} torch old"] / times[f"{stage} torch fused"])  # fmt: skip
    if stage == "backward":
        bench.record(benchmark, f"L={LENGTH} backward numpy vjp old / numpy vjp time",
                     times["backward numpy vjp old"] / times["backward numpy vjp"])  # fmt: skip
    benchmark.pedantic(functions[f"{stage} torch fused"], rounds=1, iterations=1)


MEMORY_PROBE = textwrap.dedent(
    """
    import gc, json, sys
    import numpy as np

    def rss(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024

    name, length = sys.argv[1], int(sys.argv[2])
    rng = np.random.default_rng(0)
    q, k, v, g = (rng.normal(size=(1, 8, length, 64)).astype(np.float32) for _ in range(4))
    make(name, *(x[..., :512, :].copy() for x in (q, k, v, g)))()  # compile, thread pools
    run = make(name, q, k, v, g)
    gc.collect()
    before = rss("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS
    results = run()
    peak = rss("VmHWM:")
    results = results if isinstance(results, tuple) else (results,)
    print(json.dumps({"before": before, "peak": peak, "inputs": 4 * q.nbytes,
                      "outputs": sum(int(np.prod(r.shape)) * 4 for r in results)}))
    """
)


@pytest.mark.parametrize("name", NAMES)
def test_peak_memory(benchmark: Any, name: str, bench: Any) -> None:
    """Peak RSS above inputs (``q``, ``k``, ``v`` and the cotangent ``g``) and outputs (the
    outputs, and the gradients for the backward) of one call in a fresh process: ``VmHWM``
    reset through ``/proc/self/clear_refs``, minus the resident size before the call
    (inputs included) and the outputs, as ``benchmarks/test_bidirectional.py`` measures.
    Goal: ``torch fused`` within 10 % of ``numpy fused``."""
    result = subprocess.run(
        [sys.executable, "-c", PATHS + MEMORY_PROBE, name, str(LENGTH)],
        check=True,
        capture_output=True,
        text=True,
    )
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    extra = figures["peak"] - figures["before"] - figures["outputs"]
    bench.record(benchmark, f"L={LENGTH} {name} peak RSS above inputs+outputs", extra / 2**20,
                 "MiB")  # fmt: skip
    bench.record(benchmark, f"L={LENGTH} {name} (peak above) / inputs", extra / figures["inputs"])
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
