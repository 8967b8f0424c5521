"""The vendor-BLAS design of the GPU forward (``gpu.forward(..., design_name="blas")``).

Same checks as the kernels' forward in ``test_cuda.py`` (whose inputs and
tolerances it reuses), under the CUDA simulator on NumPy arrays, whose batched
products ``numpy.matmul`` computes; on a machine with a GPU the same checks run
on the device.  Also: every output and scratch element is written (all device
memory poisoned with NaN), and how the design and TF32 are chosen.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

if importlib.util.find_spec("numba_cuda") is None:
    pytest.skip("numba-cuda is not installed", allow_module_level=True)

from linattn_numba.gpu import target as _cuda

if _cuda.status() != "available":
    pytest.skip(
        f"CUDA kernels cannot run here ({_cuda.status()}); set NUMBA_ENABLE_CUDASIM=1",
        allow_module_level=True,
    )

from test_cuda import CASES, RNG, _close, _inputs, _reference

from linattn_numba import gpu, libraries
from linattn_numba.gpu import blas as _gpu_blas


def _blas(args: tuple[np.ndarray, ...], chunk: int) -> tuple[np.ndarray, ...]:
    return gpu.forward("numpy", *args, chunk, "blas")


@pytest.mark.parametrize(("batch", "length", "m", "dv", "chunk", "state", "mask"), CASES)
def test_blas_forward_matches_array_api_float64(batch, length, m, dv, chunk, state, mask):
    args = _inputs(batch, length, m, dv, state, mask)
    got, want = _blas(args, chunk), _reference(args, chunk)
    for actual, expected in zip(got, want, strict=True):
        assert actual.dtype == np.float64
        _close(actual, expected, rtol=1e-10)
    np.testing.assert_array_equal(got[2], want[2])  # a maximum: exact


def test_blas_forward_matches_the_kernels_and_the_cpu_kernel() -> None:
    args = _inputs((2,), 11, 6, 3, True, True)
    kernels = gpu.forward("numpy", *args, 4, "kernels")
    for actual, expected in zip(_blas(args, 4), kernels, strict=True):
        _close(actual, expected, rtol=1e-12)
    import linattn_numba

    if linattn_numba.cpu_status() != "available" or importlib.util.find_spec("scipy") is None:
        pytest.skip(f"CPU kernel: {linattn_numba.cpu_status()} (or no SciPy)")
    from linattn_numba import cpu

    for actual, expected in zip(_blas(args, 4), cpu.numpy_forward(*args, 4), strict=True):
        _close(actual, expected, rtol=1e-10)


def test_blas_forward_float32_and_half() -> None:
    args = tuple(a.astype(np.float32) for a in _inputs((2,), 10, 7, 3, True, True))
    for actual, expected in zip(_blas(args, 4), _reference(args, 4), strict=True):
        assert actual.dtype == np.float32
        _close(actual, expected, rtol=1e-5)
    half = tuple(a.astype(np.float16) for a in _inputs((1,), 6, 5, 2, False, False))
    wide = tuple(a.astype(np.float32) for a in half)
    for actual, expected in zip(_blas(half, 4), _reference(wide, 4), strict=True):
        assert actual.dtype == np.float32
        _close(actual, expected, rtol=1e-5)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_blas_causality_is_bit_exact(dtype: type) -> None:
    """Changing tokens after t (queries, keys, values) leaves outputs up to t bit-identical."""
    args = tuple(a.astype(dtype) for a in _inputs((1,), 10, 6, 3, True, False))
    before = _blas(args, 4)[0]
    changed = [a.copy() for a in args]
    cut = 5  # inside chunk 1 (tokens 4-7)
    changed[0][..., cut + 1 :, :] = RNG.normal(size=changed[0][..., cut + 1 :, :].shape)
    changed[1][..., cut + 1 :, :] = 8.0 + RNG.normal(size=changed[1][..., cut + 1 :, :].shape)
    changed[2][..., cut + 1 :, :-1] = 1e3
    after = _blas(tuple(changed), 4)[0]
    np.testing.assert_array_equal(after[..., : cut + 1, :], before[..., : cut + 1, :])
    assert not np.array_equal(after[..., cut + 1 :, :], before[..., cut + 1 :, :])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # (NumPy: inf * 0 in the scores)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_blas_later_non_finite_key_is_selected_away(bad: str, dtype: type) -> None:
    """The scores ``u psi^T`` of a NaN / +inf key are selected out for earlier queries."""
    args = [a.astype(dtype) for a in _inputs((2,), 13, 6, 3, True, False)]
    at = 5  # inside chunk 0 (tokens 0-7)

    def outputs(key: float) -> np.ndarray:
        lk = args[1].copy()
        lk[0, at] = key
        return _blas((args[0], lk, *args[2:]), 8)[0]

    out, ref = outputs(float(bad)), outputs(0.0)
    np.testing.assert_array_equal(out[0, :at], ref[0, :at])
    np.testing.assert_array_equal(out[1], ref[1])


@pytest.mark.parametrize("design", gpu.DESIGNS)
@pytest.mark.parametrize(("length", "chunk"), [(11, 4), (9, 16), (8, 4)])
def test_every_element_is_written(design: str, length: int, chunk: int, monkeypatch) -> None:
    """All device memory (outputs, padded features, scratch) starts as NaN: results equal
    those computed in fresh memory, so no kernel reads or returns an unwritten element."""
    args = _inputs((2,), length, 6, 3, True, True)
    clean = gpu.forward("numpy", *args, chunk, design)
    library = gpu.LIBRARIES["numpy"]

    def poisoned(shape: tuple[int, ...], dtype: str, device: int | None) -> object:
        return _cuda.to_device(np.full(shape, np.nan, dtype=dtype))

    monkeypatch.setattr(library, "empty", poisoned)
    monkeypatch.setattr(
        _gpu_blas, "MATMULS", {"numpy": _poisoned_matmul(_gpu_blas.MATMULS["numpy"])}
    )
    for actual, expected in zip(gpu.forward("numpy", *args, chunk, design), clean, strict=True):
        np.testing.assert_array_equal(actual, expected)
    assert np.all(np.isfinite(clean[0]))


def _poisoned_matmul(matmul):
    """``numpy.matmul`` writes its result into NaN-filled memory (what cuBLAS sees on a GPU)."""

    def product(a, b, ta, tb):
        result = matmul(a, b, ta, tb).copy_to_host()
        poisoned = _cuda.to_device(np.full(result.shape, np.nan, dtype=result.dtype))
        poisoned.copy_to_device(result)
        return poisoned

    return product


def test_empty_inputs() -> None:
    lq, lk, va, kv, mu = _inputs((2,), 3, 4, 2, True, False)
    out, kv_out, mu_out = _blas((lq[:, :0], lk[:, :0], va[:, :0], kv, mu), 4)
    assert out.shape == (2, 0, 3)
    np.testing.assert_array_equal(kv_out, kv)
    np.testing.assert_array_equal(mu_out, mu)


# --------------------------------------------------------------------------------------
# Choosing the design and TF32.


def test_design_defaults_to_the_kernels_and_reads_the_environment(monkeypatch) -> None:
    monkeypatch.delenv(gpu.DESIGN_VARIABLE, raising=False)
    monkeypatch.delenv(gpu.TF32_VARIABLE, raising=False)
    assert gpu.design() == ("kernels", False)
    monkeypatch.setenv(gpu.DESIGN_VARIABLE, "blas")
    monkeypatch.setenv(gpu.TF32_VARIABLE, "1")
    assert gpu.design() == ("blas", True)
    assert gpu.design("kernels") == ("kernels", True)  # the argument wins


@pytest.mark.parametrize(
    ("variable", "value", "choice", "named"),
    [
        ("LINATTN_CUDA_DESIGN", "cublas", None, "LINATTN_CUDA_DESIGN"),
        ("LINATTN_CUDA_TF32", "yes", None, "LINATTN_CUDA_TF32"),
        ("LINATTN_CUDA_DESIGN", "blas", "fast", "design"),
    ],
)
def test_bad_design_is_rejected(variable, value, choice, named, monkeypatch) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=f"{named}.*got '{choice or value}'"):
        gpu.design(choice)


def test_environment_routes_forward_to_the_blas_design(monkeypatch) -> None:
    called = []
    real = _gpu_blas.forward

    def spy(p, launch, arrays, stats, allow_tf32):
        called.append(allow_tf32)
        return real(p, launch, arrays, stats, allow_tf32)

    monkeypatch.setattr(_gpu_blas, "forward", spy)
    args = _inputs((1,), 5, 3, 2, False, False)
    monkeypatch.delenv(gpu.DESIGN_VARIABLE, raising=False)
    libraries.cuda_causal_kernel("numpy")(*args, 4)
    assert called == []
    monkeypatch.setenv(gpu.DESIGN_VARIABLE, "blas")
    libraries.cuda_causal_kernel("numpy")(*args, 4)
    gpu.forward("numpy", *args, 4, allow_tf32=True)
    assert called == [False, True]


def test_tf32_is_set_only_when_opted_in_and_restored() -> None:
    torch = pytest.importorskip("torch")
    flag = torch.backends.cuda.matmul
    before = flag.allow_tf32
    try:
        flag.allow_tf32 = False
        with _gpu_blas.tf32("torch", False):
            assert flag.allow_tf32 is False
        with _gpu_blas.tf32("torch", True):
            assert flag.allow_tf32 is True
        assert flag.allow_tf32 is False
    finally:
        flag.allow_tf32 = before
