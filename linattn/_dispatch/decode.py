"""The compiled decoding step (:func:`decode_kernel`) and a fitted map's operands for it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from linattn._dispatch.common import NUMBA_INSTALLED, fitted_kernel_arrays
from linattn.features import FeatureMap

__all__ = ["decode_kernel", "fitted_decode_operands"]


def decode_kernel() -> Callable[..., Any] | None:
    """The compiled decoding step (:func:`linattn_numba.cpu.decode.decode_step`), or
    ``None`` where numba is missing."""
    if not NUMBA_INSTALLED:
        return None
    try:
        from linattn_numba.cpu import decode as compiled
    except ImportError:
        return None
    return compiled.decode_step


def fitted_decode_operands(feature_map: FeatureMap, shape: tuple[int, ...], dtype: Any) -> Any:
    """A fitted map's ``(weights, biases)`` as the decoding kernel takes them for inputs of
    ``shape`` (``linattn_numba.cpu.calls.fitted_operands``); ``ValueError`` where its
    heads do not meet ``shape``."""
    from linattn_numba.cpu.calls import fitted_operands

    _, arrays = fitted_kernel_arrays(feature_map, shape, dtype)
    weights, biases, _ = fitted_operands(arrays, tuple(shape[:-2]), dtype)
    return weights, biases
