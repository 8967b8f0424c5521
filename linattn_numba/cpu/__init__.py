"""Numba CPU kernels: the chunked, stabilised causal scan and the fused passes.

The layers, each using only those below it (which kernel serves which library, and the
torch operators, are bindings above this package: :mod:`linattn_numba.libraries` and
:mod:`linattn_numba.torch_ops`):

* passes, each a compiled pass and its checked NumPy entry point:
  :mod:`~linattn_numba.cpu.causal` (the kernel contract, forward and backward),
  :mod:`~linattn_numba.cpu.fused_causal` and
  :mod:`~linattn_numba.cpu.fused_causal_backward` (features computed in the pass),
  :mod:`~linattn_numba.cpu.bidirectional`, :mod:`~linattn_numba.cpu.hybrid`,
  :mod:`~linattn_numba.cpu.window` and :mod:`~linattn_numba.cpu.decode`;
* primitives, scalar loops and products with no policy:
  :mod:`~linattn_numba.cpu.chunks` (shifts, running maxima, chunk products),
  :mod:`~linattn_numba.cpu.features` (log-features and their VJP),
  :mod:`~linattn_numba.cpu.exact` (exact keys and merges),
  :mod:`~linattn_numba.cpu.scalars` (``fast_exp``, typed literals), and
  :mod:`~linattn_numba.cpu.arrays` and :mod:`~linattn_numba.cpu.calls` (the entry
  points' layouts and checks);
* :mod:`linattn_numba._machinery` (compiling, threads, BLAS) and
  :mod:`linattn_numba._contract` (the kernel argument contract).

This package's own names are the NumPy entry points of the causal passes.
"""

from __future__ import annotations

import numba

from linattn_numba.cpu.causal import numpy_backward, numpy_forward
from linattn_numba.cpu.fused_causal import favor_causal
from linattn_numba.cpu.scalars import fast_exp

__all__ = ["fast_exp", "favor_causal", "numpy_backward", "numpy_forward", "status"]


def status() -> str:
    """``"available"``: numba imported, so the CPU kernels can run (compiled on first use)."""
    return "available"


_ = numba  # imported for its side effect of failing early when numba is missing
