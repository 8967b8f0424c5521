"""Exact parts (window, sinks, exact keys) and the far keys as separate partials, merged
as in online softmax (:func:`linattn.paths.hybrid_rows`); every backend."""

from __future__ import annotations

from typing import Any

from linattn import causal as causal_path
from linattn._call import Call
from linattn.executors.parts import finish, prepare
from linattn.hybrid import paths

__all__ = ["run"]


def run(call: Call, plan: Any, sub_call: Any) -> tuple[Any, Any]:
    """Run ``call`` (see :mod:`linattn.executors`)."""
    checked = prepare(call, plan)
    xp = checked.info.xp
    rows, far_state = paths.hybrid_rows(xp, checked.parts)
    return finish(call, checked, causal_path.normalise(xp, rows), far_state)
