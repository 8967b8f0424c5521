"""Causal attention in one compiled pass, features included: no ``L x m`` array
(:func:`linattn._dispatch.fused_causal`; NumPy arrays and torch CPU tensors), and its
backward (:func:`linattn._dispatch.fused_causal_vjp`, random maps)."""

from __future__ import annotations

from dataclasses import replace

from linattn import _dispatch
from linattn._call import Call
from linattn.executors.base import Backward, Executor, Result, Runner
from linattn.executors.plain import FUSED_TAKES, finish, fitted_fused_why_not, prepare

__all__ = ["EXECUTOR", "FusedCausal"]


class FusedCausal(Executor):
    name = "fused-causal"
    summary = "causal features and attention in one compiled pass, no L x m array"
    takes = replace(FUSED_TAKES, causal=True)
    compiled = True

    def more_reasons(self, call: Call, scan: _dispatch.Plan) -> list[str]:
        if call.feature_map is not None and call.feature_map.parameters is not None:
            return fitted_fused_why_not(call, scan)
        return [] if scan.fused else [f"no fused pass: {scan.reason}"]

    def run(self, call: Call, scan: _dispatch.Plan, attend: Runner) -> Result:
        p = prepare(call, scan)
        normalised, kv, log_shift = _dispatch.fused_causal(
            p.q, p.k, p.v, p.feature_map, call.key_mask, p.kv, p.log_shift,
            chunk_size=p.chunk_size,
        )  # fmt: skip
        return finish(call, p, normalised, kv, log_shift)

    def backward(self, call: Call) -> Backward | None:
        """The fused causal passes (features recomputed chunk by chunk, no ``L x m``
        array); they compute random features only."""
        fm = call.feature_map
        return _dispatch.fused_causal_vjp if fm is not None and fm.parameters is None else None


EXECUTOR = FusedCausal()
