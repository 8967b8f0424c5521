"""The custom operators of :mod:`linattn.executors.torch_kernels`:
``linattn::exact_parts_forward`` and ``linattn::exact_parts_backward``.

Registered when this module is imported: the executor imports it on its first run, and
an import statement runs for real even inside ``torch.compile``'s tracing (a
registration called from traced code would not).  The operators take tensors and
scalars only: the feature map travels as its fingerprint
(:func:`linattn.features.feature_map_for`), and the call runs through the plan's runner
(:mod:`linattn.executors.sub_calls`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from linattn import _dispatch
from linattn._call import Call, exact_parts_vjp
from linattn.executors import sub_calls
from linattn.features import feature_map_for

__all__ = ["exact_parts_backward", "exact_parts_forward"]


def _numpy_call(
    q: Any,
    k: Any,
    v: Any,
    key_mask: Any,
    exact_key_mask: Any,
    map_key: str,
    causal: bool,
    window: int | None,
    sink_keys: int,
    chunk_size: int | None,
    scale: float | None,
    backend: str | None,
) -> Call:
    """The operator's arguments as a call on NumPy views of the tensors."""
    feature_map = feature_map_for(map_key) if map_key else None
    if map_key and feature_map is None:
        raise RuntimeError(
            f"linattn::exact_parts_forward: no live feature map has fingerprint {map_key!r} "
            "(made in another process, or inside the compiled function?)"
        )
    q, k, v, key_mask, exact_key_mask = (
        None if x is None else x.detach().numpy() for x in (q, k, v, key_mask, exact_key_mask)
    )
    return Call(
        q,
        k,
        v,
        feature_map,
        causal=causal,
        key_mask=key_mask,
        chunk_size=chunk_size,
        backend=backend,
        window=window,
        sink_keys=sink_keys,
        exact_key_mask=exact_key_mask,
        scale=scale,
    )


def _forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_mask: Tensor | None,
    exact_key_mask: Tensor | None,
    map_key: str,
    causal: bool,
    window: int | None,
    sink_keys: int,
    chunk_size: int | None,
    scale: float | None,
    backend: str | None,
) -> Tensor:
    """The call's output, by the executor the plan chooses for its NumPy views."""
    call = _numpy_call(
        q, k, v, key_mask, exact_key_mask, map_key, causal, window, sink_keys,
        chunk_size, scale, backend,
    )  # fmt: skip
    out, _ = sub_calls.run(call)
    return torch.from_numpy(np.ascontiguousarray(out))


def _backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_mask: Tensor | None,
    exact_key_mask: Tensor | None,
    map_key: str,
    causal: bool,
    window: int | None,
    sink_keys: int,
    chunk_size: int | None,
    scale: float | None,
    backend: str | None,
    grad_output: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)``, shaped and typed like ``q``, ``k`` and ``v``."""
    call = _numpy_call(
        q, k, v, key_mask, exact_key_mask, map_key, causal, window, sink_keys,
        chunk_size, scale, backend,
    )  # fmt: skip
    options = call.options()
    for name in ("state", "return_state", "backend"):
        del options[name]
    scan = _dispatch.scan_plan(call.q, call.feature_map, backend=call.backend)
    grads = exact_parts_vjp(
        call.q,
        call.k,
        call.v,
        call.feature_map,
        grad_output.detach().numpy(),
        plan=scan,
        **options,
    )
    dq, dk, dv = (torch.from_numpy(np.ascontiguousarray(g)) for g in grads)
    return dq, dk, dv


_ARGUMENTS = (
    "Tensor q, Tensor k, Tensor v, Tensor? key_mask, Tensor? exact_key_mask, "
    "str map_key, bool causal, int? window, int sink_keys, int? chunk_size, "
    "float? scale, str? backend"
)
exact_parts_forward = torch.library.custom_op(
    "linattn::exact_parts_forward",
    mutates_args=(),
    device_types="cpu",
    schema=f"({_ARGUMENTS}) -> Tensor",
)(_forward)
exact_parts_backward = torch.library.custom_op(
    "linattn::exact_parts_backward",
    mutates_args=(),
    device_types="cpu",
    schema=f"({_ARGUMENTS}, Tensor grad_output) -> (Tensor, Tensor, Tensor)",
)(_backward)


def _fake_forward(
    q: Tensor, k: Tensor, v: Tensor, key_mask: Any, exact_key_mask: Any, *rest: Any
) -> Any:
    shapes = [x.shape[:-2] for x in (q, k, v)]
    shapes += [m.shape[:-1] for m in (key_mask, exact_key_mask) if m is not None]
    batch = torch.broadcast_shapes(*shapes)
    dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    return q.new_empty((*batch, q.shape[-2], v.shape[-1]), dtype=dtype)


def _fake_backward(q: Tensor, k: Tensor, v: Tensor, *rest: Any) -> Any:
    return tuple(x.new_empty(x.shape) for x in (q, k, v))


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.save_for_backward(*inputs[:5])
    ctx.options = inputs[5:]


def _gradients(ctx: Any, grad_output: Tensor) -> tuple[Any, ...]:
    tensors = ctx.saved_tensors
    dq, dk, dv = exact_parts_backward(*tensors, *ctx.options, grad_output.contiguous())
    return (dq, dk, dv, *([None] * 9))


def _no_double_backward(ctx: Any, *grads: Any) -> Any:
    raise NotImplementedError(
        "second derivatives through linattn::exact_parts_backward (the compiled hybrid "
        "kernels) are not supported; pass backend='array_api' for the portable path"
    )


exact_parts_forward.register_fake(_fake_forward)
exact_parts_backward.register_fake(_fake_backward)
exact_parts_forward.register_autograd(_gradients, setup_context=_setup_context)
exact_parts_backward.register_autograd(_no_double_backward, setup_context=lambda *args: None)
