"""A decoding step: a few new NumPy tokens after a causal state, in one compiled call
(:mod:`linattn._decode`)."""

from __future__ import annotations

from typing import Any

from linattn import _decode
from linattn._call import Call

__all__ = ["run"]


def run(call: Call, plan: Any, sub_call: Any) -> tuple[Any, Any]:
    """Run ``call`` (see :mod:`linattn.executors`)."""
    assert call.state is not None and call.feature_map is not None
    out, state = _decode.step(
        call.q, call.k, call.v, call.feature_map, call.key_mask, call.state, call.chunk_size
    )
    return out, (state if call.return_state else None)
