"""The portable executor: features in the array API, then the causal scan on the plan's
path (a compiled kernel on log-features, ``jax.lax.scan``, the array API) or the
bidirectional pass.  Serves every call without exact parts."""

from __future__ import annotations

from linattn import _dispatch
from linattn import causal as causal_path
from linattn._call import Call, attention_operands
from linattn.executors.base import Executor, Result, Runner, Takes
from linattn.executors.plain import finish, prepare

__all__ = ["EXECUTOR", "Portable"]


class Portable(Executor):
    name = "portable"
    summary = "features in the array API, then the causal scan on its path or one pass"
    takes = Takes(exact_parts=False)  # (every call with exact parts: hybrid-parts)

    def run(self, call: Call, scan: _dispatch.Plan, attend_sub_call: Runner) -> Result:
        p = prepare(call, scan)
        xp = p.info.xp
        operands = attention_operands(
            p.q, p.k, p.v, p.feature_map, p.info, p.batch, call.key_mask, p.work, p.statistics
        )
        outputs_aug, kv, log_shift = _dispatch.attend(
            xp, operands, p.kv, p.log_shift, causal=call.causal, chunk_size=p.chunk_size,
            plan=scan,
        )  # fmt: skip
        return finish(call, p, causal_path.normalise(xp, outputs_aug), kv, log_shift)


EXECUTOR = Portable()
