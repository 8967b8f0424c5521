"""The plan's runner of sub-calls, for executors' code that runs outside a call.

The torch operators of :mod:`linattn.executors.torch_kernels` run when autograd or a
compiled graph calls them, not while the executor runs: :mod:`linattn._plan` hands its
runner (:func:`linattn._plan.run_call`) here when it is imported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from linattn._call import Call

__all__ = ["run", "set_runner"]

_RUNNER: list[Callable[[Call], Any]] = []


def set_runner(runner: Callable[[Call], Any]) -> None:
    """Use ``runner`` (the plan's) for sub-calls."""
    _RUNNER[:] = [runner]


def run(call: Call) -> Any:
    """``(output, state)`` of ``call``, through the plan."""
    return _RUNNER[0](call)
