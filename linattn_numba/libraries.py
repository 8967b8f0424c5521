"""Which compiled kernel serves which array library: the kernel contract's entry points.

The top of the bindings: NumPy arrays run the CPU pass directly
(:func:`linattn_numba.cpu.numpy_forward`), torch tensors the custom operators of
:mod:`linattn_numba.torch_ops` (imported when the first torch tensor arrives, with
autograd and ``torch.compile``), CuPy arrays (and NumPy host arrays, for the simulator)
the CUDA host side (:func:`linattn_numba.gpu.host.forward`).  Every import is inside a
function, so that importing this module imports neither numba nor torch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = ["cpu_causal_backward_kernel", "cpu_causal_kernel", "cuda_causal_kernel"]


def _cpu_torch_kernel(
    lq: Any, lk: Any, va: Any, kv: Any, mu: Any, chunk_size: int, *, return_log_scale: bool = False
) -> Any:
    """``torch.ops.linattn.causal_forward`` on CPU tensors (autograd and compile included);
    ``causal_forward_scaled`` with ``return_log_scale`` (see ``numpy_forward``)."""
    from linattn_numba.torch_ops import causal  # (registers the operators on first use)

    return causal("cpu", lq, lk, va, kv, mu, chunk_size, return_log_scale=return_log_scale)


def cpu_causal_kernel(library: str) -> Callable[..., Any]:
    """The CPU forward kernel for arrays of ``library`` (``"numpy"`` or ``"torch"``).

    Examples
    --------
    >>> import numpy as np
    >>> from linattn_numba import libraries
    >>> kernel = libraries.cpu_causal_kernel("numpy")
    >>> lq = np.zeros((2, 1)); va = np.ones((2, 3))
    >>> out, kv, mu = kernel(lq, lq, va, np.zeros((1, 3)), np.full(1, -np.inf), 64)
    >>> out.tolist()
    [[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]]

    Every kernel also takes ``return_log_scale=True`` and then returns ``log_scale``
    fourth (:func:`linattn_numba.cpu.numpy_forward`).
    """
    if library == "numpy":
        from linattn_numba.cpu.causal import numpy_forward

        return numpy_forward
    if library == "torch":
        return _cpu_torch_kernel
    raise ValueError(f"library must be 'numpy' or 'torch'; got {library!r}")


def cpu_causal_backward_kernel(library: str) -> Callable[..., Any]:
    """The CPU backward kernel for ``library`` (``"numpy"``): see
    :func:`linattn_numba.cpu.numpy_backward`."""
    if library == "numpy":
        from linattn_numba.cpu.causal import numpy_backward

        return numpy_backward
    raise ValueError(f"library must be 'numpy'; got {library!r}")


def _cuda_torch_kernel(
    lq: Any, lk: Any, va: Any, kv: Any, mu: Any, chunk_size: int, *, return_log_scale: bool = False
) -> tuple[Any, ...]:
    """``torch.ops.linattn.causal_forward`` (autograd and ``torch.compile`` included);
    ``causal_forward_scaled`` with ``return_log_scale`` (see ``gpu.host.forward``)."""
    from linattn_numba.torch_ops import causal  # (registers the operators on first use)

    return causal("cuda", lq, lk, va, kv, mu, chunk_size, return_log_scale=return_log_scale)


def cuda_causal_kernel(library: str) -> Callable[..., tuple[Any, ...]]:
    """The contract's ``kernel(log_phi_q, log_phi_k, values_aug, kv, log_shift, chunk_size)``
    on the GPU.

    ``library`` is ``"cupy"`` or ``"torch"`` (CUDA tensors, through the custom
    operator ``torch.ops.linattn.causal_forward``), or ``"numpy"``
    (host arrays copied to the device and back: for the simulator and tests).  Imports
    numba-cuda.

    Examples
    --------
    >>> from linattn_numba import libraries
    >>> callable(libraries.cuda_causal_kernel("cupy"))  # doctest: +SKIP
    True
    """
    if library == "torch":
        return _cuda_torch_kernel
    from linattn_numba.gpu.arrays import LIBRARIES
    from linattn_numba.gpu.host import forward

    if library in LIBRARIES:
        return functools.partial(forward, library)
    raise ValueError(f"library must be one of {sorted(LIBRARIES)}; got {library!r}")
