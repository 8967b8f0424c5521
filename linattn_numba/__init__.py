"""Compiled Numba kernels for linattn (CPU and CUDA); imported lazily by ``linattn._dispatch``."""

from __future__ import annotations

from typing import Any

__all__ = ["causal_kernel_for", "cpu_status", "cuda_status"]


def cpu_status() -> str:
    return "unavailable: the CPU kernels are not built yet"


def cuda_status() -> str:
    return "unavailable: the CUDA kernels are not built yet"


def causal_kernel_for(x: Any) -> tuple[None, str]:
    """The causal kernel for arrays like ``x``, or ``None`` and the reason."""
    return None, "no compiled kernel is available yet"
