"""The one module that imports numba's CUDA target (the ``numba-cuda`` package).

Everything CUDA-specific that depends on *which* package provides the target
(today ``numba-cuda``; a successor can be swapped in here) lives in this module:
the import itself, whether the CUDA simulator is on (``NUMBA_ENABLE_CUDASIM=1``),
whether the kernels can run (a driver and a GPU, *and* the compiler: libNVVM
and libdevice), streams and zero-copy views of foreign GPU arrays.

A GPU alone is not enough: numba-cuda compiles every kernel with libNVVM and
links libdevice (the maths library), which come from the CUDA toolkit wheels
(``numba-cuda[cu12]`` / ``[cu13]``, hence ``linattn[cuda12]`` / ``[cuda13]``)
or a system toolkit.  :func:`status` checks all of them, through numba-cuda's
own lookup (``numba.cuda.cuda_paths``, which asks ``cuda-pathfinder``), so that
``backend="auto"`` sends CuPy and torch-CUDA arrays to kernels that can compile,
and otherwise to the array-API path.

Examples
--------
>>> from linattn_numba.gpu import target
>>> isinstance(target.status(), str)
True
"""

from __future__ import annotations

import functools
import importlib.util
import math
import time
import warnings
from typing import Any

from numba import cuda as _target
from numba.core import config

__all__ = [
    "INSTALL",
    "PERFORMANCE_WARNINGS",
    "SIMULATOR",
    "TILE",
    "as_device_array",
    "cuda",
    "describe",
    "device_array",
    "external_stream",
    "gpu",
    "probe",
    "status",
    "to_device",
    "toolchain",
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

INSTALL = {
    12: 'pip install "linattn[cuda12]"',
    13: 'pip install "linattn[cuda13]"',
}
"""The install command for each CUDA major version of the driver (numba-cuda's extras)."""


def _performance_warnings() -> tuple[type[Warning], ...]:
    """numba-cuda's ``NumbaPerformanceWarning`` classes (0.30 has its own, unrelated to numba's).

    Launches that under-fill a GPU warn with numba-cuda's class
    (``numba.cuda.core.errors``); older numba-cuda and numba's built-in target
    used ``numba.core.errors``.  Both are filtered, where they exist.
    """
    found: list[type[Warning]] = []
    for module in ("numba.cuda.core.errors", "numba.core.errors"):
        try:
            cls = getattr(importlib.import_module(module), "NumbaPerformanceWarning", None)
        except ImportError:
            continue
        if isinstance(cls, type) and issubclass(cls, Warning) and cls not in found:
            found.append(cls)
    return tuple(found)


PERFORMANCE_WARNINGS: tuple[type[Warning], ...] = _performance_warnings()
"""The warning classes a small launch raises (filtered around every launch)."""


@functools.cache
def toolchain() -> dict[str, tuple[str | None, str]]:
    """What numba-cuda finds: ``{part: (path or None, how it was found or why not)}``.

    Parts: ``"numba-cuda"``, ``"driver"`` (with its CUDA version), ``"nvvm"``,
    ``"libdevice"``, ``"nvrtc"`` (numba-cuda's lookup of libNVVM goes through
    NVRTC).  Looked up once per process, with numba-cuda's own functions.
    """
    if SIMULATOR:
        return {"simulator": ("NUMBA_ENABLE_CUDASIM=1", "kernels run on the CPU")}
    found: dict[str, tuple[str | None, str]] = {}
    spec = importlib.util.find_spec("numba_cuda")
    if spec is None:
        found["numba-cuda"] = (None, "not installed")
        return found
    found["numba-cuda"] = (spec.origin, _version("numba-cuda"))
    found["driver"] = _driver()
    found.update(_compiler())
    return found


def _version(distribution: str) -> str:
    from importlib import metadata

    try:
        return f"version {metadata.version(distribution)}"
    except metadata.PackageNotFoundError:
        return "version unknown"


def _driver() -> tuple[str | None, str]:
    """The CUDA driver library and its CUDA version, or why there is none."""
    try:
        if not cuda.is_available():
            return None, "no CUDA driver or no GPU found"
        from numba.cuda.cudadrv import driver

        major, minor = driver.get_version()
        path = getattr(getattr(driver.driver, "lib", None), "_name", None) or "libcuda"
        return str(path), f"CUDA {major}.{minor}, {len(cuda.gpus)} GPU(s)"
    except Exception as error:  # driver errors surface as many types
        return None, f"CUDA driver unusable ({type(error).__name__}: {error})"


def _compiler() -> dict[str, tuple[str | None, str]]:
    """libNVVM, libdevice and NVRTC as numba-cuda's ``get_cuda_paths`` finds them."""
    try:
        from numba.cuda.cuda_paths import get_cuda_paths

        paths = get_cuda_paths()
    except Exception as error:  # cuda-pathfinder's DynamicLibNotFoundError, ImportError
        # get_cuda_paths looks everything up at once and fails as a whole: name the cause.
        reason = f"not found ({type(error).__name__}: {error})"
        return {"nvvm": (None, reason), "libdevice": (None, reason), "nvrtc": (None, reason)}
    found: dict[str, tuple[str | None, str]] = {}
    for part in ("nvvm", "libdevice", "nvrtc"):
        entry = paths.get(part)
        path = getattr(entry, "info", None)
        found[part] = (str(path), f"found via {entry.by}") if path else (None, "not found")
    try:
        from numba.cuda.cudadrv import nvvm

        if found["nvvm"][0] is not None and not nvvm.is_available():
            found["nvvm"] = (None, f"{found['nvvm'][0]} could not be loaded")
    except Exception as error:  # cuda.bindings missing or broken
        found["nvvm"] = (None, f"cuda.bindings.nvvm unusable ({type(error).__name__}: {error})")
    return found


def describe(found: dict[str, tuple[str | None, str]]) -> str:
    """``"available"``, or which parts of :func:`toolchain`'s answer are missing and the fix.

    Examples
    --------
    >>> from linattn_numba.gpu.target import describe
    >>> describe({"numba-cuda": (None, "not installed")})[:30]
    'numba-cuda is not installed; p'
    >>> ok = ("/lib/x.so", "found")
    >>> describe({"numba-cuda": ok, "driver": ok, "nvvm": ok, "libdevice": (None, "not found"),
    ...           "nvrtc": ok})[:56]
    'CUDA kernels cannot compile: libdevice not found; pip in'
    """
    if "simulator" in found:
        return "available"
    both = f"{INSTALL[12]} (CUDA 12 driver) or {INSTALL[13]} (CUDA 13 driver)"
    if found.get("numba-cuda", (None, ""))[0] is None:
        return f"numba-cuda is not installed; {both}"
    driver_path, driver_note = found.get("driver", (None, "not checked"))
    install = both
    if driver_path is not None and driver_note.startswith("CUDA "):
        major = int(driver_note[5:].split(".")[0])
        install = INSTALL.get(major, both)
    missing = []
    for part in ("nvvm", "libdevice"):
        path, note = found.get(part, (None, "not checked"))
        if path is None:
            missing.append(f"{part} {note}")
    if driver_path is None:
        tail = f"; and the compiler: {'; '.join(missing)}" if missing else ""
        return f"numba-cuda installed, {driver_note}{tail}"
    if missing:
        return f"CUDA kernels cannot compile: {'; '.join(missing)}; {install}"
    return "available"


def status() -> str:
    """``"available"`` or why the CUDA kernels cannot run here, with the install command.

    Available means numba-cuda, a CUDA driver with a GPU, libNVVM and libdevice
    are all found (or the simulator is on); :func:`toolchain` says where.

    Examples
    --------
    >>> from linattn_numba.gpu.target import status
    >>> s = status()
    >>> s == "available" or "numba-cuda" in s or "cannot compile" in s
    True
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # numba-cuda warns about old drivers and toolkits
        return describe(toolchain())


def _probe_kernel(x: Any) -> None:  # (module level: the simulator swaps the global ``cuda``)
    i = cuda.grid(1)
    if i < x.size:
        x[i] = math.exp(x[i] * 0.0) + i  # math.exp: libdevice is linked, not just NVVM


def probe() -> float:
    """Compile and launch one small kernel and check its result; the seconds it took.

    Raises whatever the driver, NVVM or libdevice raise: the first thing a GPU
    check runs (``benchmarks/gpu_check.py``), since :func:`status` finds the
    parts but compiles nothing.
    """
    import numpy as np

    started = time.perf_counter()
    kernel = cuda.jit("void(float32[::1])")(_probe_kernel)
    x = cuda.to_device(np.zeros(64, dtype=np.float32))
    kernel[2, 32](x)
    got = x.copy_to_host()
    want = 1.0 + np.arange(64, dtype=np.float32)
    if not np.array_equal(got, want):
        raise RuntimeError(f"the probe kernel wrote {got[:8]}..., expected {want[:8]}...")
    return time.perf_counter() - started


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
