"""Bidirectional attention in two compiled passes (keys into the state, then queries),
features included (:func:`linattn._dispatch.fused_bidirectional`), and its backward
(:func:`linattn._dispatch.fused_bidirectional_vjp`, random maps)."""

from __future__ import annotations

from dataclasses import replace

from linattn import _dispatch
from linattn._call import Call
from linattn.executors.base import Backward, Executor, Result, Runner
from linattn.executors.plain import FUSED_TAKES, finish, fitted_fused_why_not, prepare

__all__ = ["EXECUTOR", "FusedBidirectional"]


class FusedBidirectional(Executor):
    name = "fused-bidirectional"
    summary = "bidirectional features, state and readout in the fused compiled pass"
    takes = replace(FUSED_TAKES, causal=False)
    compiled = True

    def more_reasons(self, call: Call, scan: _dispatch.Plan) -> list[str]:
        fm = call.feature_map
        assert fm is not None  # (declared)
        if fm.parameters is not None:
            return fitted_fused_why_not(call, scan)
        if fm.needs_calibration:
            return ["the map needs this call's statistics"]
        if not _dispatch.fused_map(fm):
            return ["the fused passes do not compute this map's features"]
        kernel, why = _dispatch.kernel_for(call.q)
        return [] if kernel is not None else [why]

    def run(self, call: Call, scan: _dispatch.Plan, attend: Runner) -> Result:
        p = prepare(call, scan)
        normalised = _dispatch.fused_bidirectional(p.q, p.k, p.v, p.feature_map, call.key_mask)
        return finish(call, p, normalised, p.kv, p.log_shift)

    def backward(self, call: Call) -> Backward | None:
        """The fused forward and backward passes (no ``L x m`` array); they compute random
        features only."""
        fm = call.feature_map
        return (
            _dispatch.fused_bidirectional_vjp if fm is not None and fm.parameters is None else None
        )


EXECUTOR = FusedBidirectional()
