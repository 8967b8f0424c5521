"""Array libraries for the command line: make arrays, wait for results, measure peak memory.

Only the CLI imports this module.  Each library is imported when it is asked for,
never before, so ``linattn info`` and ``linattn demo`` work with NumPy alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import importlib
import importlib.metadata
import os
import platform
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "ARRAY_LIBRARIES",
    "ArrayLibrary",
    "BackendUnavailable",
    "load_library",
    "machine_info",
    "package_version",
]

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


def package_version(distribution: str) -> str | None:
    """The installed version of a distribution, or None."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def load_library(name: str, dtype: str) -> ArrayLibrary:
    """The array library ``name`` ready for ``dtype`` arrays, or :class:`BackendUnavailable`."""
    loaders = {"numpy": _numpy, "torch": _torch, "jax": _jax, "cupy": _cupy}
    try:
        return loaders[name](dtype)
    except ImportError as error:
        raise BackendUnavailable(f"{name} cannot be imported ({error})") from None


def _nothing(_: Any) -> None:
    return None


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
        asarray=lambda x: np.ascontiguousarray(x, dtype=dtype),
        wait=_nothing,
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
    torch_dtype = getattr(torch, dtype)

    def asarray(x: np.ndarray) -> Any:
        return torch.asarray(np.ascontiguousarray(x), dtype=torch_dtype, device=device)

    if device == "cuda":

        def wait(_: Any) -> None:
            torch.cuda.synchronize()

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
            wait,
            peak,
            "torch.cuda.max_memory_allocated above the level before the call",
        )
    return ArrayLibrary(
        "torch", torch.__version__, "cpu", asarray, _nothing, _rss_peak, RSS_METHOD
    )


def _jax(dtype: str) -> ArrayLibrary:
    import jax

    if dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp

    device = jax.devices()[0]

    def asarray(x: np.ndarray) -> Any:
        return jax.device_put(jnp.asarray(x, dtype=dtype), device)

    def wait(x: Any) -> None:
        jax.block_until_ready(x)

    on_cpu = device.platform == "cpu"
    return ArrayLibrary(
        "jax",
        jax.__version__,
        device.platform
        if device.device_kind == device.platform
        else f"{device.platform} ({device.device_kind})",
        asarray,
        wait,
        _rss_peak if on_cpu else _no_probe,
        RSS_METHOD if on_cpu else "not measured on accelerators (no resettable peak in JAX)",
    )


def _cupy(dtype: str) -> ArrayLibrary:
    import cupy

    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as error:  # CUDARuntimeError without a driver
        raise BackendUnavailable(f"cupy is installed but finds no GPU ({error})") from None
    if count == 0:
        raise BackendUnavailable("cupy is installed but finds no GPU")
    pool = cupy.get_default_memory_pool()

    def wait(_: Any) -> None:
        cupy.cuda.get_current_stream().synchronize()

    @contextlib.contextmanager
    def peak() -> Iterator[PeakMemory]:
        result = PeakMemory()
        wait(None)
        pool.free_all_blocks()
        before = pool.total_bytes()
        try:
            yield result
        finally:
            wait(None)
            result.bytes = max(0, pool.total_bytes() - before)

    name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)
    return ArrayLibrary(
        "cupy",
        cupy.__version__,
        f"cuda ({name})",
        lambda x: cupy.asarray(x, dtype=dtype),
        wait,
        peak,
        "growth of CuPy's memory pool during the call (pool emptied before)",
    )


# -- the machine ------------------------------------------------------------------


def _cpu_model() -> str:
    with (
        contextlib.suppress(OSError),
        open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info,
    ):
        for line in info:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _memory_total() -> str:
    try:
        import psutil

        return f"{psutil.virtual_memory().total / 2**30:.1f} GiB"
    except ImportError:
        kib = None
        with (
            contextlib.suppress(OSError, ValueError),
            open("/proc/meminfo", encoding="ascii") as info,
        ):
            kib = int(info.readline().split()[1])
        return "unknown" if kib is None else f"{kib / 2**20:.1f} GiB"


def _blas() -> str:
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return "unknown (threadpoolctl not installed)"
    pools = [p for p in threadpool_info() if p.get("user_api") == "blas"]
    if not pools:
        return "unknown"
    pool = pools[0]
    return f"{pool.get('internal_api')} {pool.get('version')}, {pool.get('num_threads')} threads"


def machine_info() -> dict[str, str]:
    """What a benchmark result depends on: CPU, cores, memory, Python, NumPy, BLAS."""
    affinity = getattr(os, "sched_getaffinity", None)
    usable = len(affinity(0)) if affinity is not None else os.cpu_count()
    return {
        "cpu": _cpu_model(),
        "cores": f"{usable} usable of {os.cpu_count()} logical",
        "memory": _memory_total(),
        "system": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "numpy": np.__version__,
        "blas": _blas(),
    }


def import_optional(module: str) -> Any | None:
    """``module`` if it imports, else None."""
    try:
        return importlib.import_module(module)
    except Exception:
        return None
