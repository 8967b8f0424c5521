"""torch CPU tensors on the fused bidirectional pass: NumPy views, autograd, torch.compile."""

from __future__ import annotations

import numpy as np
import pytest

import linattn as la
from linattn import _dispatch

torch = pytest.importorskip("torch")
bd = pytest.importorskip("linattn_numba.cpu.bidirectional")
from linattn_numba import torch_ops as _torch  # noqa: E402


def tensors(dtype: torch.dtype = torch.float64, seed: int = 0) -> tuple:
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 3, 300, 16, dtype=dtype, generator=generator)
    k = torch.randn(2, 1, 260, 16, dtype=dtype, generator=generator)  # shared by heads
    v = torch.randn(2, 1, 260, 8, dtype=dtype, generator=generator)
    mask = torch.rand(2, 1, 260, generator=generator) < 0.7
    return q, k, v, mask


def test_forward_equals_numpy_pass() -> None:
    fm = la.FeatureMap(16, 32, kind="hyperbolic", seed=0)
    q, k, v, mask = tensors()
    out = _dispatch.fused_bidirectional(q, k, v, fm, mask)
    expected, _, _ = bd.favor_bidirectional(
        q.numpy(), k.numpy(), v.numpy(), fm.projection, hyperbolic=True, scale=fm.scale,
        key_mask=mask.numpy(),
    )  # fmt: skip
    assert isinstance(out, torch.Tensor) and out.shape == (2, 3, 300, 8)
    np.testing.assert_array_equal(out.numpy(), expected)


def test_front_door_on_torch_tensors_matches_array_api() -> None:
    fm = la.FeatureMap(16, 32, seed=1)
    q, k, v, mask = tensors(torch.float32)
    expected = la.linear_attention(q, k, v, fm, key_mask=mask, backend="array_api")
    assert la.plan_attention(q, k, v, fm, key_mask=mask).executor == "fused-bidirectional"
    out = _dispatch.fused_bidirectional(q, k, v, fm, mask)
    # float32 sums of ~260 terms: a few 1e-7 relative, well inside 1e-5
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_autograd_equals_array_api_autograd() -> None:
    fm = la.FeatureMap(16, 32, seed=2)
    q, k, v, mask = (x.requires_grad_() if x.is_floating_point() else x for x in tensors())
    g = torch.randn(2, 3, 300, 8, dtype=torch.float64)
    fused = torch.autograd.grad((g * _dispatch.fused_bidirectional(q, k, v, fm, mask)).sum(),
                                (q, k, v))  # fmt: skip
    portable = la.linear_attention(q, k, v, fm, key_mask=mask, backend="array_api")
    expected = torch.autograd.grad((g * portable).sum(), (q, k, v))
    for a, b, x in zip(fused, expected, (q, k, v), strict=True):
        assert a.shape == x.shape  # summed over the heads that share k and v
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11)


def test_gradcheck_against_finite_differences() -> None:
    fm = la.FeatureMap(4, 6, kind="hyperbolic", seed=3)
    generator = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 5, 4, dtype=torch.float64, generator=generator,
                           requires_grad=True) for _ in range(3))  # fmt: skip
    projection = torch.tensor(fm.projection)

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return _torch.bidirectional(q, k, v, projection, None, True, fm.scale)

    assert torch.autograd.gradcheck(attention, (q, k, v))


def test_compiles_without_graph_breaks() -> None:
    fm = la.FeatureMap(16, 32, seed=5)
    q, k, v, mask = tensors(torch.float32)
    projection = torch.tensor(fm.projection, dtype=torch.float32)
    q.requires_grad_()

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return 2 * _torch.bidirectional(q, k, v, projection, mask, False, fm.scale)

    compiled = torch.compile(attention, fullgraph=True, backend="aot_eager")
    out = compiled(q, k, v)
    torch.testing.assert_close(out, attention(q, k, v), rtol=0, atol=0)
    (grad,) = torch.autograd.grad(out.sum(), q)
    (expected,) = torch.autograd.grad(attention(q, k, v).sum(), q)
    torch.testing.assert_close(grad, expected, rtol=0, atol=0)


def test_front_door_compiles_without_graph_breaks_or_warnings() -> None:
    """``linear_attention`` itself (the map's projection becomes a tensor inside the
    compiled region: no copy-construct warning, which ``filterwarnings = error`` raises)."""
    fm = la.FeatureMap(16, 32, seed=5)
    q, k, v, mask = tensors(torch.float32)

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return la.linear_attention(q, k, v, fm, key_mask=mask)

    assert torch._dynamo.explain(attention)(q, k, v).graph_break_count == 0
    compiled = torch.compile(attention, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v), attention(q, k, v), rtol=0, atol=0)


def test_non_cpu_tensors_are_refused() -> None:
    q = torch.zeros(1, 3, 4)
    with pytest.raises(TypeError, match=r"v must be a torch CPU tensor; got numpy\.ndarray"):
        _torch.bidirectional(q, q, np.zeros((1, 3, 4)), torch.zeros(2, 4), None, False, 1.0)


def test_second_derivatives_refused() -> None:
    q = torch.randn(1, 3, 4, dtype=torch.float64, requires_grad=True)
    out = _torch.bidirectional(q, q, q, torch.ones(2, 4, dtype=torch.float64), None, False, 1.0)
    (grad,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(NotImplementedError, match="second derivatives"):
        grad.sum().backward()
