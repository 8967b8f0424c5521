"""Torch CPU tensors with exact parts (window, sinks, exact keys), run by the compiled
kernels NumPy arrays get: the one-pass hybrid passes, the window kernel.

The tensors reach, as NumPy views, the executor the plan chooses for the same call on
NumPy arrays (a hybrid-*-fused one or hybrid-parts, whose window part is compiled),
through the custom operator ``linattn::exact_parts_forward``.  Its gradient is
``linattn::exact_parts_backward``: the parts' adjoints on NumPy views
(:func:`linattn._call.exact_parts_vjp`: the window kernel's backward, the far keys'
compiled scan).  Both operators are opaque to ``torch.compile`` (no graph break) and
allocate nothing of ``L x d_v`` but their results.

The operators (:mod:`linattn.executors.torch_operators`) take tensors and scalars only:
the feature map travels as its fingerprint, and the NumPy call runs through the plan's
runner (:mod:`linattn.executors.sub_calls`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from linattn._call import Call

__all__ = ["run"]


def run(call: Call, plan: Any, sub_call: Callable[[Call], Any]) -> tuple[Any, None]:
    """Run ``call`` (see :mod:`linattn.executors`): the output, no state."""
    from linattn.executors import torch_operators  # (registers them; imports torch)

    map_key = "" if call.feature_map is None else call.feature_map.fingerprint
    out = torch_operators.exact_parts_forward(
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
