"""The one module that imports numba's CUDA target (the ``numba-cuda`` package).

Everything CUDA-specific that depends on *which* package provides the target
(today ``numba-cuda``; a successor can be swapped in here) lives in this module:
the import itself, whether the CUDA simulator is on (``NUMBA_ENABLE_CUDASIM=1``),
whether a GPU is present, streams and zero-copy views of foreign GPU arrays.

Examples
--------
>>> from linattn_numba import _cuda
>>> isinstance(_cuda.status(), str)
True
"""

from __future__ import annotations

import importlib.util
from typing import Any

from numba import cuda as _target
from numba.core import config

__all__ = [
    "SIMULATOR",
    "TILE",
    "as_device_array",
    "cuda",
    "device_array",
    "external_stream",
    "gpu",
    "status",
    "to_device",
]

cuda: Any = _target
"""numba's CUDA target (typed ``Any``: kernels are typed by numba, not by mypy)."""

SIMULATOR: bool = bool(getattr(config, "ENABLE_CUDASIM", 0))
"""True when kernels run in numba's CUDA simulator (Python threads on the CPU)."""

TILE: int = 4 if SIMULATOR else 16
"""Side of the square thread blocks and shared-memory tiles.

Small in the simulator (every thread is a Python thread), so that small test
shapes still cross many tile edges; 16 x 16 = 256 threads on a GPU.
"""


def status() -> str:
    """``"available"`` or why the CUDA kernels cannot run here.

    Examples
    --------
    >>> from linattn_numba._cuda import status
    >>> status() == "available" or "no GPU" in status() or "numba-cuda" in status()
    True
    """
    if SIMULATOR:
        return "available"
    if importlib.util.find_spec("numba_cuda") is None:
        return "numba-cuda is not installed; install linattn[cuda]"
    try:
        found = cuda.is_available()
    except Exception as error:  # driver errors surface as many types
        return f"numba-cuda installed, CUDA driver unusable ({error})"
    if not found:
        return "numba-cuda installed, no GPU found"
    return "available"


def gpu(device_id: int) -> Any:
    """Context manager making GPU ``device_id`` current (a no-op in the simulator)."""
    return cuda.gpus[0 if SIMULATOR else device_id]


def external_stream(pointer: int) -> Any:
    """A numba stream wrapping a stream made by another library (CuPy, PyTorch)."""
    if SIMULATOR or pointer == 0:
        return cuda.default_stream()
    return cuda.external_stream(pointer)


def as_device_array(x: Any) -> Any:
    """Zero-copy numba view of an object exposing ``__cuda_array_interface__``.

    ``sync=False``: the caller launches on the array's own (current) stream, so
    no host synchronisation is needed.
    """
    return cuda.as_cuda_array(x, sync=False)


def to_device(x: Any, stream: Any = 0) -> Any:
    """Copy a host (NumPy) array to the device."""
    return cuda.to_device(x, stream=stream)


def device_array(shape: tuple[int, ...], dtype: Any, stream: Any = 0) -> Any:
    """An uninitialised numba device array."""
    return cuda.device_array(shape, dtype=dtype, stream=stream)
