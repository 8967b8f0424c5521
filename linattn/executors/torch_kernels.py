"""Torch CPU tensors with exact parts (window, sinks, exact keys), run by the compiled
kernels NumPy arrays get: the one-pass hybrid passes, the window kernel.

The tensors reach, as NumPy views, the executor the plan chooses for the same call on
NumPy arrays (a hybrid-*-fused one or hybrid-parts, whose window part is compiled),
through the custom operator ``linattn::exact_parts_forward``.  Its gradient is
``linattn::exact_parts_backward``: the parts' adjoints on NumPy views
(:func:`linattn._call.exact_parts_vjp`: the window kernel's backward, the far keys'
compiled scan).  Both operators are opaque to ``torch.compile`` (no graph break) and
allocate nothing of ``L x d_v`` but their results.

The operators take tensors and scalars only: the feature map travels as its
fingerprint, remembered here when the executor first runs with it (maps are small: one
projection each), and the sub-call runner is the plan's (:func:`linattn._plan.run_call`,
handed to :func:`run`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from linattn import _dispatch
from linattn._call import Call, exact_parts_vjp
from linattn.features import FeatureMap

__all__ = ["run"]

#: Feature maps by fingerprint, and the plan's sub-call runner (see the module docstring).
_MAPS: dict[str, FeatureMap] = {}
_RUNNER: list[Callable[[Call], Any]] = []
_OPERATORS: list[Any] = []


def run(call: Call, plan: Any, sub_call: Callable[[Call], Any]) -> tuple[Any, None]:
    """Run ``call`` (see :mod:`linattn.executors`): the output, no state."""
    if not _RUNNER:
        _RUNNER.append(sub_call)
    fm = call.feature_map
    map_key = ""
    if fm is not None:
        map_key = fm.fingerprint
        _MAPS.setdefault(map_key, fm)
    forward = _operators()[0]
    out = forward(
        call.q,
        call.k,
        call.v,
        call.key_mask,
        call.exact_key_mask,
        map_key,
        bool(call.causal),
        call.window,
        int(call.sink_keys),
        call.chunk_size,
        call.scale,
        None if call.backend is None else str(call.backend),
    )
    return out, None


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
    if map_key and map_key not in _MAPS:
        raise RuntimeError(
            f"linattn::exact_parts_forward: no feature map with fingerprint {map_key!r} ran "
            "in this process (a graph compiled elsewhere?); call linear_attention once eagerly"
        )
    q, k, v, key_mask, exact_key_mask = (
        None if x is None else x.detach().numpy() for x in (q, k, v, key_mask, exact_key_mask)
    )
    return Call(
        q,
        k,
        v,
        _MAPS[map_key] if map_key else None,
        causal=causal,
        key_mask=key_mask,
        chunk_size=chunk_size,
        backend=backend,
        window=window,
        sink_keys=sink_keys,
        exact_key_mask=exact_key_mask,
        scale=scale,
    )


def _operators() -> tuple[Any, Any]:
    """``(exact_parts_forward, exact_parts_backward)``, registered on first use (linattn
    imports torch only where torch tensors are in use)."""
    if not _OPERATORS:
        _OPERATORS.extend(_register())
    return _OPERATORS[0], _OPERATORS[1]


def _register() -> tuple[Any, Any]:
    import torch
    from torch import Tensor

    def forward(
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
        """The call's output, by the executor that serves its NumPy twin."""
        call = _numpy_call(
            q, k, v, key_mask, exact_key_mask, map_key, causal, window, sink_keys,
            chunk_size, scale, backend,
        )  # fmt: skip
        out, _ = _RUNNER[0](call)
        return torch.from_numpy(np.ascontiguousarray(out))

    def backward(
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

    # (explicit schemas: the annotations are strings naming a local import)
    arguments = (
        "Tensor q, Tensor k, Tensor v, Tensor? key_mask, Tensor? exact_key_mask, "
        "str map_key, bool causal, int? window, int sink_keys, int? chunk_size, "
        "float? scale, str? backend"
    )
    forward_op = torch.library.custom_op(
        "linattn::exact_parts_forward",
        mutates_args=(),
        device_types="cpu",
        schema=f"({arguments}) -> Tensor",
    )(forward)
    backward_op = torch.library.custom_op(
        "linattn::exact_parts_backward",
        mutates_args=(),
        device_types="cpu",
        schema=f"({arguments}, Tensor grad_output) -> (Tensor, Tensor, Tensor)",
    )(backward)

    @forward_op.register_fake
    def _(q: Tensor, k: Tensor, v: Tensor, key_mask: Any, exact_key_mask: Any, *rest: Any) -> Any:
        shapes = [x.shape[:-2] for x in (q, k, v)]
        shapes += [m.shape[:-1] for m in (key_mask, exact_key_mask) if m is not None]
        batch = torch.broadcast_shapes(*shapes)
        dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
        return q.new_empty((*batch, q.shape[-2], v.shape[-1]), dtype=dtype)

    @backward_op.register_fake
    def _(q: Tensor, k: Tensor, v: Tensor, *rest: Any) -> Any:
        return tuple(x.new_empty(x.shape) for x in (q, k, v))

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.save_for_backward(*inputs[:5])
        ctx.options = inputs[5:]

    def gradients(ctx: Any, grad_output: Tensor) -> tuple[Any, ...]:
        tensors = ctx.saved_tensors
        dq, dk, dv = backward_op(*tensors, *ctx.options, grad_output.contiguous())
        return (dq, dk, dv, *([None] * 9))

    def no_double_backward(ctx: Any, *grads: Any) -> Any:
        raise NotImplementedError(
            "second derivatives through linattn::exact_parts_backward (the compiled hybrid "
            "kernels) are not supported; pass backend='array_api' for the portable path"
        )

    forward_op.register_autograd(gradients, setup_context=setup_context)
    backward_op.register_autograd(no_double_backward, setup_context=lambda *args: None)
    return forward_op, backward_op
