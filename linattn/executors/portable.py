"""The portable executor: features in the array API, then the causal scan on the plan's
path (a compiled kernel on log-features, ``jax.lax.scan``, the array API) or the
bidirectional pass.  Serves every call without exact parts."""

from __future__ import annotations

from typing import Any

from linattn import causal as causal_path
from linattn._call import Call, attend, attention_operands
from linattn.executors.plain import finish, prepare

__all__ = ["run"]


def run(call: Call, plan: Any, sub_call: Any) -> tuple[Any, Any]:
    """Run ``call`` (see :mod:`linattn.executors`)."""
    p = prepare(call, plan.scan)
    xp = p.info.xp
    operands = attention_operands(
        p.q, p.k, p.v, p.feature_map, p.info, p.batch, call.key_mask, p.work, p.statistics
    )
    outputs_aug, kv, log_shift = attend(
        xp,
        operands,
        p.kv,
        p.log_shift,
        causal=call.causal,
        chunk_size=p.chunk_size,
        plan=plan.scan,
    )
    return finish(call, p, causal_path.normalise(xp, outputs_aug), kv, log_shift)
