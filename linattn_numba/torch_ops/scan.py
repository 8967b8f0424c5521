"""The kernel contract as torch custom operators: ``torch.ops.linattn.causal_forward``,
``causal_forward_scaled`` and ``causal_backward``, on CPU and CUDA tensors (the module
docstring of :mod:`linattn_numba.torch_ops` says how they behave).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from linattn_numba import _contract
from linattn_numba.torch_ops.support import (
    NAMESPACE,
    Grads,
    compute_dtype,
    for_torch_func,
    fresh_like,
    no_double_backward,
    no_setup,
    no_vmap,
)

__all__ = ["causal", "causal_backward", "causal_forward", "causal_forward_scaled"]


def causal(
    device_type: str,
    lq: Any,
    lk: Any,
    va: Any,
    kv: Any,
    mu: Any,
    chunk_size: Any,
    *,
    return_log_scale: bool = False,
) -> tuple[Tensor, ...]:
    """``causal_forward`` (``causal_forward_scaled`` with ``return_log_scale``) after
    checking that every input is a tensor on ``device_type`` (``TypeError`` naming the
    first that is not) and that ``chunk_size`` is an integer."""
    for name, x in zip(_contract.INPUTS, (lq, lk, va, kv, mu), strict=True):
        if not isinstance(x, Tensor) or x.device.type != device_type:
            device = getattr(x, "device", None)
            got = f"{type(x).__module__}.{type(x).__name__}" + (f" on {device}" if device else "")
            raise TypeError(f"{name} must be a torch {device_type.upper()} tensor; got {got}")
    chunk = _contract.check_chunk_size(chunk_size)  # (the operator takes a Python int)
    op, function = (
        (torch.ops.linattn.causal_forward_scaled, _CausalScaled)
        if return_log_scale
        else (torch.ops.linattn.causal_forward, _Causal)
    )
    if torch.compiler.is_compiling():
        return op(lq, lk, va, kv, mu, chunk)  # opaque to it
    return function.apply(lq, lk, va, kv, mu, chunk)  # (the same, as torch.func needs it)


@torch.library.custom_op(f"{NAMESPACE}::causal_forward", mutates_args=(), device_types="cpu")
def causal_forward(
    log_phi_q: Tensor,
    log_phi_k: Tensor,
    values_aug: Tensor,
    kv: Tensor,
    log_shift: Tensor,
    chunk_size: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(outputs_aug, kv_out, log_shift_out)``: the kernel contract of ``linattn_numba``."""
    return _cpu_forward(log_phi_q, log_phi_k, values_aug, kv, log_shift, chunk_size)


@torch.library.custom_op(
    f"{NAMESPACE}::causal_forward_scaled", mutates_args=(), device_types="cpu"
)
def causal_forward_scaled(
    log_phi_q: Tensor,
    log_phi_k: Tensor,
    values_aug: Tensor,
    kv: Tensor,
    log_shift: Tensor,
    chunk_size: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(outputs_aug, kv_out, log_shift_out, log_scale)``: ``causal_forward`` and each
    row's log-scale ``(*batch, L)`` (``linattn_numba.cpu.causal.numpy_forward``)."""
    return _cpu_forward(
        log_phi_q, log_phi_k, values_aug, kv, log_shift, chunk_size, return_log_scale=True
    )


@torch.library.custom_op(f"{NAMESPACE}::causal_backward", mutates_args=(), device_types="cpu")
def causal_backward(
    log_phi_q: Tensor,
    log_phi_k: Tensor,
    values_aug: Tensor,
    kv: Tensor,
    log_shift: Tensor,
    chunk_size: int,
    d_outputs_aug: Tensor,
    d_kv: Tensor,
) -> Grads:
    """``(d_log_phi_q, d_log_phi_k, d_values_aug, d_kv_in)``, stabilisers held constant."""
    return _cpu_backward(
        log_phi_q, log_phi_k, values_aug, kv, log_shift, chunk_size, d_outputs_aug, d_kv
    )


def _cpu_forward(
    lq: Any, lk: Any, va: Any, kv: Any, mu: Any, chunk_size: int, return_log_scale: bool = False
) -> Any:
    """:func:`linattn_numba.cpu.causal.numpy_forward` on NumPy views of CPU tensors; results
    are fresh tensors."""
    from linattn_numba.cpu.causal import numpy_forward

    lq, lk, va, kv, mu = (x.detach().numpy() for x in (lq, lk, va, kv, mu))
    results = numpy_forward(lq, lk, va, kv, mu, chunk_size, return_log_scale=return_log_scale)
    return tuple(torch.from_numpy(r) for r in results)


def _cpu_backward(
    lq: Any, lk: Any, va: Any, kv: Any, mu: Any, chunk_size: int, d_out: Any, d_kv: Any
) -> Any:
    """:func:`linattn_numba.cpu.causal.numpy_backward` on NumPy views of CPU tensors;
    results are fresh tensors."""
    from linattn_numba.cpu.causal import numpy_backward

    lq, lk, va, kv, mu, d_out, d_kv = (
        x.detach().numpy() for x in (lq, lk, va, kv, mu, d_out, d_kv)
    )
    grads = numpy_backward(lq, lk, va, kv, mu, chunk_size, d_out, d_kv)
    return tuple(torch.from_numpy(g) for g in grads)


# The CUDA implementations: linattn_numba.gpu.host, imported (with numba-cuda) when the
# first CUDA tensor arrives, so that registering needs neither.


@causal_forward.register_kernel("cuda")
def _cuda_forward(*args: Any) -> tuple[Any, ...]:
    """The CUDA implementation of ``torch.ops.linattn.causal_forward``."""
    from linattn_numba.gpu import host

    return host.forward("torch", *args)


@causal_forward_scaled.register_kernel("cuda")
def _cuda_forward_scaled(*args: Any) -> tuple[Any, ...]:
    """The CUDA implementation of ``torch.ops.linattn.causal_forward_scaled``."""
    from linattn_numba.gpu import host

    return host.forward("torch", *args, return_log_scale=True)


@causal_backward.register_kernel("cuda")
def _cuda_backward(*args: Any) -> tuple[Any, Any, Any, Any]:
    """The CUDA implementation of ``torch.ops.linattn.causal_backward``."""
    from linattn_numba.gpu import host

    return host.backward("torch", *args)


# -- what torch.compile sees: shapes and dtypes only -----------------------------------


@causal_forward.register_fake
def _fake_forward(lq: Tensor, lk: Tensor, va: Tensor, kv: Tensor, mu: Tensor, chunk: int) -> Any:
    dtype = compute_dtype(lq)
    return fresh_like(va, dtype), fresh_like(kv, dtype), fresh_like(mu, dtype)


@causal_forward_scaled.register_fake
def _fake_forward_scaled(
    lq: Tensor, lk: Tensor, va: Tensor, kv: Tensor, mu: Tensor, chunk: int
) -> Any:
    log_scale = va.new_empty(va.shape[:-1], dtype=compute_dtype(lq))
    return (*_fake_forward(lq, lk, va, kv, mu, chunk), log_scale)


@causal_backward.register_fake
def _fake_backward(lq: Tensor, lk: Tensor, va: Tensor, kv: Tensor, *rest: Any) -> Any:
    dtype = compute_dtype(lq)
    return tuple(fresh_like(x, dtype) for x in (lq, lk, va, kv))


# -- autograd -------------------------------------------------------------------------


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
    *tensors, chunk_size = inputs
    ctx.save_for_backward(*tensors)
    ctx.chunk_size = chunk_size
    ctx.mark_non_differentiable(*output[2:])  # log_shift (and log_scale): stabilisers


def _backward(
    ctx: Any, d_out: Tensor, d_kv: Tensor, *_d_stabilisers: Tensor | None
) -> tuple[Tensor | None, ...]:
    lq, lk, va, kv, mu = ctx.saved_tensors
    grads = _CausalBackward.apply(lq, lk, va, kv, mu, ctx.chunk_size, d_out, d_kv)
    needed = ctx.needs_input_grad
    d_mu = (grads[3] * kv).sum(-1) if needed[4] else None  # S exp(mu) is the state
    return (*(g if needed[i] else None for i, g in enumerate(grads)), d_mu, None)


causal_forward.register_autograd(_backward, setup_context=_setup_context)
causal_forward_scaled.register_autograd(_backward, setup_context=_setup_context)


causal_backward.register_autograd(no_double_backward, setup_context=no_setup)


# -- the same operators in the form torch.func accepts -------------------------------


_Causal = for_torch_func(causal_forward, _setup_context, _backward)
_CausalScaled = for_torch_func(causal_forward_scaled, _setup_context, _backward)
_CausalBackward = for_torch_func(causal_backward, no_setup, no_double_backward)
causal_forward.register_vmap(no_vmap("causal_forward"))
causal_forward_scaled.register_vmap(no_vmap("causal_forward_scaled"))
causal_backward.register_vmap(no_vmap("causal_backward"))
