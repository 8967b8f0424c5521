"""The machine a result depends on: CPU, cores, memory, BLAS, installed versions.

Standard library only (psutil and threadpoolctl when present), so that
``linattn info`` works with the base install.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import os
import platform
from typing import Any

__all__ = ["available_memory", "import_optional", "machine_info", "package_version"]


def package_version(distribution: str) -> str | None:
    """The installed version of a distribution, or None."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def import_optional(module: str) -> Any | None:
    """``module`` if it imports, else None."""
    try:
        return importlib.import_module(module)
    except Exception:
        return None


def _meminfo_kib(field: str) -> int | None:
    with (
        contextlib.suppress(OSError, ValueError, IndexError),
        open("/proc/meminfo", encoding="ascii") as info,
    ):
        for line in info:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return None


def available_memory() -> tuple[int | None, str]:
    """Bytes of host memory a new allocation can get now, and where the number comes from.

    ``(None, reason)`` where neither psutil nor ``/proc/meminfo`` can tell.
    """
    psutil = import_optional("psutil")
    if psutil is not None:
        return int(psutil.virtual_memory().available), "available host memory (psutil)"
    kib = _meminfo_kib("MemAvailable")
    if kib is not None:
        return kib * 1024, "available host memory (MemAvailable in /proc/meminfo)"
    return None, "host memory unknown (no psutil, no /proc/meminfo)"


def _memory_total() -> str:
    psutil = import_optional("psutil")
    if psutil is not None:
        return f"{psutil.virtual_memory().total / 2**30:.1f} GiB"
    kib = _meminfo_kib("MemTotal")
    return "unknown" if kib is None else f"{kib / 2**20:.1f} GiB"


def _cpu_model() -> str:
    with (
        contextlib.suppress(OSError),
        open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info,
    ):
        for line in info:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _blas() -> str:
    threadpoolctl = import_optional("threadpoolctl")
    if threadpoolctl is None:
        return "unknown (threadpoolctl not installed)"
    pools = [p for p in threadpoolctl.threadpool_info() if p.get("user_api") == "blas"]
    if not pools:
        return "unknown"
    pool = pools[0]
    return f"{pool.get('internal_api')} {pool.get('version')}, {pool.get('num_threads')} threads"


def machine_info() -> dict[str, str]:
    """What a benchmark result depends on: CPU, cores, memory, Python, NumPy, BLAS."""
    import numpy as np

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
