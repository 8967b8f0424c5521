"""Bidirectional exact keys without a window, the far keys as one global state, merged
per query in the fused bidirectional pass (:func:`linattn.paths.fused_global_parts`)."""

from __future__ import annotations

from typing import Any

from linattn._call import Call
from linattn.executors.parts import finish, prepare
from linattn.hybrid import paths

__all__ = ["run"]


def run(call: Call, plan: Any, sub_call: Any) -> tuple[Any, Any]:
    """Run ``call`` (see :mod:`linattn.executors`)."""
    checked = prepare(call, plan)
    out = paths.fused_global_parts(checked.info.xp, checked.parts)
    return finish(call, checked, out, {})
