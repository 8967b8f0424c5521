"""The array libraries ``--backend`` offers: device, peak-memory probe, free memory.

Arrays are made and waited for by :mod:`linattn._libraries` (the adapters the test
suite uses too); this module adds what only the benchmarks need.  Each library is
imported when it is asked for, never before, so ``linattn info`` works with NumPy alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from linattn import _libraries

__all__ = ["ARRAY_LIBRARIES", "ArrayLibrary", "BackendUnavailable", "load_library"]

#: The array libraries ``--backend`` accepts.
ARRAY_LIBRARIES = ("numpy", "torch", "jax", "cupy")


class BackendUnavailable(RuntimeError):
    """The array library asked for cannot run here; the message says why."""


@dataclass
class PeakMemory:
    """Filled in by a memory probe: peak bytes above the level at entry (None if unknown)."""

    bytes: int | None = None


@dataclass(frozen=True)
class ArrayLibrary:
    """One array library on one device, as the benchmarks and studies use it."""

    name: str
    version: str
    device: str
    asarray: Callable[[np.ndarray], Any]
    wait: Callable[[Any], None]
    peak_memory: Callable[[], contextlib.AbstractContextManager[PeakMemory]]
    memory_method: str
    #: Free bytes on the device, or None for host arrays (then host memory counts).
    free_memory: Callable[[], int | None] = lambda: None


def load_library(name: str, dtype: str) -> ArrayLibrary:
    """The array library ``name`` ready for ``dtype`` arrays, or :class:`BackendUnavailable`.

    Examples
    --------
    >>> load_library("numpy", "float32").asarray(np.zeros(2)).dtype
    dtype('float32')
    """
    loaders = {"numpy": _numpy, "torch": _torch, "jax": _jax, "cupy": _cupy}
    reason = _libraries.unusable_reason(name)
    if reason is not None:
        raise BackendUnavailable(reason)
    try:
        return loaders[name](dtype)
    except ImportError as error:
        raise BackendUnavailable(f"{name} cannot be imported ({error})") from None


# -- memory probes ------------------------------------------------------------------


@contextlib.contextmanager
def _tracemalloc_peak() -> Iterator[PeakMemory]:
    """Peak of traced allocations (NumPy reports its buffers to tracemalloc)."""
    result = PeakMemory()
    already = tracemalloc.is_tracing()
    if not already:
        tracemalloc.start()
    tracemalloc.reset_peak()
    baseline = tracemalloc.get_traced_memory()[0]
    try:
        yield result
    finally:
        result.bytes = max(0, tracemalloc.get_traced_memory()[1] - baseline)
        if not already:
            tracemalloc.stop()


def _rss_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


@functools.cache
def _large_blocks_from_mmap() -> bool:
    """Ask glibc to serve blocks above 64 KiB with mmap, so that freeing returns them.

    Setting the threshold also stops glibc from raising it after each free, which
    would otherwise keep freed arrays in the heap and hide later peaks from the
    resident-set high-water mark.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, 64 * 1024))
    except (OSError, AttributeError):
        return False


def _can_reset_rss_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as clear:
            clear.write("5")
    except OSError:
        return False
    return _rss_kib("VmHWM") is not None


@contextlib.contextmanager
def _rss_peak() -> Iterator[PeakMemory]:
    """Linux only: reset the resident-set high-water mark, read it after the call."""
    result = PeakMemory()
    _large_blocks_from_mmap()
    if not _can_reset_rss_peak():
        yield result
        return
    before = _rss_kib("VmRSS") or 0
    try:
        yield result
    finally:
        peak = _rss_kib("VmHWM")
        result.bytes = None if peak is None else max(0, peak - before) * 1024


@contextlib.contextmanager
def _no_probe() -> Iterator[PeakMemory]:
    yield PeakMemory()


RSS_METHOD = (
    "resident-set high-water mark above the level before the call (Linux /proc, reset "
    "per call; glibc told to mmap blocks above 64 KiB so freed arrays leave the heap)"
)


# -- libraries --------------------------------------------------------------------


def _numpy(dtype: str) -> ArrayLibrary:
    return ArrayLibrary(
        name="numpy",
        version=np.__version__,
        device="cpu",
        asarray=functools.partial(_libraries.from_host, "numpy", dtype=dtype),
        wait=_libraries.wait,
        peak_memory=_tracemalloc_peak,
        memory_method=(
            "tracemalloc peak of NumPy allocations during the call, inputs excluded, "
            "output included (scratch that compiled kernels allocate inside Numba is "
            "not traced)"
        ),
    )


def _torch(dtype: str) -> ArrayLibrary:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    asarray = functools.partial(_libraries.from_host, "torch", dtype=dtype, device=device)
    if device == "cuda":

        @contextlib.contextmanager
        def peak() -> Iterator[PeakMemory]:
            result = PeakMemory()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            try:
                yield result
            finally:
                torch.cuda.synchronize()
                result.bytes = max(0, torch.cuda.max_memory_allocated() - before)

        return ArrayLibrary(
            "torch",
            torch.__version__,
            f"cuda ({torch.cuda.get_device_name()})",
            asarray,
            _libraries.wait,
            peak,
            "torch.cuda.max_memory_allocated above the level before the call",
            lambda: int(torch.cuda.mem_get_info()[0]),
        )
    return ArrayLibrary(
        "torch", torch.__version__, "cpu", asarray, _libraries.wait, _rss_peak, RSS_METHOD
    )


def _jax(dtype: str) -> ArrayLibrary:
    import jax

    if dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    device = jax.devices()[0]
    on_cpu = device.platform == "cpu"
    return ArrayLibrary(
        "jax",
        jax.__version__,
        device.platform
        if device.device_kind == device.platform
        else f"{device.platform} ({device.device_kind})",
        functools.partial(_libraries.from_host, "jax", dtype=dtype, device=device),
        _libraries.wait,
        _rss_peak if on_cpu else _no_probe,
        RSS_METHOD if on_cpu else "not measured on accelerators (no resettable peak in JAX)",
        (lambda: None) if on_cpu else functools.partial(_jax_free_memory, device),
    )


def _jax_free_memory(device: Any) -> int | None:
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def _cupy(dtype: str) -> ArrayLibrary:
    import cupy

    pool = cupy.get_default_memory_pool()

    def sync() -> None:
        cupy.cuda.get_current_stream().synchronize()

    @contextlib.contextmanager
    def peak() -> Iterator[PeakMemory]:
        result = PeakMemory()
        sync()
        pool.free_all_blocks()
        before = pool.total_bytes()
        try:
            yield result
        finally:
            sync()
            result.bytes = max(0, pool.total_bytes() - before)

    name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)
    return ArrayLibrary(
        "cupy",
        cupy.__version__,
        f"cuda ({name})",
        functools.partial(_libraries.from_host, "cupy", dtype=dtype),
        _libraries.wait,
        peak,
        "growth of CuPy's memory pool during the call (pool emptied before)",
        lambda: int(cupy.cuda.runtime.memGetInfo()[0]) + int(pool.free_bytes()),
    )
