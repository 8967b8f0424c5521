"""The vendor-BLAS design of the GPU forward: chunk products as batched matmuls.

The same algorithm, stabilisers and contract as the numba-cuda kernels of
:mod:`linattn_numba.gpu.kernels` (``gpu.forward(..., design="blas")``), split
differently: the stabilisers (``chunk_max``, ``prefix_max``, ``row_stats``) and
every elementwise step are numba-cuda kernels, and the four products of each
chunk are one batched matrix product each, over ``(B, N)`` chunks, by the array
library of the inputs (CuPy ``cupy.matmul``, torch ``torch.matmul``: cuBLAS;
the ``"numpy"`` library, host arrays for the simulator and tests, round-trips
through ``numpy.matmul``).  With ``C`` the chunk size (at most ``L``), features
zero-padded to whole chunks ``(B, N, C, m)``:

1. ``chunk_features``: ``u``, ``psi``, ``phi`` and ``[V | 1]`` of every chunk,
   computed once (the kernels recompute them in every product);
2. ``scores = u psi^T`` (BLAS), then ``causal_select``: times
   ``exp(G_j - Gmax_t)`` for ``j <= t``, else 0 (selected, not multiplied);
3. ``intra = scores [V | 1]`` and the increments ``phi^T [V | 1]`` (BLAS);
4. ``scan_states`` (the existing kernel: one thread per state entry, a loop
   over chunks) turns the increments into the state before every chunk ``S_n``;
5. ``readout = u S_n`` (BLAS), and ``combine_readout``: ``intra + w readout``.

Scratch: the padded features (three arrays the size of a log-feature array),
``[V | 1]``, the scores ``(B, N, C, C)``, ``intra`` and ``readout`` ``(B, N, C,
D)`` and the states ``(B, N, m, D)``: about five log-feature arrays at C = 64.

float32 products are float32 unless TF32 is opted in (``tf32=True`` or
``LINATTN_CUDA_TF32=1``, read by :mod:`linattn_numba.gpu`): for torch that sets
``torch.backends.cuda.matmul.allow_tf32`` for the call and restores it; CuPy's
switch is its own ``CUPY_TF32=1`` environment variable, read when CuPy starts.
TF32 keeps 10 mantissa bits: it breaks the float32 tolerance of 1e-5.

Examples
--------
>>> from linattn_numba.gpu import blas
>>> sorted(blas.MATMULS)
['cupy', 'numpy', 'torch']
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from linattn_numba.gpu import target
from linattn_numba.gpu.kernels import TILE

__all__ = ["MATMULS", "forward", "tf32"]

PER_BLOCK = TILE * TILE


def _last_two(x: Any, library: str) -> Any:
    """``x`` with its last two axes swapped (a view: BLAS reads it transposed)."""
    return x.transpose(-1, -2) if library == "torch" else x.swapaxes(-1, -2)


def _numpy_matmul(a: Any, b: Any, ta: bool, tb: bool) -> Any:
    x, y = a.copy_to_host(), b.copy_to_host()
    x = _last_two(x, "numpy") if ta else x
    y = _last_two(y, "numpy") if tb else y
    return target.to_device(np.ascontiguousarray(np.matmul(x, y)))


def _cupy_matmul(a: Any, b: Any, ta: bool, tb: bool) -> Any:
    import cupy

    x = _last_two(a, "cupy") if ta else a
    y = _last_two(b, "cupy") if tb else b
    return cupy.ascontiguousarray(cupy.matmul(x, y))


def _torch_matmul(a: Any, b: Any, ta: bool, tb: bool) -> Any:
    import torch

    x = _last_two(a, "torch") if ta else a
    y = _last_two(b, "torch") if tb else b
    return torch.matmul(x, y).contiguous()


MATMULS: dict[str, Callable[[Any, Any, bool, bool], Any]] = {
    "numpy": _numpy_matmul,
    "cupy": _cupy_matmul,
    "torch": _torch_matmul,
}
"""Batched ``a @ b`` (``a``/``b`` transposed in their last two axes if asked), C-contiguous,
on the library's current stream (the one the kernels are launched on)."""


@contextlib.contextmanager
def tf32(library: str, allowed: bool) -> Iterator[None]:
    """TF32 products for the ``with`` body only if ``allowed`` (torch; see the module)."""
    if not allowed or library != "torch":
        yield
        return
    import torch

    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def forward(
    p: Any, launch: Any, arrays: tuple[Any, ...], stats: tuple[Any, ...], allow_tf32: bool
) -> None:
    """Write the outputs and ``kv_out``; ``arrays = (lq, lk, va, state, out, kv_out)``.

    ``p`` is the checked call (``gpu._Problem``), ``launch`` its launcher, ``stats``
    the stabilisers ``mus, F, G, Gm, flo`` already computed by ``gpu._scan``.
    """
    lq, lk, va, state, out, kv_out = arrays
    matmul = MATMULS[p.lib.name]
    chunk = min(p.chunk, p.length)
    padded = p.num_chunks * chunk
    u, psi, phi = (p.empty((p.batch, p.num_chunks, chunk, p.m)) for _ in range(3))
    vap = p.empty((p.batch, p.num_chunks, chunk, p.width))
    grid: tuple[int, ...] = (padded, -(-max(p.m, p.width) // PER_BLOCK), p.batch)
    launch("chunk_features", grid, (PER_BLOCK,), lq, lk, va, *stats, u, psi, phi, vap)
    with tf32(p.lib.name, allow_tf32):
        scores = matmul(u, psi, False, True)
        grid = (padded, -(-chunk // PER_BLOCK), p.batch)
        launch("causal_select", grid, (PER_BLOCK,), scores, stats[2], stats[3])
        intra = matmul(scores, vap, False, False)
        states = matmul(phi, vap, True, False)
        grid = (-(-p.m * p.width // PER_BLOCK), p.batch)
        launch("scan_states", grid, (PER_BLOCK,), state, stats[0], states, kv_out, False)
        readout = matmul(u, states, False, False)
    grid = (p.length, -(-p.width // PER_BLOCK), p.batch)
    launch("combine_readout", grid, (PER_BLOCK,), intra, readout, stats[3], stats[4], out)
