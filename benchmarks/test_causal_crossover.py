"""Where causal linear attention overtakes exact attention (issue 15, item 4); ``pytest
benchmarks/test_causal_crossover.py --benchmark-only -p no:randomly``.

The fused causal pass (``linattn_numba.cpu.favor_causal``, chunk 64, features
included) against torch SDPA (exact, ``is_causal=True``) for L = 256 ... 4096 at
B = 1, H = 8, d = 64, float32, all cores, at m = 64, 128 and 256 features, with the
float32 matrix-multiply rate of the same run and each pass's FLOP rate, counted as
``docs/performance.md`` does (``causal_flops`` in ``test_cpu_kernels.py``, here per m).

Why the crossover moves with m: per token the pass does about ``m (4 d + 2 C + 4 (d_v +
1)) + 2 C (d_v + 1)`` FLOPs (``C`` the chunk), exact causal attention about ``2 d L``;
at equal rates it wins from ``L ~ (644 m + 8320) / 128`` (d = d_v = 64, C = 64), that
is L = 1024 at m = 190, and each factor of rate SDPA has over the pass's small products
moves that length up by the same factor.

At m = 256 it also times ``linattn.linear_attention(q, k, v, fm, causal=True)`` as users
call it: the front door's checks and the kernels' own chunk (``chunk_size=None``: 32).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import linattn as la

numba_cpu = pytest.importorskip("linattn_numba.cpu")
torch = pytest.importorskip("torch")

LENGTHS = (256, 512, 1024, 2048, 4096)
FEATURE_COUNTS = (64, 128, 256)
CHUNK = 64


def causal_flops(length: int, heads: int, head_dim: int, m: int) -> float:
    """FLOPs of the fused pass as ``docs/performance.md`` counts them: features (2 x 2 d
    m), intra-chunk (2 C m + 2 C (d_v + 1)), state readout and update (2 x 2 m (d_v + 1))
    per token and head."""
    width = head_dim + 1
    per_token = 4 * head_dim * m + 2 * CHUNK * m + 2 * CHUNK * width + 4 * m * width
    return float(heads * length * per_token)


def sdpa_flops(length: int, heads: int, head_dim: int) -> float:
    """Exact causal attention: ``Q K^T`` and ``P V`` on the lower triangle, 2 d L^2 per head."""
    return float(heads * 2 * head_dim * length * length)


def _fused(q: np.ndarray, k: np.ndarray, v: np.ndarray, fm: la.FeatureMap) -> np.ndarray:
    m, dv = fm.num_features, v.shape[-1]
    out, _, _ = numba_cpu.favor_causal(
        q, k, v, fm.projection, hyperbolic=False, scale=fm.scale, key_mask=None,
        kv=np.zeros((m, dv + 1), q.dtype), log_shift=np.full(m, -np.inf, q.dtype),
        chunk_size=CHUNK,
    )  # fmt: skip
    return out


def test_crossover(benchmark: Any, bench: Any) -> None:
    """Time ratio SDPA / fused per L and m (above 1: linear attention is faster)."""
    heads, d = bench.heads, bench.head_dim
    maps = {m: la.FeatureMap(d, m, seed=0) for m in FEATURE_COUNTS}
    a = np.random.default_rng(1).normal(size=(2048, 2048)).astype(np.float32)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    functions: dict[str, Any] = {"sgemm": lambda: a @ a}
    for length in LENGTHS:
        q, k, v = bench.workload(length)
        tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
        functions[f"sdpa {length}"] = lambda tq=tq, tk=tk, tv=tv: sdpa(tq, tk, tv, is_causal=True)
        for m, fm in maps.items():
            functions[f"fused {length} {m}"] = lambda q=q, k=k, v=v, fm=fm: _fused(q, k, v, fm)
        functions[f"default {length}"] = lambda q=q, k=k, v=v: la.linear_attention(
            q, k, v, maps[256], causal=True
        )
    times = bench.best_times(functions, repeat=3)
    matmul = 2 * 2048**3 / times["sgemm"]
    bench.record(benchmark, "float32 matmul rate (2048^3, all cores)", matmul / 1e9, "GFLOP/s")
    for length in LENGTHS:
        exact = times[f"sdpa {length}"]
        rate = sdpa_flops(length, heads, d) / exact
        bench.record(benchmark, f"L={length} SDPA rate / matmul rate", rate / matmul)
        for m in FEATURE_COUNTS:
            seconds = times[f"fused {length} {m}"]
            fused_rate = causal_flops(length, heads, d, m) / seconds
            bench.record(benchmark, f"L={length} m={m} fused time", 1e3 * seconds, "ms")
            bench.record(benchmark, f"L={length} m={m} fused rate / matmul", fused_rate / matmul)
            bench.record(benchmark, f"L={length} m={m} SDPA time / fused time", exact / seconds)
        default = times[f"default {length}"]
        bench.record(
            benchmark, f"L={length} m=256 SDPA time / linear_attention time", exact / default
        )
        bench.record(benchmark, f"L={length} SDPA time", 1e3 * exact, "ms")
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
