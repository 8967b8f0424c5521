"""Bidirectional window, sinks and both lagged far passes in one compiled pass
(:func:`linattn.hybrid.paths.fused_bidirectional_parts`)."""

from __future__ import annotations

from linattn import _dispatch
from linattn._call import Call
from linattn.executors.base import Executor, Result, Runner, Takes
from linattn.executors.parts import finish, fused_far_keys_why_not, prepare
from linattn.hybrid import paths

__all__ = ["EXECUTOR", "HybridWindowFused"]


class HybridWindowFused(Executor):
    name = "hybrid-window-fused"
    summary = "bidirectional window, sinks and both fused far passes in one compiled pass"
    takes = Takes(
        libraries=("numpy",),
        causal=False,
        exact_parts=True,
        window=True,
        maps=("random", "fitted"),
        backends=("auto", "numba"),
    )

    def more_reasons(self, call: Call, scan: _dispatch.Plan) -> list[str]:
        return fused_far_keys_why_not(call, scan)

    def run(self, call: Call, scan: _dispatch.Plan, attend: Runner) -> Result:
        checked = prepare(call, scan)
        out = paths.fused_bidirectional_parts(checked.info.xp, checked.parts)
        return finish(call, checked, out, {})


EXECUTOR = HybridWindowFused()
