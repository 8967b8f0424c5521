"""Decoding against its goals (issue 15, item 3); ``pytest benchmarks/test_decode.py
--benchmark-only -p no:randomly``.

Workload: B = 1, H = 8, d = 64, m = 256 ("positive" features), float32, one thread
(Numba serial, BLAS and torch pinned to one thread).  Figures:

* per-call latency of one decode step, ``linear_attention(..., state=s,
  return_state=True)`` with ``L = 1`` (goal <= 160 us), of the fast path it takes
  (the plan's ``decode`` executor, ``linattn._decode.step``) and of the kernel alone
  (the compiled step, arrays
  ready);
* tokens per second decoding 4096 tokens after a 4096-token prefill, against torch
  SDPA with a growing KV cache (preallocated, a view of the first ``t`` positions per
  step), ratio in one run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import linattn as la
from linattn import _decode

kernel = pytest.importorskip("linattn_numba.cpu.decode")
torch = pytest.importorskip("torch")

PREFILL, STEPS = 4096, 4096
CALLS = 2000  # per timing of one step


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Numba runs decode steps serial; BLAS and torch get one thread too."""
    from threadpoolctl import threadpool_limits

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with threadpool_limits(1):
        yield
    torch.set_num_threads(threads)


def _per_call(fn: Callable[[], object]) -> Callable[[], None]:
    def run() -> None:
        for _ in range(CALLS):
            fn()

    return run


def _prefill(fm: la.FeatureMap, bench: Any) -> tuple[la.LinearAttentionState, tuple, tuple]:
    q, k, v = bench.workload(PREFILL)
    _, state = la.linear_attention(q, k, v, fm, causal=True, return_state=True)
    return state, (q, k, v), bench.workload(STEPS, seed=1)


def test_step_latency(benchmark: Any, feature_map: la.FeatureMap, bench: Any, one_thread: Any):
    """Goal: one L = 1 step through the front door <= 160 us on one thread."""
    state, _, new = _prefill(feature_map, bench)
    token = [x[..., :1, :].copy() for x in new]
    options = {"causal": True, "state": state, "return_state": True}
    fast = {"key_mask": None, "chunk_size": 64, "backend": None}
    n, m, dv = bench.heads, bench.features, bench.head_dim
    constants = _decode.map_constants(feature_map, np.dtype(np.float32))
    assert constants is not None
    flat = [x.reshape(n, 1, dv) for x in token]
    random_map = np.empty((n, 2, 0, 0), np.float32), np.empty((n, 2, 0), np.float32)
    ready = (*flat, np.ones((n, 1), bool), constants.projection, constants.consts, False,
             *random_map, state.kv.reshape(n, m, dv + 1), state.log_shift.reshape(n, m), 64,
             np.empty((n, m, dv + 1), np.float32), np.empty((n, m), np.float32),
             np.empty((n, 1, dv), np.float32))  # fmt: skip
    serial = kernel._decode.dispatchers["serial"]
    before = kernel._decode.launches["serial"]
    la.linear_attention(*token, feature_map, **options)
    hooked = kernel._decode.launches["serial"] > before  # does the front door take it yet?
    times = bench.best_times(
        {
            "linear_attention": _per_call(lambda: la.linear_attention(*token, feature_map,
                                                                      **options)),
            "decode executor": _per_call(
                lambda: decode_executor(*token, feature_map, **options, **fast)
            ),
            "kernel alone": _per_call(lambda: serial(*ready)),
        },
        repeat=5,
    )  # fmt: skip
    bench.record(benchmark, "front door takes the decoding fast path", float(hooked))
    for name, seconds in times.items():
        bench.record(benchmark, f"L=1 step, {name}", 1e6 * seconds / CALLS, "us")
    bench.record(
        benchmark,
        "L=1 step: linear_attention / fast path",
        times["linear_attention"] / times["decode executor"],
    )
    benchmark.pedantic(lambda: serial(*ready), rounds=3, iterations=100)


def decode_executor(
    q, k, v, fm, *, state, key_mask=None, chunk_size=None, return_state=False, **_: Any
) -> Any:
    """The plan's ``decode`` executor alone (``linattn._decode.step``), no planning."""
    out, after = _decode.step(q, k, v, fm, key_mask, state, chunk_size)
    return (out, after) if return_state else out


def _linattn_decoder(
    fm: la.FeatureMap, state: Any, new: tuple, *, fast: bool
) -> Callable[[], None]:
    """Token by token through the front door, or through the fast path directly."""
    steps = [[x[..., t : t + 1, :] for x in new] for t in range(STEPS)]
    options = {"causal": True, "return_state": True}
    if fast:
        options |= {"key_mask": None, "chunk_size": 64, "backend": None}
    attend = decode_executor if fast else la.linear_attention

    def run() -> None:
        s = state
        for q, k, v in steps:
            _, s = attend(q, k, v, fm, state=s, **options)

    return run


def _sdpa_decoder(prefix: tuple, new: tuple) -> Callable[[], None]:
    """Exact attention with a KV cache: the prefix's keys and values, one more per step."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    _, k, v = (torch.from_numpy(x) for x in prefix)
    nq, nk, nv = (torch.from_numpy(x) for x in new)
    shape = (*k.shape[:-2], PREFILL + STEPS, k.shape[-1])
    cache_k, cache_v = torch.empty(shape), torch.empty(shape)
    cache_k[..., :PREFILL, :], cache_v[..., :PREFILL, :] = k, v

    def run() -> None:
        with torch.inference_mode():
            for t in range(STEPS):
                end = PREFILL + t + 1
                cache_k[..., end - 1, :] = nk[..., t, :]
                cache_v[..., end - 1, :] = nv[..., t, :]
                sdpa(nq[..., t : t + 1, :], cache_k[..., :end, :], cache_v[..., :end, :])

    return run


def test_decode_tokens_per_second(
    benchmark: Any, feature_map: la.FeatureMap, bench: Any, one_thread: Any
) -> None:
    """4096 tokens after a 4096-token prefill, one thread: linattn against SDPA + KV cache."""
    state, prefix, new = _prefill(feature_map, bench)
    functions = {
        "linattn front door": _linattn_decoder(feature_map, state, new, fast=False),
        "linattn fast path": _linattn_decoder(feature_map, state, new, fast=True),
        "torch SDPA, KV cache": _sdpa_decoder(prefix, new),
    }
    times = bench.best_times(functions, repeat=1)  # (SDPA: 10-20 s per run here)
    for name, seconds in times.items():
        bench.record(benchmark, f"decode {STEPS} after {PREFILL}: {name}", STEPS / seconds,
                     "tokens/s")  # fmt: skip
    for name in ("linattn front door", "linattn fast path"):
        bench.record(
            benchmark,
            f"decode tokens/s: {name} / torch SDPA",
            times["torch SDPA, KV cache"] / times[name],
        )
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
