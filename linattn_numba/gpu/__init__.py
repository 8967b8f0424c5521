"""The CUDA kernels (numba-cuda): the causal scan, forward and backward, on the GPU.

The layers, each using only those below it (which kernel serves which library, and the
torch operators, are bindings above this package: :mod:`linattn_numba.libraries` and
:mod:`linattn_numba.torch_ops`):

* :mod:`~linattn_numba.gpu.host`: the host side (checks and launches), and
  :mod:`~linattn_numba.gpu.arrays`: the caller's library (NumPy host arrays, CuPy, torch:
  checks, allocation, streams);
* device code: :mod:`~linattn_numba.gpu.kernels` (the CUDA kernels) and
  :mod:`~linattn_numba.gpu.blas` (the vendor-BLAS design's products);
* :mod:`~linattn_numba.gpu.target`: the one module that imports numba's CUDA target
  (simulator aware).

The package is ``gpu``, not ``cuda``: numba-cuda's import hook redirects any module whose
name contains "numba.cuda", and "linattn_numba.cuda" would recurse.  Importing it imports
numba-cuda; :func:`linattn_numba.cuda_status` says whether the kernels can run.
"""

from __future__ import annotations

from linattn_numba.gpu.arrays import LIBRARIES
from linattn_numba.gpu.host import (
    DESIGN_VARIABLE,
    DESIGNS,
    TF32_VARIABLE,
    backward,
    design,
    forward,
)

__all__ = [
    "DESIGNS",
    "DESIGN_VARIABLE",
    "LIBRARIES",
    "TF32_VARIABLE",
    "backward",
    "design",
    "forward",
]
