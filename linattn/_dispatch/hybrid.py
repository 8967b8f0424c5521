"""The compiled passes of hybrid attention on NumPy arrays: the window part
(:func:`window_kernel_for`) and the one-pass hybrid kernels (:func:`hybrid_kernel_for`),
each chosen under the call's resolved backend."""

from __future__ import annotations

from typing import Any

from linattn._dispatch.common import Backend, library_of, numpy_kernels_why_not
from linattn._xp import Array

__all__ = ["hybrid_kernel_for", "window_kernel_for"]


def window_kernel_for(x: Array, backend: Backend) -> Any:
    """The compiled window part for arrays like ``x`` under the call's resolved
    ``backend``, or ``None`` (the portable code runs).

    NumPy arrays where ``linattn_numba`` imports and the call's backend is not
    ``"array_api"``: the module :mod:`linattn_numba.cpu.window`, whose ``banded_partial``
    and ``banded_partial_backward`` have the contract of ``linattn.hybrid.banded_partial``
    and of its adjoint.
    """
    if library_of(x) != "numpy" or numpy_kernels_why_not(backend) is not None:
        return None
    from linattn_numba.cpu import window as _window

    return _window


def hybrid_kernel_for(x: Array, backend: Backend) -> Any:
    """The compiled one-pass hybrid passes for arrays like ``x`` under the call's resolved
    ``backend``, or ``None``: the module :mod:`linattn_numba.cpu.hybrid` where
    :func:`window_kernel_for` gives the window kernel."""
    if window_kernel_for(x, backend) is None:
        return None
    from linattn_numba.cpu import hybrid as _hybrid

    return _hybrid
