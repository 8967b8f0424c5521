"""Causal attention in one compiled pass, features included: no ``L x m`` array
(:func:`linattn._dispatch.fused_causal`; NumPy arrays and torch CPU tensors)."""

from __future__ import annotations

from typing import Any

from linattn import _dispatch
from linattn._call import Call
from linattn.executors.plain import finish, prepare

__all__ = ["run"]


def run(call: Call, plan: Any, sub_call: Any) -> tuple[Any, Any]:
    """Run ``call`` (see :mod:`linattn.executors`)."""
    p = prepare(call, plan.scan)
    normalised, kv, log_shift = _dispatch.fused_causal(
        p.q, p.k, p.v, p.feature_map, call.key_mask, p.kv, p.log_shift, chunk_size=p.chunk_size
    )
    return finish(call, p, normalised, kv, log_shift)
