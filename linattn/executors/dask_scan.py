"""Dask arrays: the sequence-parallel graph over their chunks, each chunk's attention a
sub-call through the plan (:func:`linattn._dask_graph.dask_linear_attention`)."""

from __future__ import annotations

from typing import Any

from linattn import _dask_graph
from linattn._call import Call

__all__ = ["run"]


def run(call: Call, plan: Any, sub_call: Any) -> tuple[Any, Any]:
    """Run ``call`` (see :mod:`linattn.executors`)."""
    assert call.feature_map is not None  # (the front door raised otherwise)
    result = _dask_graph.dask_linear_attention(call, sub_call)
    return result if call.return_state else (result, None)
