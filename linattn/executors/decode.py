"""A decoding step: a few new NumPy tokens after a plain causal state, in one compiled
call (:mod:`linattn._decode`)."""

from __future__ import annotations

import numpy as np

from linattn import _decode, _dispatch
from linattn._call import Call
from linattn.executors.base import Executor, Result, Runner, Takes
from linattn.state import LinearAttentionState

__all__ = ["EXECUTOR", "Decode"]


class Decode(Executor):
    name = "decode"
    summary = "a few new NumPy tokens after a plain causal state, in one kernel call"
    takes = Takes(
        libraries=("numpy",),
        causal=True,
        exact_parts=False,
        state=True,
        maps=("random", "fitted"),
        backends=("auto", "numba"),
    )
    compiled = True

    def more_reasons(self, call: Call, scan: _dispatch.Plan) -> list[str]:
        state, fm = call.state, call.feature_map
        if not isinstance(state, LinearAttentionState) or state.sink_keys:
            return ["not a plain state (no window or sinks)"]
        assert fm is not None  # (declared)
        return_state: object = call.return_state  # (as given: typed bool, not checked yet)
        if not (return_state is True or return_state is False):
            return ["return_state is not a bool"]
        arrays = (state.kv, state.log_shift)
        if not all(type(x) is np.ndarray for x in arrays) or not (
            call.key_mask is None or type(call.key_mask) is np.ndarray
        ):
            return ["not NumPy arrays"]
        reason = _decode.why_not(call.q, call.k, call.v, fm, call.key_mask, state, call.chunk_size)
        if reason is None and _dispatch.decode_kernel() is None:
            reason = "the decoding kernel cannot be imported; install linattn[numba]"
        return [] if reason is None else [reason]

    def run(self, call: Call, scan: _dispatch.Plan, attend: Runner) -> Result:
        assert call.state is not None and call.feature_map is not None
        out, state = _decode.step(
            call.q, call.k, call.v, call.feature_map, call.key_mask, call.state, call.chunk_size
        )
        return out, (state if call.return_state else None)


EXECUTOR = Decode()
