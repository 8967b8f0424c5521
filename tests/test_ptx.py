"""Every CUDA kernel compiles to PTX for sm_80 (A100) and sm_90 (H100/H200), without a GPU.

Needs libNVVM (the ``cuda-toolkit[nvcc,nvrtc]`` pip packages, ``nox -s ptx``);
skips with the reason when it is missing or when the CUDA simulator is on.
"""

from __future__ import annotations

import importlib.util
import re

import pytest

if importlib.util.find_spec("numba_cuda") is None:
    pytest.skip("numba-cuda is not installed", allow_module_level=True)

from linattn_numba.gpu import target as _cuda

if _cuda.SIMULATOR:
    pytest.skip("PTX is not compiled under NUMBA_ENABLE_CUDASIM=1", allow_module_level=True)

from linattn_numba.gpu import kernels as _gpu_kernels

ARCHITECTURES = [(8, 0), (9, 0)]
PRECISIONS = ["float32", "float64"]


@pytest.fixture(scope="module")
def nvvm() -> None:
    """Skip (with the reason) when libNVVM cannot be found or loaded."""

    def probe(x):  # type: ignore[no-untyped-def]
        x[0] = 1.0

    try:
        _cuda.cuda.compile_ptx(probe, "void(float32[::1])", cc=(8, 0))
    except Exception as error:
        if re.search("nvvm|libnvvm|cuda toolkit", str(error), re.IGNORECASE):
            pytest.skip(f"libNVVM not found ({error}); pip install 'cuda-toolkit[nvcc,nvrtc]'")
        raise


@pytest.mark.parametrize("cc", ARCHITECTURES, ids=lambda cc: f"sm_{cc[0]}{cc[1]}")
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", _gpu_kernels.KERNEL_NAMES)
def test_kernel_compiles_to_ptx(nvvm: None, name: str, precision: str, cc: tuple[int, int]):
    kernel = getattr(_gpu_kernels.kernels(precision), name)
    ptx, return_type = _cuda.cuda.compile_ptx(
        kernel.py_func, _gpu_kernels.signatures(precision)[name], cc=cc
    )
    assert str(return_type) == "none"
    assert f".target sm_{cc[0]}{cc[1]}" in ptx
    assert ".entry" in ptx
    if precision == "float32":
        # A stray Python float would silently promote float32 kernels to (slow) double.
        assert ".f64" not in ptx, "double-precision instructions in a float32 kernel"
