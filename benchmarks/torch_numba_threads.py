"""torch's intra-op threads beside Numba's inside a model: a MiniLM-shaped layer step (a
torch linear layer, then bidirectional window 64 + sinks attention on torch CPU tensors,
which runs the Numba kernels through ``linattn::exact_parts_forward``), best of 5.

    python benchmarks/torch_numba_threads.py TORCH_THREADS NUMBA_THREADS
"""

import sys
import time

import numba
import torch

import linattn as la

tt, nt = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(tt)
numba.set_num_threads(nt)
B, H, L, d = 8, 12, 256, 32
g = torch.Generator().manual_seed(0)
q, k, v = (
    torch.randn(B, L, H, d, generator=g).transpose(1, 2) for _ in range(3)
)  # transformers' layout
em = torch.zeros(B, 1, L, dtype=torch.bool)
em[..., 0] = em[..., -1] = True
fm = la.FeatureMap(d, 256, kind="hyperbolic", seed=0)
lin = torch.nn.Linear(384, 384)
x = torch.randn(B, L, 384)


def step(f, o):
    y = lin(x)  # torch work between attention calls, as in a model
    return la.linear_attention(q, k, v, f, **o)


for name, f, o in [
    ("window", None, dict(window=64, sink_keys=1, exact_key_mask=em)),
    ("hybrid", fm, dict(window=64, sink_keys=1)),
]:
    with torch.inference_mode():
        step(f, o)
        best = 1e9
        for _ in range(5):
            t = time.perf_counter()
            step(f, o)
            best = min(best, time.perf_counter() - t)
    print(f"torch threads {tt} numba threads {nt} {name}: {best * 1e3:.1f} ms")
