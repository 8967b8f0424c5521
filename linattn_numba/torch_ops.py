"""The causal kernels as torch custom operators: ``torch.ops.linattn.causal_forward``
(and ``causal_forward_scaled``, which also returns each row's ``log_scale``) and
``torch.ops.linattn.causal_backward``, on CPU and CUDA tensors.

Registered through ``torch.library.custom_op`` when this module is first imported
(by :mod:`linattn_numba.libraries` or by ``linattn``, when a torch tensor first reaches a
kernel; ``import linattn`` never imports torch).  The operators are opaque to
``torch.compile`` (no graph break: each has a fake implementation that gives output
shapes and dtypes from the inputs' alone), differentiable through ``register_autograd``
(also under ``torch.func.grad`` and ``vjp``), and refuse ``torch.func.vmap`` with a
clear ``NotImplementedError``.  The device code is imported inside each kernel: the CPU
one from the passes of :mod:`linattn_numba.cpu` (NumPy views of the tensors), the CUDA
one from :mod:`linattn_numba.gpu.host` (numba-cuda, imported only when a CUDA tensor
arrives).

Gradients.  The kernel's own stabilisers (the output ``log_shift`` and the per-row
and per-key shifts inside it) are treated as constants by the backward pass.  That
is exact for the normalised outputs ``O[..., :d_v] / O[..., d_v]`` and for anything
computed from the state that does not change when the shift does, because
numerator and denominator share every shift.  The output ``log_shift`` is therefore
marked non-differentiable, and so is ``causal_forward_scaled``'s ``log_scale`` (the
true ``[num | den]`` is ``exp(log_scale)`` times the output row): the log-normaliser
``log(outputs_aug[..., -1]) + log_scale`` gets its exact gradient through the
denominator column.  The *input* state ``(S, mu)`` stands for ``S exp(mu)``,
so the input ``mu`` gets the gradient of that product, ``d mu = sum_e dS * S``: a
state whose ``mu`` was computed with gradients (by the array-API path) continues
exactly.

Examples
--------
>>> import torch
>>> from linattn_numba import torch_ops
>>> lq = torch.zeros(1, 3, 1)  # one feature, equal: causal attention is a running mean
>>> va = torch.tensor([[[0.0, 1.0], [1.0, 1.0], [2.0, 1.0]]], requires_grad=True)
>>> kv, mu = torch.zeros(1, 1, 2), torch.full((1, 1), -torch.inf)
>>> out, kv_out, mu_out = torch.ops.linattn.causal_forward(lq, lq, va, kv, mu, 2)
>>> (out[..., 0] / out[..., 1]).tolist()
[[0.0, 0.5, 1.0]]
>>> out[..., 0].sum().backward()
>>> va.grad[0, :, 0].tolist()  # each value reaches its own and every later output
[3.0, 2.0, 1.0]
>>> out, _, _, scale = torch_ops.causal("cpu", lq, lq, va, kv, mu, 2, return_log_scale=True)
>>> (out[..., 1].log() + scale).exp().tolist()  # the true denominators
[[1.0, 2.0, 3.0]]
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from linattn_numba import _contract

__all__ = [
    "NAMESPACE",
    "bidirectional",
    "bidirectional_backward",
    "bidirectional_forward",
    "causal",
    "causal_backward",
    "causal_forward",
    "causal_forward_scaled",
    "causal_fused",
    "causal_fused_backward",
    "causal_fused_forward",
]

#: The operators' namespace: ``torch.ops.linattn.*``.
NAMESPACE = "linattn"

Grads = tuple[Tensor, Tensor, Tensor, Tensor]


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


def _compute_dtype(x: Tensor) -> torch.dtype:
    """float64 stays; everything else computes (and returns) float32, as the kernels do."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _fresh_like(x: Tensor, dtype: torch.dtype) -> Tensor:
    return x.new_empty(x.shape, dtype=dtype)  # contiguous, like the kernels' results


@causal_forward.register_fake
def _fake_forward(lq: Tensor, lk: Tensor, va: Tensor, kv: Tensor, mu: Tensor, chunk: int) -> Any:
    dtype = _compute_dtype(lq)
    return _fresh_like(va, dtype), _fresh_like(kv, dtype), _fresh_like(mu, dtype)


@causal_forward_scaled.register_fake
def _fake_forward_scaled(
    lq: Tensor, lk: Tensor, va: Tensor, kv: Tensor, mu: Tensor, chunk: int
) -> Any:
    log_scale = va.new_empty(va.shape[:-1], dtype=_compute_dtype(lq))
    return (*_fake_forward(lq, lk, va, kv, mu, chunk), log_scale)


@causal_backward.register_fake
def _fake_backward(lq: Tensor, lk: Tensor, va: Tensor, kv: Tensor, *rest: Any) -> Any:
    dtype = _compute_dtype(lq)
    return tuple(_fresh_like(x, dtype) for x in (lq, lk, va, kv))


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


def _no_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    pass


def _no_double_backward(ctx: Any, *grads: Any) -> Any:
    raise NotImplementedError(
        "second derivatives through the linattn Numba kernels (linattn::causal_backward and "
        "the fused backward operators) are not supported; pass backend='array_api' to "
        "linattn for the portable path"
    )


causal_backward.register_autograd(_no_double_backward, setup_context=_no_setup)


# -- the same operators in the form torch.func accepts -------------------------------


def _no_vmap(name: str) -> Any:
    def rule(info: Any, in_dims: Any, *args: Any) -> Any:
        raise NotImplementedError(
            f"torch.func.vmap over linattn::{name} (the linattn Numba kernel) is not "
            "supported yet; the kernel maps over leading batch axes itself, so call it on "
            "the batched inputs without vmap, or pass backend='array_api' to linattn"
        )

    return rule


def _for_torch_func(op: Any, setup_context: Any, backward: Any) -> Any:
    """``op`` as an ``autograd.Function`` with ``setup_context``, ``backward`` and a vmap
    rule that refuses: ``torch.func.grad`` and ``vjp`` reject the function that
    ``register_autograd`` generates (it has no ``setup_context``), and accept this one,
    which shares the formula.  (``torch.compile`` gets the operator itself.)"""
    name = op._qualname.split("::")[-1]
    return type(
        f"_{name}",
        (torch.autograd.Function,),
        {
            "forward": staticmethod(lambda *args: op(*args)),
            "setup_context": staticmethod(setup_context),
            "backward": staticmethod(backward),
            "vmap": staticmethod(_no_vmap(name)),
        },
    )


_Causal = _for_torch_func(causal_forward, _setup_context, _backward)
_CausalScaled = _for_torch_func(causal_forward_scaled, _setup_context, _backward)
_CausalBackward = _for_torch_func(causal_backward, _no_setup, _no_double_backward)
causal_forward.register_vmap(_no_vmap("causal_forward"))
causal_forward_scaled.register_vmap(_no_vmap("causal_forward_scaled"))
causal_backward.register_vmap(_no_vmap("causal_backward"))


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


def _numpy(x: Tensor | None) -> Any:
    return None if x is None else x.detach().numpy()


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
        *(_numpy(x) for x in (q, k, v, projection)),
        hyperbolic=hyperbolic,
        scale=scale,
        key_mask=_numpy(key_mask),
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
        *(_numpy(x) for x in (q, k, v, projection, kv, log_shift, outputs, grad_output)),
        hyperbolic=hyperbolic,
        scale=scale,
        key_mask=_numpy(key_mask),
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
    dtype = _compute_dtype(q)
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
    dtype = _compute_dtype(q)
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
bidirectional_backward.register_autograd(_no_double_backward, setup_context=_no_setup)
_Bidirectional = _for_torch_func(bidirectional_forward, _bidirectional_setup, _bidirectional_grads)
_BidirectionalBackward = _for_torch_func(bidirectional_backward, _no_setup, _no_double_backward)
bidirectional_forward.register_vmap(_no_vmap("bidirectional_forward"))
bidirectional_backward.register_vmap(_no_vmap("bidirectional_backward"))


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
        *(_numpy(x) for x in (q, k, v, projection, kv, log_shift)),
        hyperbolic=hyperbolic,
        scale=scale,
        key_mask=_numpy(key_mask),
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
        *(_numpy(x) for x in (q, k, v, projection, kv, log_shift, outputs, grad_output)),
        hyperbolic=hyperbolic,
        scale=scale,
        key_mask=_numpy(key_mask),
        chunk_size=chunk_size,
        grad_log_normaliser=_numpy(grad_log_normaliser),
        grad_kv=_numpy(grad_kv),
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
    dtype = _compute_dtype(q)
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
    dtype = _compute_dtype(q)
    batch = _causal_fused_batch(q, k, v, key_mask, kv, log_shift)
    return tuple(q.new_empty((*batch, *x.shape[-2:]), dtype=dtype) for x in (q, k, v, kv))


def _causal_fused_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
    q, k, v, projection, key_mask, kv, log_shift, hyperbolic, scale, chunk_size = inputs
    out, _, log_shift_out, _ = output
    ctx.save_for_backward(q, k, v, projection, key_mask, kv, log_shift, out)
    ctx.options = (hyperbolic, scale, chunk_size)
    ctx.mark_non_differentiable(log_shift_out)  # a stabiliser


def _causal_fused_grads(
    ctx: Any, d_out: Tensor, d_kv: Tensor, _d_log_shift: Tensor | None, d_lse: Tensor
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
causal_fused_backward.register_autograd(_no_double_backward, setup_context=_no_setup)
_CausalFused = _for_torch_func(causal_fused_forward, _causal_fused_setup, _causal_fused_grads)
_CausalFusedBackward = _for_torch_func(causal_fused_backward, _no_setup, _no_double_backward)
causal_fused_forward.register_vmap(_no_vmap("causal_fused_forward"))
causal_fused_backward.register_vmap(_no_vmap("causal_fused_backward"))
