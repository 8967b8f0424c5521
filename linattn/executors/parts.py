"""What the executors with exact parts share: the checks and parts of a call
(:func:`linattn._call.exact_parts_call`), the new state, and what the one-pass hybrid
kernels need of the far keys."""

from __future__ import annotations

from typing import Any

from linattn import _dispatch
from linattn._call import EXACT_FINGERPRINT, Call, ExactPartsCall, exact_parts_call
from linattn._xp import Array, compute_dtype
from linattn.state import LinearAttentionState, empty_state

__all__ = ["finish", "fused_far_keys_why_not", "prepare"]


def fused_far_keys_why_not(call: Call, scan: _dispatch.Plan) -> list[str]:
    """Why the one-pass hybrid kernels cannot compute this call's far keys: a random
    map needs the fused pass (the kernels compute its features), a fitted map's
    log-features are given to them; both need the kernels to import."""
    fm = call.feature_map
    if fm is not None and fm.parameters is None and not scan.fused:
        return [f"no fused pass: {scan.reason}"]
    why = _dispatch.numpy_kernels_why_not(scan.backend)
    return [] if why is None else [why]


def prepare(call: Call, scan: _dispatch.Plan) -> ExactPartsCall:
    """Check ``call`` and build its parts, the far keys and window on the plan's scan."""
    options = call.options()
    del options["backend"]
    return exact_parts_call(call.q, call.k, call.v, call.feature_map, plan=scan, **options)


def finish(
    call: Call, checked: ExactPartsCall, out: Array, far_state: dict[str, Any]
) -> tuple[Array, LinearAttentionState | None]:
    """The output in the caller's dtype and, where asked, the state after the call."""
    xp, info = checked.info.xp, checked.info
    out = xp.astype(out, info.dtype, copy=False)
    if not call.return_state:
        return out, None
    fields = {**checked.fields, **far_state}
    if fields["kv"] is None:  # no feature map: an empty random-feature state
        like = xp.zeros((0,), dtype=compute_dtype(xp, info.dtype), device=info.device)
        fields["kv"], fields["log_shift"] = empty_state(xp, checked.batch, 0, info.value_dim, like)
    previous = 0 if call.state is None else call.state.num_tokens
    fm = call.feature_map
    return out, LinearAttentionState(
        feature_map=EXACT_FINGERPRINT if fm is None else fm.fingerprint,
        num_tokens=previous + info.key_length,
        window=checked.exact.window,
        sink_keys=checked.exact.sink_keys,
        **fields,
    )
