"""The Numba CUDA kernels against the array-API path (and the CPU kernel), forward and backward.

Runs under the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``, ``nox -s cudasim``) on
NumPy arrays, which the ``"numpy"`` library copies to the simulated device and
back; on a machine with a GPU it runs the same checks on the real device.  The
simulator runs every GPU thread as a Python thread, so shapes are small; its
tile is 4, so they still cross many tile edges (m, d_v, L and the chunk size
are chosen not to be multiples of it).
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

from linattn import causal as array_api
from linattn_numba import gpu, libraries
from linattn_numba.gpu import host

RNG = np.random.default_rng(20261129)

# (batch shape, L, m, d_v, chunk, with a prior state, with masked keys)
CASES = [
    pytest.param((1,), 1, 3, 2, 4, False, False, id="L1"),
    pytest.param((2,), 11, 6, 3, 4, False, False, id="L11-C4"),
    pytest.param((2,), 11, 6, 3, 5, True, True, id="state-mask-C5"),
    pytest.param((2, 1), 9, 9, 5, 16, True, False, id="chunk>L"),
    pytest.param((1,), 7, 5, 0, 3, False, True, id="dv0"),
    pytest.param((1,), 6, 1, 2, 1, True, False, id="m1-C1"),
]


def _inputs(
    batch: tuple[int, ...], length: int, m: int, dv: int, state: bool, mask: bool
) -> tuple[np.ndarray, ...]:
    lq = RNG.normal(size=(*batch, length, m))
    lk = RNG.normal(size=(*batch, length, m))
    if mask and length > 1:
        lk[..., 1, :] = -np.inf
        lk[..., length - 1, :] = -np.inf
    va = np.concatenate([RNG.normal(size=(*batch, length, dv)), np.ones((*batch, length, 1))], -1)
    if state:
        kv = np.abs(RNG.normal(size=(*batch, m, dv + 1)))
        mu = RNG.normal(size=(*batch, m))
        mu[..., 0] = -np.inf  # a feature that has seen no key yet
        kv[..., 0, :] = 0.0
    else:
        kv = np.zeros((*batch, m, dv + 1))
        mu = np.full((*batch, m), -np.inf)
    return lq, lk, va, kv, mu


def _reference(args: tuple[np.ndarray, ...], chunk: int) -> tuple[np.ndarray, ...]:
    lq, lk, va, kv, mu = args
    return array_api.causal(np, lq, None, lk, None, va, kv, mu, chunk)


def _close(actual: np.ndarray, expected: np.ndarray, rtol: float) -> None:
    """Relative to each array's scale: numerators of signed values may cancel to ~0."""
    assert actual.shape == expected.shape
    scale = np.max(np.abs(np.where(np.isfinite(expected), expected, 0.0)), initial=0.0)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale)


def _forward(
    args: tuple[np.ndarray, ...], chunk: int, design: str | None = None
) -> tuple[np.ndarray, ...]:
    if design is None:
        return libraries.cuda_causal_kernel("numpy")(*args, chunk)
    return gpu.forward("numpy", *args, chunk, design)


@pytest.mark.parametrize(("batch", "length", "m", "dv", "chunk", "state", "mask"), CASES)
def test_forward_matches_array_api_float64(batch, length, m, dv, chunk, state, mask) -> None:
    args = _inputs(batch, length, m, dv, state, mask)
    got = _forward(args, chunk)
    for actual, expected in zip(got, _reference(args, chunk), strict=True):
        assert actual.dtype == np.float64
        _close(actual, expected, rtol=1e-10)
    # log_shift_out is a maximum: exact, -inf included.
    np.testing.assert_array_equal(got[2], _reference(args, chunk)[2])


def test_forward_matches_array_api_float32() -> None:
    args = tuple(a.astype(np.float32) for a in _inputs((2,), 10, 7, 3, True, True))
    got = _forward(args, 4)
    for actual, expected in zip(got, _reference(args, 4), strict=True):
        assert actual.dtype == np.float32
        _close(actual, expected, rtol=1e-5)


def test_half_precision_inputs_are_computed_in_float32() -> None:
    args = tuple(a.astype(np.float16) for a in _inputs((1,), 6, 5, 2, False, False))
    got = _forward(args, 4)
    wide = tuple(a.astype(np.float32) for a in args)
    for actual, expected in zip(got, _reference(wide, 4), strict=True):
        assert actual.dtype == np.float32
        _close(actual, expected, rtol=1e-5)


def test_matches_cpu_kernel() -> None:
    import linattn_numba

    if linattn_numba.cpu_status() != "available":
        pytest.skip(f"CPU kernel: {linattn_numba.cpu_status()}")
    if importlib.util.find_spec("scipy") is None:
        # numba's np.dot calls SciPy's BLAS; without SciPy the CPU kernel aborts the process.
        pytest.skip("the CPU kernel needs SciPy (numba's np.dot) and SciPy is not installed")
    from linattn_numba import cpu

    args = _inputs((2,), 10, 6, 3, True, True)
    # Every state row holds keys here: empty rows (mu = -inf) are compared with the
    # ground truth instead (finite differences, autograd; see the strict xfail below).
    args[4][..., 0] = 0.5
    for actual, expected in zip(_forward(args, 4), cpu.numpy_forward(*args, 4), strict=True):
        _close(actual, expected, rtol=1e-10)
    cot = (RNG.normal(size=(2, 10, 4)), RNG.normal(size=(2, 6, 4)))
    want = cpu.numpy_backward(*args, 4, *cot)
    for actual, expected in zip(gpu.backward("numpy", *args, 4, *cot), want, strict=True):
        _close(actual, expected, rtol=1e-10)


def test_cpu_kernel_gives_empty_state_rows_no_gradient() -> None:
    import linattn_numba

    if linattn_numba.cpu_status() != "available" or importlib.util.find_spec("scipy") is None:
        pytest.skip(f"CPU kernel: {linattn_numba.cpu_status()}")
    from linattn_numba import cpu

    args = _inputs((2,), 9, 5, 2, True, False)  # feature 0: mu = -inf
    cot = (RNG.normal(size=args[2].shape), RNG.normal(size=args[3].shape))
    assert np.all(cpu.numpy_backward(*args, 4, *cot)[3][..., 0, :] == 0.0)


def test_causality_is_bit_exact() -> None:
    """Changing tokens after t (queries, keys, values) leaves outputs up to t bit-identical."""
    for dtype in (np.float64, np.float32):
        args = tuple(a.astype(dtype) for a in _inputs((1,), 10, 6, 3, True, False))
        before = _forward(args, 4)[0]
        changed = [a.copy() for a in args]
        cut = 5
        changed[0][..., cut + 1 :, :] = RNG.normal(size=changed[0][..., cut + 1 :, :].shape)
        changed[1][..., cut + 1 :, :] = 8.0 + RNG.normal(size=changed[1][..., cut + 1 :, :].shape)
        changed[2][..., cut + 1 :, :-1] = 1e3
        after = _forward(tuple(changed), 4)[0]
        np.testing.assert_array_equal(after[..., : cut + 1, :], before[..., : cut + 1, :])
        assert not np.array_equal(after[..., cut + 1 :, :], before[..., cut + 1 :, :])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # (the simulator's NumPy: inf * 0)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("bad", ["nan", "inf", "mixed"])
def test_later_non_finite_key_leaves_earlier_outputs(bad: str, dtype: type) -> None:
    """A key whose log-features are NaN or +inf (inside a chunk, inside a query's own
    tile) is selected away for earlier queries, never multiplied by 0: bit-identical."""
    args = [a.astype(dtype) for a in _inputs((2,), 13, 6, 3, True, False)]
    at = 5  # chunk 0 (tokens 0-7); its tile holds query 4 too
    row = {"nan": np.nan, "inf": np.inf, "mixed": [np.nan, np.inf, -np.inf, 1.0, np.nan, 2.0]}

    def outputs(key: object) -> np.ndarray:
        lk = args[1].copy()
        lk[0, at] = key
        return _forward((args[0], lk, *args[2:]), 8)[0]

    out, ref = outputs(row[bad]), outputs(0.0)
    np.testing.assert_array_equal(out[0, :at], ref[0, :at])
    np.testing.assert_array_equal(out[1], ref[1])


@pytest.mark.parametrize("design", gpu.DESIGNS)
def test_state_continues_a_sequence(design: str) -> None:
    """Feeding a sequence in two pieces through the returned state equals feeding it whole."""
    args = _inputs((2,), 12, 5, 3, False, True)
    whole = _forward(args, 4, design)
    lq, lk, va, kv, mu = args
    first = _forward((lq[:, :8], lk[:, :8], va[:, :8], kv, mu), 4, design)
    second = _forward((lq[:, 8:], lk[:, 8:], va[:, 8:], first[1], first[2]), 4, design)
    _close(np.concatenate([first[0], second[0]], axis=1), whole[0], rtol=1e-12)
    _close(second[1], whole[1], rtol=1e-12)
    np.testing.assert_array_equal(second[2], whole[2])


def test_broadcast_and_strided_inputs() -> None:
    lq, lk, va, kv, mu = _inputs((1,), 9, 6, 2, True, False)
    heads = 3
    wide = (
        np.broadcast_to(lq, (heads, 9, 6)),
        np.ascontiguousarray(np.broadcast_to(lk, (heads, 9, 6)).transpose(0, 2, 1)).transpose(
            0, 2, 1
        ),
        np.broadcast_to(va, (heads, 9, 3)),
        np.broadcast_to(kv, (heads, 6, 3)),
        np.broadcast_to(mu, (heads, 6)),
    )
    got = _forward(wide, 4)
    for actual, expected in zip(got, _reference(wide, 4), strict=True):
        _close(actual, expected, rtol=1e-10)


def _invariant_cotangents(
    out: np.ndarray, mu_out: np.ndarray, r_out: np.ndarray, r_state: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Cotangents of ``sum(o * r_out) + sum(exp(mu) S * r_state)``.

    Both the normalised output ``o`` and the unstabilised state ``exp(mu) S``
    are independent of the stabilisers, so their gradients are the same
    whether the stabilisers are held constant (the kernel) or differentiated
    (autodiff through the array-API path).
    """
    den = out[..., -1:]
    o = out[..., :-1] / den
    d_out = np.concatenate([r_out / den, -np.sum(r_out * o, -1, keepdims=True) / den], -1)
    return d_out, np.exp(mu_out)[..., None] * r_state


def _invariant_loss(args: tuple[np.ndarray, ...], chunk: int, r_out, r_state) -> float:
    out, kv, mu = _reference(args, chunk)
    o = out[..., :-1] / out[..., -1:]
    return float(np.sum(o * r_out) + np.sum(np.exp(mu)[..., None] * kv * r_state))


def _vjp(args: tuple[np.ndarray, ...], chunk: int, seed: int):
    rng = np.random.default_rng(seed)
    r_out = rng.normal(size=args[2][..., :-1].shape)
    r_state = rng.normal(size=args[3].shape)
    out, _, mu_out = _forward(args, chunk)
    grads = gpu.backward(
        "numpy", *args, chunk, *_invariant_cotangents(out, mu_out, r_out, r_state)
    )
    return grads, r_out, r_state


@pytest.mark.parametrize(("batch", "length", "m", "dv", "chunk", "state", "mask"), CASES[1:4])
def test_backward_matches_autograd_of_array_api(batch, length, m, dv, chunk, state, mask):
    torch = pytest.importorskip("torch")
    import array_api_compat.torch as xp

    args = _inputs(batch, length, m, dv, state, mask)
    grads, r_out, r_state = _vjp(args, chunk, seed=length)
    tensors = [torch.tensor(a, requires_grad=i < 4) for i, a in enumerate(args)]
    out, kv, mu = array_api.causal(xp, tensors[0], None, tensors[1], None, *tensors[2:], chunk)
    o = out[..., :-1] / out[..., -1:]
    unstabilised = torch.exp(mu)[..., None] * kv
    loss = (o * torch.tensor(r_out)).sum() + (unstabilised * torch.tensor(r_state)).sum()
    loss.backward()
    for name, actual, t in zip(("lq", "lk", "va", "kv"), grads, tensors, strict=False):
        assert np.all(np.isfinite(actual)), name
        _close(actual, t.grad.numpy(), rtol=1e-10)


def test_backward_matches_finite_differences() -> None:
    """Central differences of the array-API path: error ~ h^2 f''' + eps f / h ~ 1e-10."""
    args = _inputs((1,), 6, 3, 2, True, True)
    chunk = 4
    grads, r_out, r_state = _vjp(args, chunk, seed=1)
    h = 1e-5
    for which in range(4):
        numeric = np.zeros_like(args[which])
        for index in np.ndindex(args[which].shape):
            if not np.isfinite(args[which][index]):
                continue  # masked keys: the kernel's gradient must be 0 there (checked below)
            plus = [a.copy() for a in args]
            minus = [a.copy() for a in args]
            plus[which][index] += h
            minus[which][index] -= h
            numeric[index] = (
                _invariant_loss(tuple(plus), chunk, r_out, r_state)
                - _invariant_loss(tuple(minus), chunk, r_out, r_state)
            ) / (2 * h)
        _close(grads[which], numeric, rtol=1e-6)
    assert np.all(grads[1][..., 1, :] == 0.0)  # masked key


def test_backward_float32_matches_float64() -> None:
    """float32 accumulation loses no more than ~1e-5 of each gradient's scale."""
    args = [a.astype(np.float32) for a in _inputs((2,), 10, 7, 3, True, True)]
    cot = [RNG.normal(size=args[2].shape), RNG.normal(size=args[3].shape)]
    cot = [c.astype(np.float32) for c in cot]
    single = gpu.backward("numpy", *args, 4, *cot)
    wide = [a.astype(np.float64) for a in args]
    double = gpu.backward("numpy", *wide, 4, *(c.astype(np.float64) for c in cot))
    for actual, expected in zip(single, double, strict=True):
        assert actual.dtype == np.float32
        _close(actual, expected, rtol=1e-5)


def test_backward_without_state_cotangent() -> None:
    args = _inputs((2,), 7, 5, 2, True, False)
    d_out = RNG.normal(size=args[2].shape)
    with_zeros = gpu.backward("numpy", *args, 3, d_out, np.zeros_like(args[3]))
    without = gpu.backward("numpy", *args, 3, d_out, None)
    for a, b in zip(with_zeros, without, strict=True):
        np.testing.assert_array_equal(a, b)


def _bad_calls() -> list:
    lq, lk, va, kv, mu = _inputs((2,), 5, 3, 2, False, False)
    return [
        pytest.param((lq, lk[:, :4], va, kv, mu, 4), ValueError, "log_phi_k", id="short-keys"),
        pytest.param((lq, lk, va[..., :2], kv, mu, 4), ValueError, "kv", id="width"),
        pytest.param((lq, lk, va, kv, mu[:1], 4), ValueError, "log_shift", id="state-batch"),
        pytest.param((lq, lk, va, kv, mu, 0), ValueError, "chunk_size", id="chunk0"),
        pytest.param((lq, lk, va, kv, mu, 2.0), TypeError, "chunk_size", id="chunk-float"),
        pytest.param((lq.astype(int), lk, va, kv, mu, 4), TypeError, "log_phi_q", id="int"),
        pytest.param((lq.tolist(), lk, va, kv, mu, 4), TypeError, "log_phi_q", id="list"),
        pytest.param((lq[0, 0, 0], lk, va, kv, mu, 4), TypeError, "log_phi_q", id="scalar"),
    ]


@pytest.mark.parametrize(("call", "error", "name"), _bad_calls())
def test_bad_input_is_rejected_before_any_launch(call, error, name, monkeypatch) -> None:
    def no_launch(*args, **kwargs):
        raise AssertionError("a kernel was launched")

    monkeypatch.setattr(host._Launcher, "__call__", no_launch)
    with pytest.raises(error, match=name):
        gpu.forward("numpy", *call)


def test_library_names() -> None:
    with pytest.raises(ValueError, match="library"):
        libraries.cuda_causal_kernel("jax")


# --------------------------------------------------------------------------------------
# Discovery: a kernel is available only when the driver AND the compiler are found.

_FOUND = ("/usr/lib/libx.so", "found via site-packages")


def _parts(**missing: str) -> dict[str, tuple[str | None, str]]:
    parts = {
        "numba-cuda": ("/site/numba_cuda/__init__.py", "version 0.30.4"),
        "driver": ("libcuda.so.1", "CUDA 13.0, 1 GPU(s)"),
        "nvvm": _FOUND,
        "libdevice": _FOUND,
        "nvrtc": _FOUND,
    }
    parts.update({part.replace("_", "-"): (None, why) for part, why in missing.items()})
    return parts


def test_describe_available_only_with_driver_nvvm_and_libdevice() -> None:
    assert _cuda.describe(_parts()) == "available"
    for part in ("nvvm", "libdevice"):
        said = _cuda.describe(_parts(**{part: "not found"}))
        assert said.startswith("CUDA kernels cannot compile"), said
        assert f"{part} not found" in said
        assert 'pip install "linattn[cuda13]"' in said  # the driver's CUDA major version
        assert "cuda12" not in said


def test_describe_picks_the_extra_of_the_driver_and_names_every_missing_part() -> None:
    cuda12 = {**_parts(libdevice="not found"), "driver": ("libcuda.so", "CUDA 12.8, 2 GPU(s)")}
    assert 'pip install "linattn[cuda12]"' in _cuda.describe(cuda12)
    said = _cuda.describe(_parts(driver="no CUDA driver or no GPU found", nvvm="not found"))
    assert said.startswith("numba-cuda installed, no CUDA driver"), said
    assert "nvvm not found" in said
    said = _cuda.describe(_parts(numba_cuda="not installed"))
    assert "linattn[cuda12]" in said and "linattn[cuda13]" in said


def test_a_failed_compiler_lookup_is_reported_as_missing(monkeypatch) -> None:
    """numba-cuda's get_cuda_paths fails as a whole (e.g. no NVRTC): nothing is available."""
    from numba.cuda import cuda_paths

    def lookup_fails():
        raise OSError("nvrtc load failed while inferring CUDA_HOME")

    monkeypatch.setattr(cuda_paths, "get_cuda_paths", lookup_fails)
    found = _cuda._compiler()
    assert found["nvvm"][0] is None and "nvrtc load failed" in found["nvvm"][1]
    assert found["libdevice"][0] is None
    said = _cuda.describe({**_parts(), **found})
    assert said.startswith("CUDA kernels cannot compile: nvvm not found"), said


def test_toolchain_reports_the_simulator() -> None:
    if not _cuda.SIMULATOR:
        pytest.skip("a real GPU: the toolchain holds paths, checked by the preflight")
    assert "simulator" in _cuda.toolchain()
    assert _cuda.status() == "available"


@pytest.mark.filterwarnings("error")
def test_launch_ignores_numba_cuda_performance_warnings(monkeypatch) -> None:
    """numba-cuda 0.30 warns with ``numba.cuda.core.errors.NumbaPerformanceWarning``
    (unrelated to numba's class) on small grids: it must not fail a launch."""
    errors = pytest.importorskip("numba.cuda.core.errors")

    class Kernel:
        def __getitem__(self, config):
            def launch(*args):
                import warnings

                warnings.warn(errors.NumbaPerformanceWarning("grid 1 under-fills"), stacklevel=2)

            return launch

    launcher = host._Launcher.__new__(host._Launcher)
    launcher.kernels = type("K", (), {"probe": Kernel()})()
    launcher.stream = 0
    launcher.library_view = lambda x: x
    launcher.views = {}
    launcher("probe", (1,), (1,))  # no RuntimeError
    assert errors.NumbaPerformanceWarning in _cuda.PERFORMANCE_WARNINGS


def test_state_rows_with_no_shift_are_empty_whatever_they_hold() -> None:
    """A state row whose log-shift is ``-inf`` is ``exp(-inf) S = 0``: its stored values
    change neither the outputs nor anything else, and its gradient is 0."""
    args = list(_inputs((2,), 9, 5, 2, True, False))  # feature 0: mu = -inf, kv row 0
    base = _forward(tuple(args), 4)
    args[3] = args[3].copy()
    args[3][..., 0, :] = 7.0
    for actual, expected in zip(_forward(tuple(args), 4), base, strict=True):
        np.testing.assert_array_equal(actual, expected)
    cot = (RNG.normal(size=args[2].shape), RNG.normal(size=args[3].shape))
    d_kv = gpu.backward("numpy", *args, 4, *cot)[3]
    assert np.all(d_kv[..., 0, :] == 0.0)
    assert np.all(d_kv[..., 1:, :] != 0.0)
