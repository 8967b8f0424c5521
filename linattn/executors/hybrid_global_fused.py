"""Bidirectional exact keys without a window, the far keys as one global state, merged
per query in the fused bidirectional pass (:func:`linattn.hybrid.paths.fused_global_parts`)."""

from __future__ import annotations

from linattn import _dispatch
from linattn._call import Call
from linattn.executors.base import Executor, Result, Runner, Takes
from linattn.executors.parts import finish, fused_far_keys_why_not, prepare
from linattn.hybrid import paths

__all__ = ["EXECUTOR", "HybridGlobalFused"]


class HybridGlobalFused(Executor):
    name = "hybrid-global-fused"
    summary = "bidirectional exact keys without a window, far keys in the fused global pass"
    takes = Takes(
        libraries=("numpy",),
        causal=False,
        exact_parts=True,
        window=False,
        maps=("random",),  # (the fused bidirectional pass computes random features only)
        backends=("auto", "numba"),
    )

    def more_reasons(self, call: Call, scan: _dispatch.Plan) -> list[str]:
        if call.sink_keys == 0 and call.exact_key_mask is None:
            return ["no exact keys"]
        assert call.feature_map is not None  # (declared)
        if call.feature_map.needs_calibration:
            return ["the map needs this call's statistics"]
        return fused_far_keys_why_not(call, scan)

    def run(self, call: Call, scan: _dispatch.Plan, attend: Runner) -> Result:
        checked = prepare(call, scan)
        out = paths.fused_global_parts(checked.info.xp, checked.parts)
        return finish(call, checked, out, {})


EXECUTOR = HybridGlobalFused()
