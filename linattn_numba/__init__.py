"""Compiled Numba kernels for linattn: the chunked, stabilised causal scan, forward and backward.

This package knows nothing of ``linattn``: it takes and returns arrays.  It is
imported lazily, by ``linattn._dispatch`` only.

Layout, dependencies pointing down (``[tool.importlinter]`` in ``pyproject.toml`` keeps
it so):

* bindings: :mod:`linattn_numba.libraries` (which kernel serves which array library),
  :mod:`linattn_numba.torch_ops` (the torch custom operators, CPU and CUDA) and
  :mod:`linattn_numba.gpu.host` (the CUDA host side);
* passes: :mod:`linattn_numba.cpu.causal`, ``fused_causal``, ``fused_causal_backward``,
  ``bidirectional``, ``hybrid``, ``window`` and ``decode`` (each a compiled pass and its
  checked NumPy entry point);
* primitives: :mod:`linattn_numba.cpu.chunks`, ``features``, ``exact``, ``scalars``,
  ``arrays`` and ``calls``, and the CUDA device code :mod:`linattn_numba.gpu.kernels`
  and :mod:`linattn_numba.gpu.blas`;
* :mod:`linattn_numba._machinery` (compiling, threads, BLAS; :func:`cache_directory` and
  :func:`single_threaded_blas` here are its public face), :mod:`linattn_numba._contract`
  (the kernel argument contract) and :mod:`linattn_numba.gpu.target` (the one module that
  imports numba's CUDA target).

Kernel contract (CPU and CUDA alike)::

    kernel(log_phi_q, log_phi_k, values_aug, kv, log_shift, chunk_size)
        -> (outputs_aug, kv_out, log_shift_out)

with shapes ``(*batch, L, m)``, ``(*batch, L, m)``, ``(*batch, L, d_v + 1)``,
``(*batch, m, d_v + 1)``, ``(*batch, m)`` and the same algorithm, and results, as
``linattn.causal.causal`` (see its module docstring for the stabilisers).  With the
keyword ``return_log_scale=True`` every kernel returns a fourth array, ``log_scale`` of
shape ``(*batch, L)``: the true ``[numerator | denominator]`` of row ``t`` is
``exp(log_scale[t]) * outputs_aug[t]``, so ``log(outputs_aug[..., -1]) + log_scale`` is
the log-normaliser (a stabiliser, like ``log_shift_out``: no gradient of its own).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

__all__ = [
    "cache_directory",
    "causal_kernel_for",
    "cpu_runtime",
    "cpu_status",
    "cuda_status",
    "single_threaded_blas",
]

Kernel = Callable[..., tuple[Any, ...]]


def cpu_status() -> str:
    """``"available"`` or why the CPU kernels cannot run."""
    try:
        from linattn_numba import cpu
    except ImportError as error:
        return f"unavailable: {error}; install linattn[numba]"
    return cpu.status()


def cpu_runtime() -> str:
    """How the CPU kernels run here: their threads and the compile cache."""
    from linattn_numba import _machinery

    return _machinery.describe()


def cache_directory() -> Path | None:
    """The CPU kernels' compile cache directory, ``None`` where it is off."""
    from linattn_numba import _machinery

    return _machinery.CACHE_SETTING.directory


def single_threaded_blas() -> AbstractContextManager[None]:
    """BLAS on one thread while the block runs (as while a kernel runs)."""
    from linattn_numba import _machinery

    return _machinery.single_threaded_blas()


def cuda_status() -> str:
    """``"available"`` or why the CUDA kernels cannot run (e.g. no GPU found)."""
    try:
        from linattn_numba.gpu import target
    except ImportError as error:
        return f"unavailable: {error}; install linattn[cuda12] or linattn[cuda13]"
    return target.status()


def causal_kernel_for(x: Any) -> tuple[Kernel | None, str]:
    """The causal kernel that serves arrays like ``x``, or ``None`` and the reason."""
    module = type(x).__module__.split(".")[0]
    if module == "numpy":
        return _cpu_kernel("numpy")
    if module == "torch":
        if x.device.type == "cpu":
            return _cpu_kernel("torch")
        if x.device.type == "cuda":
            return _cuda_kernel("torch")
        return None, f"no kernel for torch tensors on {x.device}"
    if module == "cupy":
        return _cuda_kernel("cupy")
    return None, f"no compiled kernel serves {module} arrays"


def _cpu_kernel(library: str) -> tuple[Kernel | None, str]:
    status = cpu_status()
    if status != "available":
        return None, status
    from linattn_numba import libraries

    return libraries.cpu_causal_kernel(library), "available"


def _cuda_kernel(library: str) -> tuple[Kernel | None, str]:
    status = cuda_status()
    if status != "available":
        return None, status
    # The module is ``gpu``, not ``cuda``: numba-cuda's import hook redirects any module
    # whose name contains "numba.cuda", and "linattn_numba.cuda" would recurse.
    from linattn_numba import libraries

    return libraries.cuda_causal_kernel(library), "available"
