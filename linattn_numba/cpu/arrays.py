"""Array helpers of the CPU passes' NumPy entry points: dtypes, layouts, fresh copies.

Python-level, before any compiled code runs: the dtypes the compiled loops take, the
memory budget of the backward's stored states, contiguous views, copies the kernels
may overwrite, and the rows of a state that hold nothing.

Every input reaches a kernel read-only (:func:`readonly`), whether the caller's array was
writable or not (``np.broadcast_to`` views, read-only masks): Numba types an array by
its writability too, so a mix would compile each kernel once per combination.  Only
the outputs and the states a kernel updates in place are writable.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = [
    "DTYPES",
    "STORE_BYTES",
    "chunk_length",
    "contiguous",
    "fresh",
    "readonly",
    "without_empty_rows",
]


DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


#: Per worker thread, the backward keeps every chunk's state up to this many bytes;
#: beyond, it keeps ``sqrt(N)`` checkpoints and recomputes (one more state pass).
STORE_BYTES = 48 * 2**20


def readonly(x: np.ndarray) -> np.ndarray:
    """A read-only view of ``x`` (``x`` itself is left as it was): how every input reaches
    a kernel, so that each kernel compiles once per dtype, not once per mix of writable
    and read-only inputs.

    >>> import numpy as np
    >>> x = np.zeros(2)
    >>> readonly(x).flags.writeable, x.flags.writeable
    (False, True)
    """
    view = x.view()
    view.flags.writeable = False
    return view


def contiguous(x: np.ndarray, shape: tuple[int, ...], dtype: Any = None) -> np.ndarray:
    """``x`` as a read-only C-contiguous array of ``shape`` (a view where it already is
    one): a kernel's input."""
    return readonly(np.ascontiguousarray(x, dtype=dtype).reshape(shape))


def fresh(x: np.ndarray, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A C-contiguous copy of ``x`` of ``shape`` that the kernel may overwrite."""
    return np.array(x, dtype=dtype, order="C", copy=True).reshape(shape)


def without_empty_rows(state: np.ndarray, log_shift: np.ndarray) -> np.ndarray:
    """Zeros, in place, for the rows of a state whose shift is ``-inf``.

    Such a row has seen no key, so it holds nothing whatever it stores (the array-API
    scan and the CUDA kernels read it as zeros too); a gradient for it is likewise 0.
    """
    empty = log_shift == -np.inf
    if empty.any():
        state[empty] = 0
    return state


def chunk_length(chunk_size: int, length: int) -> int:
    """The chunk the kernels run: at most ``L``, at least 1 (``L = 0`` runs none)."""
    return max(1, min(chunk_size, length))
