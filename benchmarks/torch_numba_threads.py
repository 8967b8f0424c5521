"""torch's intra-op threads beside Numba's inside a model: a MiniLM-shaped layer step (a
torch linear layer, then bidirectional window 64 + sinks attention on torch CPU tensors,
which runs the Numba kernels through ``linattn::exact_parts_forward``), best of 5.

    python benchmarks/torch_numba_threads.py TORCH_THREADS NUMBA_THREADS [BACKEND]

``BACKEND`` ``array_api`` times the portable path on the tensors (the path torch tensors
with exact parts took before the ``torch-kernels`` executor).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import numba
import torch

import linattn as la


def main(torch_threads: int, numba_threads: int, backend: str | None = None) -> None:
    torch.set_num_threads(torch_threads)
    numba.set_num_threads(numba_threads)
    batch, heads, length, d = 8, 12, 256, 32
    generator = torch.Generator().manual_seed(0)
    # transformers' layout: (B, H, L, d) views of (B, L, H, d) projections
    q, k, v = (
        torch.randn(batch, length, heads, d, generator=generator).transpose(1, 2) for _ in range(3)
    )
    exact = torch.zeros(batch, 1, length, dtype=torch.bool)
    exact[..., 0] = exact[..., -1] = True
    fm = la.FeatureMap(d, 256, kind="hyperbolic", seed=0)
    linear = torch.nn.Linear(heads * d, heads * d)
    x = torch.randn(batch, length, heads * d)

    def step(feature_map: Any, options: dict[str, Any]) -> Any:
        linear(x)  # torch's own work between attention calls, as in a model
        return la.linear_attention(q, k, v, feature_map, backend=backend, **options)

    calls = {
        "window": (None, {"window": 64, "sink_keys": 1, "exact_key_mask": exact}),
        "hybrid": (fm, {"window": 64, "sink_keys": 1}),
    }
    for name, (feature_map, options) in calls.items():
        with torch.inference_mode():
            step(feature_map, options)  # compiles (or loads) the kernels
            best = float("inf")
            for _ in range(5):
                start = time.perf_counter()
                step(feature_map, options)
                best = min(best, time.perf_counter() - start)
        print(
            f"torch threads {torch_threads} numba threads {numba_threads} {name} "
            f"({la.plan_attention(q, k, v, feature_map, backend=backend, **options).executor}): "
            f"{best * 1e3:.1f} ms"
        )


if __name__ == "__main__":
    os.environ.setdefault("LINATTN_COMPILE", "foreground")  # (timed: kernels compile in the call)
    main(int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:4])
