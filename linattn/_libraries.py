"""Per-library adapters: copy a host array into an array library, wait for its results.

The one place that knows how each array library takes a NumPy array and when its
work is finished; the test suite (``tests/conftest.py``) and the command line
(``linattn.cli``) both use it.  No array library other than NumPy is imported
here until an adapter is asked for, so importing this module costs nothing.
"""

from __future__ import annotations

import contextlib
import importlib.util
from typing import Any

import numpy as np

__all__ = ["LIBRARIES", "from_host", "installed", "unusable_reason", "wait"]

#: The array libraries with an adapter, by the name of their top-level module.
LIBRARIES = ("numpy", "torch", "jax", "cupy", "dask", "array_api_strict")


def installed(module: str) -> bool:
    """True when ``module`` can be found (without importing it)."""
    return importlib.util.find_spec(module) is not None


def unusable_reason(name: str) -> str | None:
    """Why library ``name`` cannot make arrays here, or None when it can.

    Examples
    --------
    >>> unusable_reason("numpy") is None
    True
    """
    _check_name(name)
    if not installed(name):
        return f"{name} is not installed"
    if name == "cupy":
        try:
            import cupy

            count = cupy.cuda.runtime.getDeviceCount()
        except Exception as error:  # CUDARuntimeError without a driver
            return f"cupy is installed but finds no GPU ({error})"
        if count == 0:
            return "cupy is installed but finds no GPU"
    return None


def from_host(name: str, x: Any, *, dtype: str | None = None, device: Any = None) -> Any:
    """A copy of host array ``x`` as a ``name`` array, cast to ``dtype`` (a NumPy name).

    The copy shares no memory with ``x`` (``torch.asarray`` would otherwise alias a
    NumPy buffer).  ``device=None`` is the library's default device (CPU for torch,
    ``"device1"`` for array-api-strict, whose default device would hide device bugs);
    Dask arrays get two chunks per axis, so every reduction crosses a chunk boundary.

    Examples
    --------
    >>> from_host("numpy", [1, 2], dtype="float32")
    array([1., 2.], dtype=float32)
    """
    _check_name(name)
    host = np.array(x, dtype=dtype, copy=True)
    if name == "numpy":
        return host
    if name == "torch":
        import torch

        return torch.asarray(host, device=device)
    if name == "jax":
        import jax
        import jax.numpy as jnp

        out = jnp.asarray(host)
        return out if device is None else jax.device_put(out, device)
    if name == "cupy":
        import cupy

        with contextlib.nullcontext() if device is None else cupy.cuda.Device(device):
            return cupy.asarray(host)
    if name == "dask":
        import dask.array as da

        chunks = tuple(max(1, (n + 1) // 2) for n in host.shape) if host.ndim else ()
        return da.from_array(host, chunks=chunks)
    import array_api_strict as xps

    return xps.asarray(host, device=xps.Device("device1") if device is None else device)


def wait(x: Any) -> None:
    """Block until the work that produces ``x`` is done (asynchronous GPUs, JAX dispatch)."""
    module = type(x).__module__.split(".")[0]
    if module == "torch":
        if x.device.type == "cuda":
            import torch

            torch.cuda.synchronize(x.device)
    elif module in ("jax", "jaxlib"):
        import jax

        jax.block_until_ready(x)
    elif module == "cupy":
        import cupy

        cupy.cuda.get_current_stream().synchronize()


def _check_name(name: str) -> None:
    if name not in LIBRARIES:
        raise ValueError(f"name must be one of {', '.join(LIBRARIES)}; got {name!r}")
