"""Bidirectional attention in two compiled passes (keys into the state, then queries),
features included (:func:`linattn._dispatch.fused_bidirectional`)."""

from __future__ import annotations

from typing import Any

from linattn import _dispatch
from linattn._call import Call
from linattn.executors.plain import finish, prepare

__all__ = ["run"]


def run(call: Call, plan: Any, sub_call: Any) -> tuple[Any, Any]:
    """Run ``call`` (see :mod:`linattn.executors`)."""
    p = prepare(call, plan.scan)
    normalised = _dispatch.fused_bidirectional(p.q, p.k, p.v, p.feature_map, call.key_mask)
    return finish(call, p, normalised, p.kv, p.log_shift)
