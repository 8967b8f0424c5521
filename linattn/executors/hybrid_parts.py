"""Exact parts (window, sinks, exact keys) and the far keys as separate partials, merged
as in online softmax (:func:`linattn.hybrid.paths.hybrid_rows`); every backend.  The
window part and the far keys' scan run where the call's plan says (compiled on NumPy
arrays unless ``backend="array_api"``)."""

from __future__ import annotations

from linattn import _dispatch
from linattn import causal as causal_path
from linattn._call import Call
from linattn.executors.base import Executor, Result, Runner, Takes
from linattn.executors.parts import finish, prepare
from linattn.hybrid import paths

__all__ = ["EXECUTOR", "HybridParts"]


class HybridParts(Executor):
    name = "hybrid-parts"
    summary = "exact parts and far keys as partial rows, merged as in online softmax"
    takes = Takes(exact_parts=True)

    def uses_kernels(self, call: Call, scan: _dispatch.Plan) -> bool:
        """The scan's kernel, or the window's (NumPy arrays, where the plan allows)."""
        return scan.path == "numba-cpu" or (
            _dispatch.library_of(call.q) == "numpy"
            and _dispatch.numpy_kernels_why_not(scan.backend) is None
        )

    def run(self, call: Call, scan: _dispatch.Plan, attend: Runner) -> Result:
        checked = prepare(call, scan)
        xp = checked.info.xp
        rows, far_state = paths.hybrid_rows(xp, checked.parts)
        return finish(call, checked, causal_path.normalise(xp, rows), far_state)


EXECUTOR = HybridParts()
