"""The fused CPU passes as torch custom operators (features computed in the pass):
``torch.ops.linattn.bidirectional_forward`` / ``bidirectional_backward`` and
``causal_fused_forward`` / ``causal_fused_backward`` (the module docstring of
:mod:`linattn_numba.torch_ops` says how they behave).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from linattn_numba import _contract
from linattn_numba.torch_ops.support import (
    NAMESPACE,
    Grads,
    as_numpy,
    compute_dtype,
    for_torch_func,
    no_double_backward,
    no_setup,
    no_vmap,
)

__all__ = [
    "BIDIRECTIONAL_INPUTS",
    "CAUSAL_FUSED_INPUTS",
    "bidirectional",
    "bidirectional_backward",
    "bidirectional_forward",
    "causal_fused",
    "causal_fused_backward",
    "causal_fused_forward",
]


# -- the fused bidirectional pass (features included) ---------------------------------

BIDIRECTIONAL_INPUTS = ("q", "k", "v", "projection", "key_mask")


def bidirectional(
    q: Any, k: Any, v: Any, projection: Any, key_mask: Any, hyperbolic: bool, scale: float
) -> Tensor:
    """Normalised bidirectional FAVOR+ outputs from ``linattn::bidirectional_forward``,
    differentiable in ``q``, ``k`` and ``v`` through ``linattn::bidirectional_backward``.

    Every input must be a CPU tensor (``key_mask`` may be ``None``): ``TypeError`` names
    the first that is not.  The tensors reach the kernel as NumPy views (no copy when
    contiguous and of the compute dtype).
    """
    for name, x in zip(BIDIRECTIONAL_INPUTS, (q, k, v, projection, key_mask), strict=True):
        if x is None and name == "key_mask":
            continue
        if not isinstance(x, Tensor) or x.device.type != "cpu":
            device = getattr(x, "device", None)
            got = f"{type(x).__module__}.{type(x).__name__}" + (f" on {device}" if device else "")
            raise TypeError(f"{name} must be a torch CPU tensor; got {got}")
    args = (q, k, v, projection, key_mask, bool(hyperbolic), float(scale))
    if torch.compiler.is_compiling():
        return torch.ops.linattn.bidirectional_forward(*args)[0]  # opaque to it
    return _Bidirectional.apply(*args)[0]


@torch.library.custom_op(
    f"{NAMESPACE}::bidirectional_forward", mutates_args=(), device_types="cpu"
)
def bidirectional_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    projection: Tensor,
    key_mask: Tensor | None,
    hyperbolic: bool,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(outputs, kv, log_shift)``: ``linattn_numba.bidirectional.favor_bidirectional``."""
    from linattn_numba.cpu import bidirectional

    results = bidirectional.favor_bidirectional(
        *(as_numpy(x) for x in (q, k, v, projection)),
        hyperbolic=hyperbolic,
        scale=scale,
        key_mask=as_numpy(key_mask),
    )
    tensors: Any = tuple(torch.from_numpy(r) for r in results)  # a fixed-length tuple
    return tensors


@torch.library.custom_op(
    f"{NAMESPACE}::bidirectional_backward", mutates_args=(), device_types="cpu"
)
def bidirectional_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    projection: Tensor,
    key_mask: Tensor | None,
    hyperbolic: bool,
    scale: float,
    kv: Tensor,
    log_shift: Tensor,
    outputs: Tensor,
    grad_output: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` over the broadcast batch shape, stabilisers held constant."""
    from linattn_numba.cpu import bidirectional

    grads = bidirectional.favor_bidirectional_backward(
        *(as_numpy(x) for x in (q, k, v, projection, kv, log_shift, outputs, grad_output)),
        hyperbolic=hyperbolic,
        scale=scale,
        key_mask=as_numpy(key_mask),
    )
    tensors: Any = tuple(torch.from_numpy(g) for g in grads)  # a fixed-length tuple
    return tensors


def _bidirectional_batch(q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None) -> Any:
    shapes = [q.shape[:-2], k.shape[:-2], v.shape[:-2]]
    return torch.broadcast_shapes(*shapes, *([] if key_mask is None else [key_mask.shape[:-1]]))


@bidirectional_forward.register_fake
def _fake_bidirectional(
    q: Tensor, k: Tensor, v: Tensor, projection: Tensor, key_mask: Tensor | None, hyperbolic: bool,
    scale: float,
) -> Any:  # fmt: skip
    dtype = compute_dtype(q)
    batch = _bidirectional_batch(q, k, v, key_mask)
    m, dv = projection.shape[0] * (2 if hyperbolic else 1), v.shape[-1]
    return (
        q.new_empty((*batch, q.shape[-2], dv), dtype=dtype),
        q.new_empty((*batch, m, dv + 1), dtype=dtype),
        q.new_empty((*batch, m), dtype=dtype),
    )


@bidirectional_backward.register_fake
def _fake_bidirectional_backward(
    q: Tensor, k: Tensor, v: Tensor, projection: Tensor, key_mask: Tensor | None, *rest: Any
) -> Any:
    dtype = compute_dtype(q)
    batch = _bidirectional_batch(q, k, v, key_mask)
    return tuple(q.new_empty((*batch, *x.shape[-2:]), dtype=dtype) for x in (q, k, v))


def _bidirectional_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
    q, k, v, projection, key_mask, hyperbolic, scale = inputs
    out, kv, log_shift = output
    ctx.save_for_backward(q, k, v, projection, key_mask, kv, log_shift, out)
    ctx.options = (hyperbolic, scale)
    ctx.mark_non_differentiable(kv, log_shift)  # (the state: its gradient is not served)


def _bidirectional_grads(
    ctx: Any, d_out: Tensor, _d_kv: Tensor | None, _d_log_shift: Tensor | None
) -> tuple[Tensor | None, ...]:
    q, k, v, projection, key_mask, kv, log_shift, out = ctx.saved_tensors
    hyperbolic, scale = ctx.options
    d_out = d_out.to(out.dtype).contiguous()
    grads = _BidirectionalBackward.apply(
        q, k, v, projection, key_mask, hyperbolic, scale, kv, log_shift, out, d_out
    )
    needed = ctx.needs_input_grad
    summed = [
        g.sum_to_size(x.shape).to(x.dtype) if needed[i] else None
        for i, (g, x) in enumerate(zip(grads, (q, k, v), strict=True))
    ]
    return (*summed, None, None, None, None)


bidirectional_forward.register_autograd(_bidirectional_grads, setup_context=_bidirectional_setup)
bidirectional_backward.register_autograd(no_double_backward, setup_context=no_setup)
_Bidirectional = for_torch_func(bidirectional_forward, _bidirectional_setup, _bidirectional_grads)
_BidirectionalBackward = for_torch_func(bidirectional_backward, no_setup, no_double_backward)
bidirectional_forward.register_vmap(no_vmap("bidirectional_forward"))
bidirectional_backward.register_vmap(no_vmap("bidirectional_backward"))


# -- the fused causal pass (features included) ----------------------------------------

CAUSAL_FUSED_INPUTS = ("q", "k", "v", "projection", "key_mask", "kv", "log_shift")


def causal_fused(
    q: Any,
    k: Any,
    v: Any,
    projection: Any,
    key_mask: Any,
    kv: Any,
    log_shift: Any,
    hyperbolic: bool,
    scale: float,
    chunk_size: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Causal FAVOR+ from ``linattn::causal_fused_forward``: ``(outputs, kv, log_shift,
    log_normaliser)``, differentiable in ``q``, ``k``, ``v``, the incoming state and
    through ``outputs``, ``kv`` and ``log_normaliser`` by ``linattn::causal_fused_backward``.

    Every input must be a CPU tensor (``key_mask`` may be ``None``): ``TypeError`` names
    the first that is not.  The tensors reach the kernel as NumPy views (no copy when
    contiguous and of the compute dtype); no ``L x m`` array is made, forward or backward
    (:mod:`linattn_numba.cpu.fused_causal`).  ``log_shift`` out is a stabiliser
    (non-differentiable, as for ``causal_forward``).

    Examples
    --------
    >>> import torch
    >>> from linattn_numba import torch_ops
    >>> x = torch.zeros(1, 3, 2); w = torch.eye(2, dtype=torch.float64)
    >>> v = torch.arange(6.0).reshape(1, 3, 2).requires_grad_()
    >>> kv, mu = torch.zeros(1, 2, 3), torch.full((1, 2), -torch.inf)
    >>> out, kv_out, mu_out, lse = torch_ops.causal_fused(x, x, v, w, None, kv, mu, False, 1.0, 2)
    >>> out[0, :, 0].tolist()  # equal features: a running mean
    [0.0, 1.0, 2.0]
    >>> out[..., 0].sum().backward()
    >>> [round(g, 6) for g in v.grad[0, :, 0].tolist()]  # value t reaches outputs s >= t
    [1.833333, 0.833333, 0.333333]
    """
    for name, x in zip(
        CAUSAL_FUSED_INPUTS, (q, k, v, projection, key_mask, kv, log_shift), strict=True
    ):
        if x is None and name == "key_mask":
            continue
        if not isinstance(x, Tensor) or x.device.type != "cpu":
            device = getattr(x, "device", None)
            got = f"{type(x).__module__}.{type(x).__name__}" + (f" on {device}" if device else "")
            raise TypeError(f"{name} must be a torch CPU tensor; got {got}")
    chunk = _contract.check_chunk_size(chunk_size)  # (the operator takes a Python int)
    args = (q, k, v, projection, key_mask, kv, log_shift, bool(hyperbolic), float(scale), chunk)
    if torch.compiler.is_compiling():
        return torch.ops.linattn.causal_fused_forward(*args)  # opaque to it
    return _CausalFused.apply(*args)  # (the same, as torch.func needs it)


@torch.library.custom_op(f"{NAMESPACE}::causal_fused_forward", mutates_args=(), device_types="cpu")
def causal_fused_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    projection: Tensor,
    key_mask: Tensor | None,
    kv: Tensor,
    log_shift: Tensor,
    hyperbolic: bool,
    scale: float,
    chunk_size: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(outputs, kv, log_shift, log_normaliser)``: ``linattn_numba.cpu.fused_causal.forward``."""
    from linattn_numba.cpu import fused_causal

    results = fused_causal.forward(
        *(as_numpy(x) for x in (q, k, v, projection, kv, log_shift)),
        hyperbolic=hyperbolic,
        scale=scale,
        key_mask=as_numpy(key_mask),
        chunk_size=chunk_size,
    )
    tensors: Any = tuple(torch.from_numpy(r) for r in results)  # a fixed-length tuple
    return tensors


@torch.library.custom_op(
    f"{NAMESPACE}::causal_fused_backward", mutates_args=(), device_types="cpu"
)
def causal_fused_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    projection: Tensor,
    key_mask: Tensor | None,
    kv: Tensor,
    log_shift: Tensor,
    hyperbolic: bool,
    scale: float,
    chunk_size: int,
    outputs: Tensor,
    grad_output: Tensor,
    grad_log_normaliser: Tensor,
    grad_kv: Tensor,
) -> Grads:
    """``(dq, dk, dv, d_kv)`` over the broadcast batch shape, stabilisers held constant."""
    from linattn_numba.cpu import fused_causal_backward

    grads = fused_causal_backward.backward(
        *(as_numpy(x) for x in (q, k, v, projection, kv, log_shift, outputs, grad_output)),
        hyperbolic=hyperbolic,
        scale=scale,
        key_mask=as_numpy(key_mask),
        chunk_size=chunk_size,
        grad_log_normaliser=as_numpy(grad_log_normaliser),
        grad_kv=as_numpy(grad_kv),
    )
    tensors: Any = tuple(torch.from_numpy(g) for g in grads)  # a fixed-length tuple
    return tensors


def _causal_fused_batch(
    q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None, kv: Tensor, log_shift: Tensor
) -> Any:
    shapes = [q.shape[:-2], k.shape[:-2], v.shape[:-2], kv.shape[:-2], log_shift.shape[:-1]]
    return torch.broadcast_shapes(*shapes, *([] if key_mask is None else [key_mask.shape[:-1]]))


@causal_fused_forward.register_fake
def _fake_causal_fused(
    q: Tensor, k: Tensor, v: Tensor, projection: Tensor, key_mask: Tensor | None, kv: Tensor,
    log_shift: Tensor, *rest: Any,
) -> Any:  # fmt: skip
    dtype = compute_dtype(q)
    batch = _causal_fused_batch(q, k, v, key_mask, kv, log_shift)
    length, m, dv = q.shape[-2], kv.shape[-2], v.shape[-1]
    return (
        q.new_empty((*batch, length, dv), dtype=dtype),
        q.new_empty((*batch, m, dv + 1), dtype=dtype),
        q.new_empty((*batch, m), dtype=dtype),
        q.new_empty((*batch, length), dtype=dtype),
    )


@causal_fused_backward.register_fake
def _fake_causal_fused_backward(
    q: Tensor, k: Tensor, v: Tensor, projection: Tensor, key_mask: Tensor | None, kv: Tensor,
    log_shift: Tensor, *rest: Any,
) -> Any:  # fmt: skip
    dtype = compute_dtype(q)
    batch = _causal_fused_batch(q, k, v, key_mask, kv, log_shift)
    return tuple(q.new_empty((*batch, *x.shape[-2:]), dtype=dtype) for x in (q, k, v, kv))


def _causal_fused_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
    q, k, v, projection, key_mask, kv, log_shift, hyperbolic, scale, chunk_size = inputs
    out, _, log_shift_out, _ = output
    ctx.save_for_backward(q, k, v, projection, key_mask, kv, log_shift, out)
    ctx.options = (hyperbolic, scale, chunk_size)
    ctx.mark_non_differentiable(log_shift_out)  # a stabiliser


def _causal_fused_grads(
    ctx: Any,
    d_out: Tensor | None,
    d_kv: Tensor | None,
    _d_log_shift: Tensor | None,
    d_lse: Tensor | None,
) -> tuple[Tensor | None, ...]:
    q, k, v, projection, key_mask, kv, log_shift, out = ctx.saved_tensors
    hyperbolic, scale, chunk_size = ctx.options
    batch = out.shape[:-2]
    m, width = kv.shape[-2], v.shape[-1] + 1
    shapes = (out.shape, (*batch, m, width), out.shape[:-1])
    d_out, d_kv, d_lse = (
        out.new_zeros(shape) if g is None else g.to(out.dtype).expand(shape).contiguous()
        for g, shape in zip((d_out, d_kv, d_lse), shapes, strict=True)
    )
    grads = _CausalFusedBackward.apply(
        q, k, v, projection, key_mask, kv, log_shift, hyperbolic, scale, chunk_size, out, d_out,
        d_lse, d_kv,
    )  # fmt: skip
    needed = ctx.needs_input_grad
    summed = [
        g.sum_to_size(x.shape).to(x.dtype) if needed[i] else None
        for i, (g, x) in enumerate(zip(grads[:3], (q, k, v), strict=True))
    ]
    d_kv_in = grads[3].sum_to_size(kv.shape).to(kv.dtype) if needed[5] else None
    # S exp(mu) is the state: d mu = sum_e dS * S (over the broadcast batch, then summed)
    d_mu = (grads[3] * kv).sum(-1).sum_to_size(log_shift.shape) if needed[6] else None
    return (*summed, None, None, d_kv_in, d_mu, None, None, None)


causal_fused_forward.register_autograd(_causal_fused_grads, setup_context=_causal_fused_setup)
causal_fused_backward.register_autograd(no_double_backward, setup_context=no_setup)
_CausalFused = for_torch_func(causal_fused_forward, _causal_fused_setup, _causal_fused_grads)
_CausalFusedBackward = for_torch_func(causal_fused_backward, no_setup, no_double_backward)
causal_fused_forward.register_vmap(no_vmap("causal_fused_forward"))
causal_fused_backward.register_vmap(no_vmap("causal_fused_backward"))
