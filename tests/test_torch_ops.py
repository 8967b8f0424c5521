"""The Numba kernels as torch custom operators: registration, compile, torch.func.

``torch.ops.linattn.causal_forward`` / ``causal_backward`` must pass
``torch.library.opcheck``; ``torch.compile(fullgraph=True)`` must capture a causal
front-door call in one graph, cold, and recompile at most once across sequence
lengths with ``dynamic=True``; gradients (eager, compiled, ``torch.func``) must equal
those of the array-API path; ``vmap`` and second derivatives must refuse clearly.
(Compiled calls use the ``aot_eager`` backend: it runs the fake and autograd
registrations as inductor does, without compiling C++.)
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("numba")

import linattn as la  # noqa: E402
from linattn_numba import torch_ops as ops  # noqa: E402

F64 = torch.float64
# Kernel and array-API path in float64: the same sums in another order.
RTOL, ATOL = 1e-10, 1e-12


def _operands(
    batch: int = 2, length: int = 11, m: int = 8, dv: int = 3, dtype: torch.dtype = F64
) -> tuple[torch.Tensor, ...]:
    """Kernel inputs with a non-empty incoming state and one masked key (``-inf``)."""
    gen = torch.Generator().manual_seed(length)
    lq, lk = (torch.randn(batch, length, m, generator=gen, dtype=dtype) for _ in range(2))
    lk[0, 3] = -torch.inf
    values = torch.randn(batch, length, dv, generator=gen, dtype=dtype)
    va = torch.cat([values, torch.ones(batch, length, 1, dtype=dtype)], -1)
    kv = torch.rand(batch, m, dv + 1, generator=gen, dtype=dtype)
    mu = torch.randn(batch, m, generator=gen, dtype=dtype)
    return lq, lk, va, kv, mu


def _qkv(length: int = 24, requires_grad: bool = False) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(length)
    return tuple(
        (0.5 * torch.randn(2, 3, length, 8, generator=gen, dtype=F64)).requires_grad_(
            requires_grad
        )
        for _ in range(3)
    )


FM = la.FeatureMap(8, 16, kind="positive", seed=0)
WEIGHTS = torch.randn(2, 3, 24, 8, generator=torch.Generator().manual_seed(5), dtype=F64)


def _loss(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str) -> torch.Tensor:
    """A causal call continued from a state (the state's ``log_shift`` carries gradient
    on the array-API path), with a key mask: every input of the kernel matters."""
    mask = torch.arange(q.shape[-2]) % 5 != 3
    head, state = la.linear_attention(
        q[..., :10, :], k[..., :10, :], v[..., :10, :], FM, causal=True,
        key_mask=mask[:10], return_state=True, chunk_size=4, backend=backend,
    )  # fmt: skip
    tail = la.linear_attention(
        q[..., 10:, :], k[..., 10:, :], v[..., 10:, :], FM, causal=True,
        key_mask=mask[10:], state=state, chunk_size=4, backend=backend,
    )  # fmt: skip
    return (torch.cat([head, tail], -2) * WEIGHTS).sum()


def _array_api_gradients(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    return torch.autograd.grad(_loss(*leaves, "array_api"), leaves)


def _assert_close(actual: tuple, expected: tuple) -> None:
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=RTOL, atol=ATOL)


# -- the operators --------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_opcheck_forward(dtype: torch.dtype) -> None:
    args = [x.requires_grad_() for x in _operands(dtype=dtype)]
    torch.library.opcheck(torch.ops.linattn.causal_forward.default, (*args, 4))


def test_opcheck_backward() -> None:
    lq, lk, va, kv, mu = _operands()
    d_out, d_kv = torch.randn_like(va), torch.randn_like(kv)
    torch.library.opcheck(
        torch.ops.linattn.causal_backward.default, (lq, lk, va, kv, mu, 4, d_out, d_kv)
    )


def test_operator_gradients_include_the_incoming_log_shift() -> None:
    """``d mu = sum_e dS * S``: the kernel's state stands for ``S exp(mu)``."""
    args = [x.requires_grad_() for x in _operands()]

    def invariant(*args: torch.Tensor) -> torch.Tensor:
        out, kv, mu = torch.ops.linattn.causal_forward(*args, 4)
        return (out[..., :-1] / out[..., -1:]).sum() + (kv * torch.exp(mu)[..., None]).sum()

    assert torch.autograd.gradcheck(invariant, args)


def test_operators_do_not_mutate_their_inputs() -> None:
    inputs = _operands()
    before = [x.clone() for x in inputs]
    outputs = torch.ops.linattn.causal_forward(*inputs, 4)
    for x, y in zip(inputs, before, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)
    assert all(o.is_contiguous() for o in outputs)
    assert not any(o.data_ptr() == x.data_ptr() for o in outputs for x in inputs)


def test_cuda_implementations_are_registered_without_a_gpu() -> None:
    for name in ("linattn::causal_forward", "linattn::causal_backward"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CUDA"), name


# -- torch.compile --------------------------------------------------------------------

COLD = """
import json, sys, warnings
warnings.filterwarnings("ignore")
import numpy as np
import linattn as la
fm = la.FeatureMap(8, 16, seed=0)
x = np.random.default_rng(0).normal(size=(2, 24, 8))
la.linear_attention(x, x, x, fm, causal=True, backend="numba")
lazy = {m: m in sys.modules for m in ("torch", "linattn_numba.torch_ops")}
import torch
q, k, v = (torch.randn(2, 24, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
def f(q, k, v):
    return la.linear_attention(q, k, v, fm, causal=True, chunk_size=8, backend="numba")
explained = torch._dynamo.explain(f)(q, k, v)
torch._dynamo.reset()
compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
compiled(q, k, v).sum().backward()
grads = [t.grad.clone() for t in (q, k, v)]
for t in (q, k, v):
    t.grad = None
f(q, k, v).sum().backward()
print(json.dumps({
    "graphs": explained.graph_count,
    "breaks": explained.graph_break_count,
    "reasons": [str(r.reason) for r in explained.break_reasons],
    "grads_equal": all(torch.equal(a, t.grad) for a, t in zip(grads, (q, k, v))),
    "imported_before_torch": lazy,
    "cuda_imported": [m for m in ("numba.cuda", "linattn_numba.gpu") if m in sys.modules],
}))
"""


def test_front_door_compiles_cold_in_one_graph() -> None:
    """A fresh process: the first causal call on torch tensors is under ``torch.compile``.

    (Before the custom operators: a crash inside Numba's dispatcher cold, 9 graphs and
    8 breaks warm.)  Also: a NumPy call imports neither torch nor the operators, and
    registering them imports no CUDA.
    """
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(COLD)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert (result["graphs"], result["breaks"]) == (1, 0), result["reasons"]
    assert result["grads_equal"]
    assert result["imported_before_torch"] == {"torch": False, "linattn_numba.torch_ops": False}
    assert result["cuda_imported"] == []


def test_dynamic_shapes_recompile_at_most_once() -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()

    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return la.linear_attention(q, k, v, FM, causal=True, backend="numba")

    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend="aot_eager")
    for length in (256, 512, 1024):
        q, k, v = _qkv(length, requires_grad=True)
        compiled(q, k, v).sum().backward()
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])


def test_compiled_gradients_equal_the_array_api_path() -> None:
    torch._dynamo.reset()
    q, k, v = _qkv(requires_grad=True)
    compiled = torch.compile(
        lambda q, k, v: _loss(q, k, v, "numba"), fullgraph=True, backend="aot_eager"
    )
    _assert_close(torch.autograd.grad(compiled(q, k, v), (q, k, v)), _array_api_gradients(q, k, v))


def test_eager_gradients_equal_the_array_api_path() -> None:
    q, k, v = _qkv(requires_grad=True)
    grads = torch.autograd.grad(_loss(q, k, v, "numba"), (q, k, v))
    _assert_close(grads, _array_api_gradients(q, k, v))


# -- torch.func -----------------------------------------------------------------------


def test_torch_func_grad_equals_the_array_api_path() -> None:
    q, k, v = _qkv()
    grads = torch.func.grad(_loss, argnums=(0, 1, 2))(q, k, v, "numba")
    _assert_close(grads, _array_api_gradients(q, k, v))


def test_torch_func_vjp_equals_the_array_api_path() -> None:
    q, k, v = _qkv()
    loss, pullback = torch.func.vjp(lambda q, k, v: _loss(q, k, v, "numba"), q, k, v)
    torch.testing.assert_close(loss, _loss(q, k, v, "array_api"), rtol=RTOL, atol=ATOL)
    _assert_close(pullback(torch.ones_like(loss)), _array_api_gradients(q, k, v))


def test_vmap_raises_not_implemented_naming_linattn() -> None:
    q, k, v = _qkv()
    # (FM's kind is computed in the fused pass: its operator is the one called)
    with pytest.raises(NotImplementedError, match="vmap over linattn::causal_fused_forward"):
        torch.func.vmap(lambda q: la.linear_attention(q, k[0], v[0], FM, causal=True))(q)


def test_vmap_of_the_operator_itself_raises_naming_linattn() -> None:
    lq, lk, va, kv, mu = _operands()
    with pytest.raises(NotImplementedError, match="vmap over linattn::causal_forward"):
        torch.func.vmap(lambda lq: torch.ops.linattn.causal_forward(lq, lk, va, kv, mu, 4))(
            lq[None]
        )


def test_second_derivatives_raise_naming_linattn() -> None:
    q, k, v = _qkv()
    with pytest.raises(NotImplementedError, match="linattn::causal_backward"):
        torch.func.grad(lambda q: torch.func.grad(_loss)(q, k, v, "numba").sum())(q)


def test_wrong_tensors_are_named() -> None:
    lq, lk, va, kv, mu = _operands()
    with pytest.raises(TypeError, match=r"kv must be a torch CPU tensor; got numpy\.ndarray"):
        ops.causal("cpu", lq, lk, va, kv.numpy(), mu, 4)
    with pytest.raises(TypeError, match="chunk_size must be a positive integer"):
        ops.causal("cpu", lq, lk, va, kv, mu, 4.0)


def test_numpy_chunk_size_is_accepted() -> None:
    lq, lk, va, kv, mu = _operands()
    out, _, _ = ops.causal("cpu", lq, lk, va, kv, mu, np.int64(4))
    torch.testing.assert_close(out, torch.ops.linattn.causal_forward(lq, lk, va, kv, mu, 4)[0])
