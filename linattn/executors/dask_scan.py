"""Dask arrays: the sequence-parallel graph over their chunks, each chunk's attention a
sub-call through the plan (:func:`linattn._dask_graph.dask_linear_attention`)."""

from __future__ import annotations

from linattn import _dask_graph, _dispatch
from linattn._call import Call
from linattn.executors.base import Executor, Result, Runner, Takes

__all__ = ["EXECUTOR", "DaskScan"]


class DaskScan(Executor):
    name = "dask-scan"
    summary = "Dask arrays: a graph over their sequence chunks"
    takes = Takes(libraries=("dask",), exact_parts=False)  # (exact parts: hybrid-parts)

    def run(self, call: Call, scan: _dispatch.Plan, attend: Runner) -> Result:
        assert call.feature_map is not None  # (the front door raised otherwise)
        result = _dask_graph.dask_linear_attention(call, attend)
        return result if call.return_state else (result, None)


EXECUTOR = DaskScan()
