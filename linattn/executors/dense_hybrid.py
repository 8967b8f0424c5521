"""A short self-attention hybrid with a fitted map as ``L x L`` weights per head, in
matrix products (:func:`linattn.hybrid.dense.dense_attention`: torch's fused attention
kernel or the array API's softmax for the near keys, one product of the fitted features
for the far keys); torch CPU tensors and JAX arrays, as :mod:`linattn._plan` decides."""

from __future__ import annotations

from typing import Any

from linattn._call import Call, check_exact_call
from linattn._xp import Array
from linattn.hybrid.dense import dense_attention

__all__ = ["run"]


def run(call: Call, plan: Any, sub_call: Any) -> tuple[Array, None]:
    """Run ``call`` (see :mod:`linattn.executors`): the output, no state."""
    options = call.options()
    del options["backend"]
    checked = check_exact_call(call.q, call.k, call.v, call.feature_map, plan=plan.scan, **options)
    xp = checked.info.xp
    out = dense_attention(
        xp, checked.q, checked.k, checked.v, call.key_mask, checked.exact, call.feature_map,
        causal=call.causal, scale=checked.scale,
    )  # fmt: skip
    return xp.astype(out, checked.info.dtype, copy=False), None
