"""torch CPU tensors on the fused causal pass: NumPy views, autograd, torch.compile."""

from __future__ import annotations

import concurrent.futures
import math

import array_api_compat
import numpy as np
import pytest

import linattn as la
from linattn import _dispatch
from linattn import causal as causal_path

torch = pytest.importorskip("torch")
fc = pytest.importorskip("linattn_numba.cpu.fused_causal")
fcb = pytest.importorskip("linattn_numba.cpu.fused_causal_backward")
from linattn_numba import _machinery  # noqa: E402
from linattn_numba import torch_ops as _torch  # noqa: E402

#: float64 against float64 autograd of the array-API path: the same sums in another
#: order (a few ulp per product, a few hundred terms), relative to each head's largest
#: entry; float32 against float64 is bounded by float32 rounding of those sums.
RTOL = {torch.float64: 1e-11, torch.float32: 2e-5}


def tensors(dtype: torch.dtype = torch.float64, seed: int = 0, length: int = 300) -> tuple:
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 3, length, 16, dtype=dtype, generator=generator)
    k = torch.randn(2, 1, length, 16, dtype=dtype, generator=generator)  # shared by heads
    v = torch.randn(2, 1, length, 8, dtype=dtype, generator=generator)
    mask = torch.rand(2, 3, length, generator=generator) < 0.7
    mask[0, 0, :3] = False  # a fully masked start: rows that see no key
    return q, k, v, mask


def head_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float) -> None:
    """``|a - e| <= rtol * max |e|`` over each head (the last two axes)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    actual, expected = actual.detach(), expected.detach()
    scale = expected.abs().amax(dim=(-2, -1), keepdim=True)
    error = (actual - expected).abs() / torch.where(scale == 0, 1, scale)
    assert float(error.max()) <= rtol, f"head-relative error {float(error.max()):.3g} > {rtol}"


def leaves(*xs: torch.Tensor) -> list[torch.Tensor]:
    return [x.clone().requires_grad_() if x.is_floating_point() else x for x in xs]


def test_plan_takes_the_fused_pass_for_cpu_tensors() -> None:
    fm = la.FeatureMap(16, 32, seed=0)
    x = torch.zeros(2, 4, 16)
    assert _dispatch.causal_plan(x, fm).fused
    assert not _dispatch.causal_plan(x, fm, backend="array_api").fused
    assert not _dispatch.causal_plan(x, la.FeatureMap(16, 32, kind="trigonometric")).fused


@pytest.mark.parametrize("kind", ["positive", "hyperbolic"])
def test_forward_equals_numpy_fused_pass(kind: str) -> None:
    fm = la.FeatureMap(16, 32, kind=kind, seed=1)
    q, k, v, mask = tensors(torch.float32)
    out, state = la.linear_attention(q, k, v, fm, causal=True, key_mask=mask, chunk_size=16,
                                     return_state=True)  # fmt: skip
    expected, expected_state = la.linear_attention(
        q.numpy(), k.numpy(), v.numpy(), fm, causal=True, key_mask=mask.numpy(), chunk_size=16,
        return_state=True,
    )  # fmt: skip
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    np.testing.assert_array_equal(out.numpy(), expected)  # the same kernel, bit for bit
    np.testing.assert_array_equal(state.kv.detach().numpy(), expected_state.kv)
    np.testing.assert_array_equal(state.log_shift.numpy(), expected_state.log_shift)
    portable = la.linear_attention(q, k, v, fm, causal=True, key_mask=mask, chunk_size=16,
                                   backend="array_api")  # fmt: skip
    head_close(out, portable, RTOL[torch.float32])


@pytest.mark.parametrize("kind", ["positive", "hyperbolic"])
def test_autograd_equals_array_api_autograd(kind: str) -> None:
    fm = la.FeatureMap(16, 32, kind=kind, seed=2)
    q, k, v, mask = leaves(*tensors())
    g = torch.randn(2, 3, 300, 8, dtype=torch.float64)
    options = {"causal": True, "key_mask": mask, "chunk_size": 32}
    fused = la.linear_attention(q, k, v, fm, **options)
    grads = torch.autograd.grad((g * fused).sum(), (q, k, v))
    portable = la.linear_attention(q, k, v, fm, backend="array_api", **options)
    expected = torch.autograd.grad((g * portable).sum(), (q, k, v))
    head_close(fused, portable, RTOL[torch.float64])
    for a, b, x in zip(grads, expected, (q, k, v), strict=True):
        assert a.shape == x.shape  # summed over the heads that share k and v
        head_close(a, b, RTOL[torch.float64])


def test_float32_gradients_equal_float64_array_api() -> None:
    fm = la.FeatureMap(16, 32, seed=3)
    q, k, v, mask = leaves(*tensors(torch.float32))
    g = torch.randn(2, 3, 300, 8)
    out = la.linear_attention(q, k, v, fm, causal=True, key_mask=mask)
    grads = torch.autograd.grad((g * out).sum(), (q, k, v))
    wide = leaves(*(x.detach().double() if x.is_floating_point() else x for x in (q, k, v, mask)))
    portable = la.linear_attention(*wide[:3], fm, causal=True, key_mask=mask, backend="array_api")
    expected = torch.autograd.grad((g.double() * portable).sum(), wide[:3])
    for a, b in zip(grads, expected, strict=True):
        assert a.dtype == torch.float32
        head_close(a.double(), b, RTOL[torch.float32])


def test_masked_keys_get_no_gradient() -> None:
    fm = la.FeatureMap(16, 32, seed=4)
    q, k, v, _ = tensors()
    k, v = (x.expand(2, 3, *x.shape[2:]).clone().requires_grad_() for x in (k, v))
    mask = torch.rand(2, 3, 300, generator=torch.Generator().manual_seed(5)) < 0.5
    out = la.linear_attention(q, k, v, fm, causal=True, key_mask=mask)
    dk, dv = torch.autograd.grad(out.square().sum(), (k, v))
    assert torch.all(dk[~mask] == 0) and torch.all(dv[~mask] == 0)
    assert torch.all(dk[mask].abs().sum(-1) > 0)


def test_state_in_and_out_whole_equals_pieces() -> None:
    fm = la.FeatureMap(16, 32, kind="hyperbolic", seed=6)
    q, k, v, mask = leaves(*tensors(length=200))
    g = torch.randn(2, 3, 200, 8, dtype=torch.float64)

    def pieces(backend: str) -> torch.Tensor:
        outs, state = [], None
        for t0, t1 in ((0, 70), (70, 71), (71, 200)):
            out, state = la.linear_attention(
                q[..., t0:t1, :], k[..., t0:t1, :], v[..., t0:t1, :], fm, causal=True,
                key_mask=mask[..., t0:t1], state=state, return_state=True, chunk_size=16,
                backend=backend,
            )  # fmt: skip
            outs.append(out)
        return torch.cat(outs, dim=-2)

    whole = la.linear_attention(q, k, v, fm, causal=True, key_mask=mask, chunk_size=16)
    fused, portable = pieces("auto"), pieces("array_api")
    head_close(fused, whole, RTOL[torch.float64])
    head_close(fused, portable, RTOL[torch.float64])
    grads = torch.autograd.grad((g * fused).sum(), (q, k, v))
    for a, b in zip(grads, torch.autograd.grad((g * portable).sum(), (q, k, v)), strict=True):
        head_close(a, b, RTOL[torch.float64])
    for a, b in zip(grads, torch.autograd.grad((g * whole).sum(), (q, k, v)), strict=True):
        head_close(a, b, RTOL[torch.float64])


@pytest.mark.parametrize("hyperbolic", [False, True])
def test_log_normaliser_and_state_gradients_equal_array_api(hyperbolic: bool) -> None:
    """The operator's four outputs with cotangents on the outputs, the log-normaliser and
    (through a second call, shift-invariantly) the final state, and gradients for the
    incoming state ``(kv, log_shift)`` too."""
    fm = la.FeatureMap(16, 32, kind="hyperbolic" if hyperbolic else "positive", seed=7)
    q, k, v, mask = tensors(length=90)
    k, v = k.expand(2, 3, 90, 16), v.expand(2, 3, 90, 8)
    generator = torch.Generator().manual_seed(8)
    mu = torch.randn(2, 3, 32, dtype=torch.float64, generator=generator)
    mu[..., 0] = -math.inf
    kv = torch.rand(2, 3, 32, 9, dtype=torch.float64, generator=generator)
    kv = kv * mu.isfinite()[..., None]
    g = torch.randn(2, 3, 90, 8, dtype=torch.float64, generator=generator)
    g_lse = torch.randn(2, 3, 90, dtype=torch.float64, generator=generator)
    projection = torch.tensor(fm.projection)
    inputs = leaves(q, k, v, kv, mu)

    def fused(q, k, v, kv, mu, first=60) -> torch.Tensor:
        options = (hyperbolic, fm.scale)
        a, b = slice(None, first), slice(first, None)
        out, kv1, mu1, lse = _torch.causal_fused(
            q[..., a, :], k[..., a, :], v[..., a, :], projection, mask[..., a], kv,
            mu, *options, 16,
        )  # fmt: skip
        tail = _torch.causal_fused(
            q[..., b, :], k[..., b, :], v[..., b, :], projection, mask[..., b], kv1,
            mu1, *options, 7,
        )  # fmt: skip
        outs = torch.cat([out, tail[0]], -2)
        return (g * outs).sum() + (g_lse * torch.cat([lse, tail[3]], -1)).nan_to_num(0, 0, 0).sum()

    def portable(q, k, v, kv, mu, first=60) -> torch.Tensor:
        xp = array_api_compat.array_namespace(q)
        k, v = (torch.where(mask[..., None], x, 0.0) for x in (k, v))
        lq = fm.log_features(q)
        lk = torch.where(mask[..., None], fm.log_features(k), -math.inf)
        va = torch.cat([v, torch.ones_like(v[..., :1])], -1)
        outs, lses = [], []
        for t0, t1, chunk in ((0, first, 16), (first, 90, 7)):
            rows, kv, mu, log_scale = causal_path.causal(
                xp, lq[..., t0:t1, :], None, lk[..., t0:t1, :], None, va[..., t0:t1, :],
                kv, mu, chunk, return_log_scale=True,
            )  # fmt: skip
            outs.append(causal_path.normalise(xp, rows))
            lses.append(torch.log(rows[..., -1]) + log_scale)
        return (g * torch.cat(outs, -2)).sum() + (g_lse * torch.cat(lses, -1)).nan_to_num(
            0, 0, 0
        ).sum()

    grads = torch.autograd.grad(fused(*inputs), inputs)
    expected = torch.autograd.grad(portable(*inputs), inputs)
    assert torch.isclose(fused(*inputs), portable(*inputs), rtol=1e-12)
    for a, b in zip(grads, expected, strict=True):
        head_close(a, b, RTOL[torch.float64])


def test_gradcheck_against_finite_differences() -> None:
    fm = la.FeatureMap(4, 6, kind="hyperbolic", seed=9)
    generator = torch.Generator().manual_seed(10)
    q, k, v = (torch.randn(2, 7, 4, dtype=torch.float64, generator=generator,
                           requires_grad=True) for _ in range(3))  # fmt: skip
    kv = torch.rand(2, 6, 5, dtype=torch.float64, generator=generator).requires_grad_()
    mu = torch.randn(2, 6, dtype=torch.float64, generator=generator).requires_grad_()
    projection = torch.tensor(fm.projection)

    def attention(q, k, v, kv, mu) -> tuple:
        out, _, _, lse = _torch.causal_fused(q, k, v, projection, None, kv, mu, True,
                                                  fm.scale, 3)  # fmt: skip
        return out, lse

    assert torch.autograd.gradcheck(attention, (q, k, v, kv, mu))


def test_chunk_size_changes_rounding_only() -> None:
    fm = la.FeatureMap(16, 32, seed=11)
    q, k, v, mask = leaves(*tensors(length=150))
    results = []
    for chunk in (1, 13, 64, 150):
        out = la.linear_attention(q, k, v, fm, causal=True, key_mask=mask, chunk_size=chunk)
        results.append((out, *torch.autograd.grad(out.square().sum(), (q, k, v))))
    for other in results[1:]:
        for a, b in zip(other, results[0], strict=True):
            head_close(a, b, RTOL[torch.float64])


def test_torch_func_grad_and_vjp() -> None:
    fm = la.FeatureMap(16, 32, seed=12)
    q, k, v, mask = tensors(length=40)

    def loss(q: torch.Tensor) -> torch.Tensor:
        return la.linear_attention(q, k, v, fm, causal=True, key_mask=mask).square().sum()

    grad = torch.func.grad(loss)(q)
    leaf = q.clone().requires_grad_()
    (expected,) = torch.autograd.grad(loss(leaf), leaf)
    torch.testing.assert_close(grad, expected, rtol=0, atol=0)


def test_compiles_without_graph_breaks() -> None:
    fm = la.FeatureMap(16, 32, seed=13)
    q, k, v, mask = tensors(torch.float32)
    q.requires_grad_()

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return 2 * la.linear_attention(q, k, v, fm, causal=True, key_mask=mask)

    explanation = torch._dynamo.explain(attention)(q, k, v)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(attention, fullgraph=True, backend="aot_eager")
    out = compiled(q, k, v)
    torch.testing.assert_close(out, attention(q, k, v), rtol=0, atol=0)
    (grad,) = torch.autograd.grad(out.sum(), q)
    (expected,) = torch.autograd.grad(attention(q, k, v).sum(), q)
    torch.testing.assert_close(grad, expected, rtol=0, atol=0)


def test_vmap_refused() -> None:
    fm = la.FeatureMap(4, 8, seed=14)
    x = torch.randn(2, 5, 4)
    with pytest.raises(NotImplementedError, match="vmap over linattn::causal_fused_forward"):
        torch.func.vmap(lambda q: la.linear_attention(q, q, q, fm, causal=True))(x)


def test_second_derivatives_refused() -> None:
    q = torch.randn(1, 3, 4, dtype=torch.float64, requires_grad=True)
    w, kv, mu = torch.ones(2, 4, dtype=torch.float64), torch.zeros(1, 2, 5), torch.zeros(1, 2)
    out = _torch.causal_fused(q, q, q, w, None, kv.double(), mu.double(), False, 1.0, 2)[0]
    (grad,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(NotImplementedError, match="second derivatives"):
        grad.sum().backward()


def test_bad_inputs_are_refused_before_the_kernel() -> None:
    q, w = torch.zeros(2, 5, 4), torch.zeros(3, 4)
    kv, mu = torch.zeros(2, 3, 5), torch.zeros(2, 3)
    with pytest.raises(TypeError, match=r"kv must be a torch CPU tensor; got numpy\.ndarray"):
        _torch.causal_fused(q, q, q, w, None, kv.numpy(), mu, False, 1.0, 4)
    with pytest.raises(TypeError, match=r"chunk_size must be a positive integer; got 1\.5"):
        _torch.causal_fused(q, q, q, w, None, kv, mu, False, 1.0, 1.5)
    with pytest.raises(ValueError, match=r"kv must have shape \(\*batch, 3, 5\)"):
        _torch.causal_fused(q, q, q, w, None, kv[..., :4], mu, False, 1.0, 4)
    with pytest.raises(ValueError, match=r"k must have shape \(\.\.\., 5, d\) like q"):
        _torch.causal_fused(q, q[:, :4], q[:, :4], w, None, kv, mu, False, 1.0, 4)
    with pytest.raises(TypeError, match="key_mask must have dtype bool"):
        _torch.causal_fused(q, q, q, w, torch.ones(2, 5), kv, mu, False, 1.0, 4)
    with pytest.raises(ValueError, match=r"projection must have shape \(rows, 4\)"):
        _torch.causal_fused(q, q, q, torch.zeros(3, 5), None, kv, mu, False, 1.0, 4)


def test_parallel_and_serial_twins_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    fm = la.FeatureMap(16, 32, seed=15)
    q, k, v, mask = tensors(torch.float32)

    def run() -> tuple:
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        out = la.linear_attention(*x, fm, causal=True, key_mask=mask)
        return (out, *torch.autograd.grad(out.square().sum(), x))

    monkeypatch.setattr(_machinery, "SERIAL_WORK", 2**62)
    serial = run()
    monkeypatch.setattr(_machinery, "SERIAL_WORK", 0)
    monkeypatch.setattr(_machinery, "threads", lambda: 2)
    before = (fc._forward_fused.launches["parallel"], fcb._backward.launches["parallel"])
    parallel = run()
    after = (fc._forward_fused.launches["parallel"], fcb._backward.launches["parallel"])
    assert after == (before[0] + 1, before[1] + 1)
    for a, b in zip(serial, parallel, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_calls_from_threads_agree() -> None:
    """Concurrent calls (a thread pool, as a data loader or a server has) give the results
    of one call alone: the kernels share no buffers."""
    fm = la.FeatureMap(16, 32, seed=16)
    q, k, v, mask = tensors(torch.float32, length=200)

    def run(seed: int) -> tuple:
        x = [t.clone().mul_(1 + seed / 10).requires_grad_() for t in (q, k, v)]
        out = la.linear_attention(*x, fm, causal=True, key_mask=mask)
        return (out, *torch.autograd.grad(out.square().sum(), x))

    alone = [run(seed) for seed in range(4)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        together = list(pool.map(run, range(4)))
    for a, b in zip(alone, together, strict=True):
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_hybrid_on_torch_tensors_matches_array_api() -> None:
    """The hybrid's far part takes the fused pass too (its log-normaliser differentiable)."""
    fm = la.FeatureMap(16, 32, seed=17)
    q, k, v, mask = leaves(*tensors(length=120))
    options = {"causal": True, "key_mask": mask, "window": 16, "sink_keys": 2}
    out = la.linear_attention(q, k, v, fm, **options)
    portable = la.linear_attention(q, k, v, fm, backend="array_api", **options)
    head_close(out, portable, RTOL[torch.float64])
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    expected = torch.autograd.grad(portable.square().sum(), (q, k, v))
    for a, b in zip(grads, expected, strict=True):
        head_close(a, b, RTOL[torch.float64])


def test_default_chunk_follows_the_backward() -> None:
    """``chunk_size=None``: the CPU forward chunk without gradients, the backward's 64
    when torch will differentiate (bit for bit the explicit calls; the two differ)."""
    fm = la.FeatureMap(16, 32, seed=13)
    q, k, v, _ = tensors(torch.float32, length=150)
    own, backward = _dispatch.CPU_FORWARD_CHUNK_SIZE, _dispatch.DEFAULT_CHUNK_SIZE

    def run(*xs: torch.Tensor, **options: int) -> torch.Tensor:
        return la.linear_attention(*xs, fm, causal=True, **options).detach()

    plain = run(q, k, v)
    assert torch.equal(plain, run(q, k, v, chunk_size=own))
    assert not torch.equal(plain, run(q, k, v, chunk_size=backward))
    graded = leaves(q, k, v)
    assert torch.equal(run(*graded), run(*graded, chunk_size=backward))
    with torch.no_grad():
        assert torch.equal(run(*graded), plain)
