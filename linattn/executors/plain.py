"""What the executors without exact parts share: the checks, and the new state.

:func:`prepare` checks a call (shapes, dtypes, masks, state, ``chunk_size``) before any
work, casts to the compute dtype, zeros masked keys and finds the incoming state;
:func:`finish` casts the output back and builds the state after the call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from linattn import _dispatch
from linattn._call import Call, call_statistics, check_state, drop_masked_keys, state_arrays
from linattn._checks import check_attention_inputs, check_state_options
from linattn._xp import Array, compute_dtype
from linattn.calibration import Statistics
from linattn.executors.base import Takes
from linattn.features import FeatureMap
from linattn.hybrid import build
from linattn.state import LinearAttentionState, empty_state

__all__ = ["FUSED_TAKES", "Prepared", "finish", "fitted_fused_why_not", "prepare"]


#: What the fused passes take (features computed in the pass: NumPy arrays and torch CPU
#: tensors, no exact parts); the causal and the bidirectional executor narrow it.
FUSED_TAKES = Takes(
    libraries=("numpy", "torch-cpu"),
    exact_parts=False,
    maps=("random", "fitted"),
    backends=("auto", "numba"),
)


@dataclass(frozen=True)
class Prepared:
    """A checked call: inputs in the compute dtype, the incoming state, the statistics."""

    info: Any
    feature_map: FeatureMap
    q: Array
    k: Array
    v: Array
    batch: tuple[int, ...]
    kv: Array
    log_shift: Array
    chunk_size: int
    statistics: Statistics | None
    work: Any


def prepare(call: Call, scan: _dispatch.Plan) -> Prepared:
    """Check ``call`` and bring its inputs and state to the compute dtype."""
    feature_map = call.feature_map
    assert feature_map is not None  # (the front door raised otherwise)
    q, k, v, key_mask, state, causal = (
        call.q,
        call.k,
        call.v,
        call.key_mask,
        call.state,
        call.causal,
    )
    extra = {} if state is None else state_arrays(state)
    info = check_attention_inputs(
        q, k, v, key_mask=key_mask, causal=causal, head_dim=feature_map.head_dim, extra=extra
    )
    chunk_size = _dispatch.chunk_size_for(scan, call.chunk_size, q, k, v)
    check_state_options(causal, state, call.return_state)
    xp = info.xp
    work = compute_dtype(xp, info.dtype)
    q, k, v = (xp.astype(x, work, copy=False) for x in (q, k, v))  # one compute dtype
    k, v = drop_masked_keys(xp, k, v, key_mask)
    batch = info.batch_shape
    if state is not None:
        build.check_exact_parts(
            None, 0, None, xp=xp, causal=causal, state=state, query_length=1, key_length=1, k=k
        )
        batch = check_state(state, feature_map, info, work)
    statistics = call_statistics(xp, feature_map, q, k, key_mask, causal=causal)
    m = feature_map.num_features
    if state is None:
        like = xp.zeros((0,), dtype=work, device=info.device)
        kv, log_shift = empty_state(xp, batch, m, info.value_dim, like)
    else:
        kv = xp.broadcast_to(state.kv, (*batch, m, info.value_dim + 1))
        log_shift = xp.broadcast_to(state.log_shift, (*batch, m))
    return Prepared(info, feature_map, q, k, v, batch, kv, log_shift, chunk_size, statistics, work)


def fitted_fused_why_not(call: Call, scan: _dispatch.Plan) -> list[str]:
    """A fitted map in the fused forward passes, which compute its features per block:
    NumPy arrays only (torch tensors differentiate through the fused backward passes,
    which compute random features only), where a compiled kernel serves them."""
    if _dispatch.library_of(call.q) != "numpy":
        return ["a fitted map: the fused passes compute its features for NumPy arrays only"]
    return [] if scan.kernel is not None else [f"no compiled kernel: {scan.reason}"]


def finish(
    call: Call, prepared: Prepared, normalised: Array, kv: Array, log_shift: Array
) -> tuple[Array, LinearAttentionState | None]:
    """The output in the caller's dtype and, where asked, the state after the call."""
    info = prepared.info
    out = info.xp.astype(normalised, info.dtype, copy=False)  # no second output-sized copy
    if not call.return_state:
        return out, None
    previous = 0 if call.state is None else call.state.num_tokens
    return out, LinearAttentionState(
        kv=kv,
        log_shift=log_shift,
        feature_map=prepared.feature_map.fingerprint,
        num_tokens=previous + info.key_length,
    )
