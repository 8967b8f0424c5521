"""Causal window, sinks and the fused far keys in one compiled pass
(:func:`linattn.hybrid.paths.fused_causal_parts`)."""

from __future__ import annotations

from linattn import _dispatch
from linattn._call import Call
from linattn.executors.base import Executor, Result, Runner, Takes
from linattn.executors.parts import finish, fused_far_keys_why_not, prepare
from linattn.hybrid import paths

__all__ = ["EXECUTOR", "HybridCausalFused"]


class HybridCausalFused(Executor):
    name = "hybrid-causal-fused"
    summary = "causal window, sinks and fused far keys in one compiled pass"
    takes = Takes(
        libraries=("numpy",),
        causal=True,
        exact_parts=True,
        maps=("random", "fitted"),
        backends=("auto", "numba"),
    )

    def more_reasons(self, call: Call, scan: _dispatch.Plan) -> list[str]:
        return fused_far_keys_why_not(call, scan)

    def run(self, call: Call, scan: _dispatch.Plan, attend: Runner) -> Result:
        checked = prepare(call, scan)
        out, far_state = paths.fused_causal_parts(checked.info.xp, checked.parts)
        return finish(call, checked, out, far_state)


EXECUTOR = HybridCausalFused()
