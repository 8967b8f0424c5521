"""torch CPU tensors with exact parts on the compiled kernels (the ``torch-kernels``
executor): the same outputs and gradients as the portable path, torch.compile without
graph breaks, and the plan's reasons where the detour is not taken."""

from __future__ import annotations

import pytest

import linattn as la

torch = pytest.importorskip("torch")
pytest.importorskip("linattn_numba.cpu.hybrid")

CASES = {
    # name: (causal, feature map?, options; "exact": exact keys 0 and 7)
    "causal-window-sinks-features": (True, True, {"window": 4, "sink_keys": 1}),
    "causal-window-sinks-no-map": (True, False, {"window": 4, "sink_keys": 2}),
    "bidirectional-window-sinks-exact-no-map": (False, False, {"window": 3, "exact": True}),
    "bidirectional-window-features": (False, True, {"window": 5, "sink_keys": 1}),
    "bidirectional-exact-keys-features": (False, True, {"exact": True}),
}


def inputs(causal: bool, seed: int = 0) -> tuple:
    generator = torch.Generator().manual_seed(seed)
    shape = (2, 3, 13, 8)
    q, k, v = (torch.randn(shape, dtype=torch.float64, generator=generator) for _ in range(3))
    key_mask = torch.rand(2, 1, 13, generator=generator) < 0.8
    key_mask[..., 0] = True
    exact = torch.zeros(2, 1, 13, dtype=torch.bool)
    exact[..., 0] = exact[..., 7] = True
    return q, k, v, (None if causal else key_mask), exact


@pytest.mark.parametrize("case", sorted(CASES))
def test_outputs_and_gradients_equal_the_portable_path(case: str) -> None:
    causal, with_map, options = CASES[case]
    options = dict(options)
    fm = la.FeatureMap(8, 16, kind="hyperbolic", seed=1) if with_map else None
    q, k, v, key_mask, exact = inputs(causal)
    if options.pop("exact", False):
        options = {**options, "exact_key_mask": exact}
    call = {"causal": causal, "key_mask": key_mask, **options}
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    portable = [x.clone().requires_grad_() for x in (q, k, v)]
    # (with a gradient: without one, the exact parts alone of so short a call run as
    # torch's attention, the dense-hybrid executor)
    assert la.plan_attention(*leaves, fm, **call).executor == "torch-kernels"
    out = la.linear_attention(*leaves, fm, **call)
    expected = la.linear_attention(*portable, fm, backend="array_api", **call)
    assert type(out) is torch.Tensor and out.dtype == torch.float64
    # float64 on both paths, different summation orders: rounding only
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
    g = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    grads = torch.autograd.grad((g * out).sum(), leaves)
    expected_grads = torch.autograd.grad((g * expected).sum(), portable)
    for a, b in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_float32_and_grouped_heads_keep_shapes_and_dtype() -> None:
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 11, 8, generator=generator)
    k, v = (torch.randn(2, 2, 11, 8, generator=generator) for _ in range(2))
    fm = la.FeatureMap(8, 16, kind="hyperbolic", seed=0)
    plan = la.plan_attention(q, k, v, fm, causal=True, window=3, sink_keys=1)
    assert plan.executor == "torch-kernels"
    out = la.linear_attention(q, k, v, fm, causal=True, window=3, sink_keys=1)
    expected = la.linear_attention(
        q, k, v, fm, causal=True, window=3, sink_keys=1, backend="array_api"
    )
    assert out.shape == (2, 4, 11, 8) and out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_compiles_without_graph_breaks() -> None:
    q, k, v, _, exact = inputs(causal=False, seed=4)
    fm = la.FeatureMap(8, 16, kind="hyperbolic", seed=0)

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return la.linear_attention(q, k, v, fm, window=3, sink_keys=1, exact_key_mask=exact)

    explained = torch._dynamo.explain(attention)(q, k, v)
    assert explained.graph_break_count == 0, explained.break_reasons
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    compiled = torch.compile(attention, fullgraph=True, backend="aot_eager")
    out = compiled(*leaves)
    torch.testing.assert_close(out, attention(q, k, v), rtol=0, atol=0)
    out.sum().backward()
    assert all(x.grad is not None and x.grad.shape == x.shape for x in leaves)


def test_the_plan_says_why_the_detour_is_not_taken() -> None:
    q, k, v, _, _ = inputs(causal=True)
    fm = la.FeatureMap(8, 16, kind="hyperbolic", seed=0)
    plan = la.plan_attention(q, k, v, fm, causal=True, window=3, return_state=True)
    assert dict(plan.rejected)["torch-kernels"].startswith("a state is asked for")
    plan = la.plan_attention(q, k, v, fm, causal=True, window=3, backend="array_api")
    assert dict(plan.rejected)["torch-kernels"] == "backend='array_api'"
    plan = la.plan_attention(q, k, v, fm, causal=True)
    assert dict(plan.rejected)["torch-kernels"] == "no window, sink keys or exact keys"


def test_the_operator_passes_opcheck() -> None:
    """Schema, fake tensors, autograd registration and AOT dispatch agree."""
    q, k, v, key_mask, exact = inputs(causal=False, seed=5)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    fm = la.FeatureMap(8, 16, kind="hyperbolic", seed=0)
    la.linear_attention(*leaves, fm, window=3, key_mask=key_mask)  # registers the map
    arguments = (*leaves, key_mask, exact, fm.fingerprint, False, 3, 1, None, None, None)
    results = torch.library.opcheck(torch.ops.linattn.exact_parts_forward.default, arguments)
    assert set(results.values()) == {"SUCCESS"}, results


def test_a_fresh_process_compiles_before_any_eager_call() -> None:
    """The operators register on import, outside the traced code (a registration from
    inside it fails), and the map is found by its fingerprint."""
    import subprocess
    import sys

    program = """
import torch, linattn as la
q, k, v = (torch.randn(2, 3, 9, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
fm = la.FeatureMap(8, 16, kind="hyperbolic", seed=0)
attention = lambda q, k, v: la.linear_attention(q, k, v, fm, window=4, sink_keys=1)
out = torch.compile(attention, fullgraph=True, backend="aot_eager")(q, k, v)
expected = la.linear_attention(q, k, v, fm, window=4, sink_keys=1, backend="array_api")
torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
"""
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
