"""The kernels' log-normaliser: ``log sum_j phi(q_t) . phi(k_j)`` over the keys row ``t`` sees.

What the window/sink hybrid merges its partials with (as flash attention merges
``(output, log-sum-exp)`` pairs): ``numpy_forward(..., return_log_scale=True)`` (and the
torch operator) returns each row's log-scale, so that ``log(outputs_aug[..., -1]) +
log_scale`` is the log-normaliser; ``favor_causal(..., return_log_normaliser=True)``
returns it directly.  The reference is a dense log-sum-exp of the feature map's
log-features over visible keys, incoming state's keys included.

Tolerances: float64 outputs meet 1e-10 relative (``tests/test_kernels_cpu.py``), so a
log meets 1e-10 absolute; float32's 1e-5 relative holds for the denominator, and the
log adds one rounding of ``F + R + log(den)``, within ``1e-5 (1 + |lse|)``.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

pytest.importorskip("numba")

import linattn as la
from linattn_numba import cpu

ATOL = {"float64": 1e-10, "float32": 1e-5}
CHUNKS = (1, 3, 64)
D, M, L, PREFIX = 8, 16, 37, 11


def logsumexp(x: np.ndarray, axis: tuple[int, ...]) -> np.ndarray:
    """``log sum exp`` over ``axis``; ``-inf`` where every term is (no NaN)."""
    top = np.max(x, axis=axis, keepdims=True)
    safe = np.where(np.isfinite(top), top, 0)
    with np.errstate(divide="ignore"):
        total = np.log(np.sum(np.exp(x - safe), axis=axis, keepdims=True)) + safe
    return np.squeeze(total, axis=axis)


def reference_lse(lq: np.ndarray, lk: np.ndarray, offset: int) -> np.ndarray:
    """``logsumexp_{j <= t + offset, r} (l(q_t) + l(k_j))_r``: ``lk`` holds ``offset``
    earlier keys (an incoming state's) before the call's; masked keys are ``-inf``."""
    pair = lq[..., :, None, :] + lk[..., None, :, :]  # (..., L, offset + L, m)
    t = np.arange(lq.shape[-2])[:, None]
    j = np.arange(lk.shape[-2])[None, :]
    pair = np.where((j <= t + offset)[..., None], pair, -np.inf)
    return logsumexp(pair, axis=(-2, -1))


def draw(seed: int, dtype: str, kind: str = "positive") -> tuple[la.FeatureMap, tuple]:
    """A feature map and ``(q, k, v, key_mask)`` for ``PREFIX + L`` tokens, batch (2, 3).

    Keys 0..2 of the call (after the prefix) and about a third of the rest are masked;
    the prefix's first key too, so a prefixless call has queries that see no key.
    """
    rng = np.random.default_rng(seed)
    fm = la.FeatureMap(D, M, kind=kind, seed=seed)
    n = PREFIX + L
    q, k, v = (0.7 * rng.normal(size=(2, 3, n, D)) for _ in range(3))
    q[..., 5, :] *= 6  # a large query: a large shift F
    k[..., PREFIX + 9, :] *= 6  # a large key: a large running maximum R
    mask = rng.random((2, 3, n)) > 0.3
    mask[..., PREFIX : PREFIX + 3] = False
    mask[..., 0] = False
    return fm, (*tuple(x.astype(dtype) for x in (q, k, v)), mask)


def kernel_operands(fm: la.FeatureMap, q, k, v, mask) -> tuple[np.ndarray, ...]:
    lq = fm.signed_log_features(q)[0]
    lk = np.where(mask[..., None], fm.signed_log_features(k)[0], -np.inf).astype(q.dtype)
    va = np.concatenate([np.where(mask[..., None], v, 0), np.ones_like(v[..., :1])], axis=-1)
    return lq, lk, va


def empty_state(dtype: str) -> tuple[np.ndarray, np.ndarray]:
    return np.zeros((2, 3, M, D + 1), dtype), np.full((2, 3, M), -np.inf, dtype)


def check_lse(actual: np.ndarray, expected: np.ndarray, dtype: str) -> None:
    assert actual.shape == expected.shape and actual.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(np.isneginf(actual), np.isneginf(expected))
    finite = np.isfinite(expected)
    error = np.abs(actual[finite] - expected[finite]) / (1 + np.abs(expected[finite]))
    assert float(np.max(error)) <= ATOL[dtype], float(np.max(error))


def kernel_lse(lq, lk, va, kv, mu, chunk):
    out, kv_out, mu_out, log_scale = cpu.numpy_forward(
        lq, lk, va, kv, mu, chunk, return_log_scale=True
    )
    with np.errstate(divide="ignore"):
        return out, kv_out, mu_out, np.log(out[..., -1]) + log_scale


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("with_state", [False, True])
def test_unfused_log_scale_gives_the_log_normaliser(
    dtype: str, chunk: int, with_state: bool
) -> None:
    fm, (q, k, v, mask) = draw(0, dtype)
    lq, lk, va = kernel_operands(fm, q, k, v, mask)
    kv, mu = empty_state(dtype)
    start = PREFIX if with_state else 0
    if with_state:  # the prefix's keys reach the call through the state only
        _, kv, mu = cpu.numpy_forward(lq[..., :PREFIX, :], lk[..., :PREFIX, :],
                                      va[..., :PREFIX, :], kv, mu, chunk)  # fmt: skip
    call = (x[..., start:, :] for x in (lq, lk, va))
    out, kv_out, mu_out, lse = kernel_lse(*call, kv, mu, chunk)
    expected = reference_lse(lq[..., start:, :].astype("float64"), lk.astype("float64"), start)
    check_lse(lse, expected, dtype)
    if not with_state:  # the masked first key: query 0 sees nothing
        assert np.all(np.isneginf(lse[..., 0])) and np.all(out[..., 0, -1] == 0)
    # The option changes nothing else, bit for bit.
    plain = cpu.numpy_forward(*(x[..., start:, :] for x in (lq, lk, va)), kv, mu, chunk)
    for got, ref in zip((out, kv_out, mu_out), plain, strict=True):
        np.testing.assert_array_equal(got, ref)
    assert len(plain) == 3


@pytest.mark.parametrize("kind", ["positive", "hyperbolic"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("with_state", [False, True])
def test_fused_log_normaliser(kind: str, dtype: str, chunk: int, with_state: bool) -> None:
    fm, (q, k, v, mask) = draw(1, dtype, kind)
    lq, lk, _ = kernel_operands(fm, q, k, v, mask)
    assert fm.projection is not None
    common = {"hyperbolic": kind == "hyperbolic", "scale": fm.scale, "chunk_size": chunk}
    kv, mu = empty_state(dtype)
    start = PREFIX if with_state else 0
    if with_state:
        _, kv, mu = cpu.favor_causal(
            q[..., :PREFIX, :], k[..., :PREFIX, :], v[..., :PREFIX, :], fm.projection,
            key_mask=mask[..., :PREFIX], kv=kv, log_shift=mu, **common,
        )  # fmt: skip
    call = [x[..., start:, :] for x in (q, k, v)]
    args = (*call, fm.projection)
    state = dict(key_mask=mask[..., start:], kv=kv, log_shift=mu, **common)
    out, kv_out, mu_out, lse = cpu.favor_causal(*args, **state, return_log_normaliser=True)
    expected = reference_lse(lq[..., start:, :].astype("float64"), lk.astype("float64"), start)
    check_lse(lse, expected, dtype)
    plain = cpu.favor_causal(*args, **state)
    assert len(plain) == 3
    for got, ref in zip((out, kv_out, mu_out), plain, strict=True):
        np.testing.assert_array_equal(got, ref)


def test_log_scale_broadcasts_no_batch_and_empty_length() -> None:
    rng = np.random.default_rng(3)
    lq, lk = rng.normal(size=(2, 5, 4))
    va = np.ones((5, 2))
    kv, mu = np.zeros((4, 2)), np.full(4, -np.inf)
    _, _, _, lse = kernel_lse(lq, lk, va, kv, mu, 2)
    check_lse(lse, reference_lse(lq, lk, 0), "float64")
    *_, log_scale = cpu.numpy_forward(lq[:0], lk[:0], va[:0], kv, mu, 2, return_log_scale=True)
    assert log_scale.shape == (0,)


# -- gradients of sum(a * o) + sum(b * lse) -------------------------------------------


def loss_inputs(seed: int):
    """float64 operands of ``PREFIX + L`` tokens whose every query sees a key (a finite
    ``lse``), with masked keys; the kernel's for the last ``L`` (the prefix reaches them
    as an incoming state); cotangents ``a`` (outputs) and ``b`` (lse)."""
    fm, (q, k, v, mask) = draw(seed, "float64")
    mask[..., 0] = True  # every query sees the prefix's first key through the state
    full = kernel_operands(fm, q, k, v, mask)
    kv, mu = empty_state("float64")
    _, kv, mu = cpu.numpy_forward(*(x[..., :PREFIX, :] for x in full), kv, mu, 4)
    rng = np.random.default_rng(seed + 100)
    a, b = rng.normal(size=(2, 3, L, D)), rng.normal(size=(2, 3, L))
    return full, (*tuple(x[..., PREFIX:, :] for x in full), kv, mu), a, b


def loss(inputs, chunk: int, a, b) -> float:
    out, _, _, lse = kernel_lse(*inputs, chunk)
    return float(np.sum(a * out[..., :-1] / out[..., -1:]) + np.sum(b * lse))


def kernel_gradients(inputs, chunk: int, a, b):
    """The kernel backward with the hybrid's cotangent ``[a / den, (b - a . o) / den]``."""
    out = cpu.numpy_forward(*inputs, chunk)[0]
    den = out[..., -1:]
    o = out[..., :-1] / den
    d_out = np.concatenate([a / den, (b[..., None] - np.sum(a * o, -1, keepdims=True)) / den], -1)
    return cpu.numpy_backward(*inputs, chunk, d_out, np.zeros_like(inputs[3]))


@pytest.mark.parametrize("chunk", CHUNKS)
def test_backward_matches_central_differences(chunk: int) -> None:
    _, inputs, a, b = loss_inputs(4)
    grads = kernel_gradients(inputs, chunk, a, b)
    rng = np.random.default_rng(5)
    for i, name in enumerate(("lq", "lk", "va", "kv")):
        direction = rng.normal(size=inputs[i].shape)
        if name == "lk":
            direction[np.isneginf(inputs[1])] = 0  # masked keys stay masked
        if name == "va":
            direction[..., -1] = 0  # the ones column is not a variable
        if name == "kv":
            direction[np.isneginf(inputs[4])] = 0  # empty state rows hold nothing
        eps = 1e-5
        moved = [list(inputs), list(inputs)]
        moved[0][i] = inputs[i] + eps * direction
        moved[1][i] = inputs[i] - eps * direction
        numeric = (loss(moved[0], chunk, a, b) - loss(moved[1], chunk, a, b)) / (2 * eps)
        analytic = float(np.sum(grads[i] * direction))
        # central differences: error O(eps^2 f''') plus rounding 1e-16 |f| / eps.
        assert abs(numeric - analytic) <= 1e-6 * (1 + abs(analytic)), (name, numeric, analytic)


def dense_torch_loss(torch, lq, lk, va, prefix, a, b):
    """The loss from a dense softmax-form reference (no kernel): keys ``prefix`` of them
    earlier than the queries, masked where ``lk`` is ``-inf`` (selected out after a
    finite stand-in: a log-sum-exp of only ``-inf`` has a NaN gradient)."""
    seen = torch.isfinite(lk[..., None, :, 0])
    lk = torch.where(torch.isfinite(lk), lk, 0.0)
    pair = torch.logsumexp(lq[..., :, None, :] + lk[..., None, :, :], dim=-1)
    t = torch.arange(lq.shape[-2])[:, None]
    j = torch.arange(lk.shape[-2])[None, :]
    pair = torch.where((j <= t + prefix) & seen, pair, -torch.inf)
    lse = torch.logsumexp(pair, dim=-1)
    o = torch.softmax(pair, dim=-1) @ va[..., :-1]
    return (torch.tensor(a) * o).sum() + (torch.tensor(b) * lse).sum()


@pytest.mark.parametrize("chunk", CHUNKS)
def test_backward_and_torch_op_match_a_dense_reference(chunk: int) -> None:
    torch = pytest.importorskip("torch")
    from linattn_numba import torch_ops as _torch

    full, inputs, a, b = loss_inputs(6)
    # Reference: autograd through the dense formula over prefix + call keys, gradients
    # for the call's tokens only (the prefix reaches the kernel as a constant state).
    leaves = [torch.tensor(x[..., PREFIX:, :], requires_grad=True) for x in full]
    lk_all = torch.cat([torch.tensor(full[1][..., :PREFIX, :]), leaves[1]], dim=-2)
    va_all = torch.cat([torch.tensor(full[2][..., :PREFIX, :]), leaves[2]], dim=-2)
    ref = torch.autograd.grad(
        dense_torch_loss(torch, leaves[0], lk_all, va_all, PREFIX, a, b), leaves
    )
    ref = [r.numpy() for r in ref]
    got = kernel_gradients(inputs, chunk, a, b)
    # The torch operator: log(den) + log_scale through autograd.
    tensors = [torch.tensor(x, requires_grad=i < 3) for i, x in enumerate(inputs)]
    out, _, _, scale = _torch.causal("cpu", *tensors, chunk, return_log_scale=True)
    assert not scale.requires_grad  # a stabiliser
    o, lse = out[..., :-1] / out[..., -1:], torch.log(out[..., -1]) + scale
    value = (torch.tensor(a) * o).sum() + (torch.tensor(b) * lse).sum()
    via_op = [g.numpy() for g in torch.autograd.grad(value, tensors[:3])]
    for name, g_kernel, g_op, r in zip(("lq", "lk", "va"), got, via_op, ref, strict=False):
        if name == "va":  # the ones column's cotangent is the denominator's: not compared
            g_kernel, g_op = g_kernel[..., :-1], g_op[..., :-1]
            r = r[..., :-1]
        scale_ = float(np.max(np.abs(r)))
        assert float(np.max(np.abs(g_kernel - r))) <= 1e-10 * scale_, name
        assert float(np.max(np.abs(g_op - r))) <= 1e-10 * scale_, name


# -- the CUDA kernels (the simulator, NUMBA_ENABLE_CUDASIM=1, or a GPU) ---------------


def cuda_or_skip():
    if importlib.util.find_spec("numba_cuda") is None:
        pytest.skip("numba-cuda is not installed")
    from linattn_numba.gpu import target as _cuda

    if _cuda.status() != "available":
        pytest.skip(f"CUDA kernels cannot run here ({_cuda.status()}); NUMBA_ENABLE_CUDASIM=1")
    from linattn_numba import gpu

    return gpu


@pytest.mark.parametrize("design", ["kernels", "blas"])
@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("with_state", [False, True])
def test_cuda_log_scale_gives_the_log_normaliser(design: str, chunk: int, with_state: bool):
    """Small sizes (the simulator runs a thread per element) that cross its tile (4)."""
    gpu = cuda_or_skip()
    rng = np.random.default_rng(7)
    prefix, length, m, dv = 3, 9, 5, 2
    lq, lk = (rng.normal(size=(2, prefix + length, m)) - 1 for _ in range(2))
    lq[:, 4] += 5  # a large shift F
    lk[:, prefix + 6] += 5  # a large running maximum
    lk[:, [0, prefix, prefix + 1, prefix + 5]] = -np.inf  # masked; query 0 sees nothing
    va = np.concatenate(
        [rng.normal(size=(2, prefix + length, dv)), np.ones((2, prefix + length, 1))], -1
    )
    kv, mu = np.zeros((2, m, dv + 1)), np.full((2, m), -np.inf)
    start = prefix if with_state else 0
    if with_state:
        _, kv, mu = cpu.numpy_forward(lq[:, :prefix], lk[:, :prefix], va[:, :prefix], kv, mu, 2)
    call = (lq[:, start:], lk[:, start:], va[:, start:], kv, mu, chunk)
    out, kv_out, mu_out, log_scale = gpu.forward("numpy", *call, design, return_log_scale=True)
    with np.errstate(divide="ignore"):
        lse = np.log(out[..., -1]) + log_scale
    check_lse(lse, reference_lse(lq[:, start:], lk, start), "float64")
    plain = gpu.forward("numpy", *call, design)
    assert len(plain) == 3
    for got, ref in zip((out, kv_out, mu_out), plain, strict=True):
        np.testing.assert_array_equal(got, ref)


# -- the torch operator's registration ------------------------------------------------


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_torch_opcheck_scaled(dtype: str) -> None:
    """Schema, fake (``torch.compile``) and autograd registration of the new operator."""
    torch = pytest.importorskip("torch")
    from linattn_numba import torch_ops  # noqa: F401  (registers the operators)

    _, inputs, _, _ = loss_inputs(8)
    args = [torch.tensor(x.astype(dtype)[:1, :1, :9]) for x in inputs[:3]]
    args += [torch.tensor(x.astype(dtype)[:1, :1]) for x in inputs[3:]]
    for x in args[:4]:
        x.requires_grad_()
    torch.library.opcheck(torch.ops.linattn.causal_forward_scaled.default, (*args, 4))


def test_torch_compile_scaled_matches_eager() -> None:
    torch = pytest.importorskip("torch")
    from linattn_numba import torch_ops as _torch

    _, inputs, _, _ = loss_inputs(9)
    tensors = [torch.tensor(x) for x in inputs]

    def lse(*xs):
        out, _, _, scale = _torch.causal("cpu", *xs, 3, return_log_scale=True)
        return torch.log(out[..., -1]) + scale

    compiled = torch.compile(lse, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(*tensors), lse(*tensors), rtol=0, atol=0)
