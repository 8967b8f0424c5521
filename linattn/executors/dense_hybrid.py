"""A short self-attention hybrid with a fitted map (or its exact parts alone: window,
sinks and exact keys, torch without a gradient) as ``L x L`` weights per head, in
matrix products (:func:`linattn.hybrid.dense.dense_attention`: torch's fused attention
kernel or the array API's softmax for the near keys, one product of the fitted features
for the far keys); torch CPU tensors and JAX arrays on the CPU, up to the lengths of
:func:`linattn.hybrid.dense.max_length`."""

from __future__ import annotations

from linattn import _dispatch
from linattn._call import Call, check_exact_call
from linattn.executors.base import Executor, Result, Runner, Takes, library
from linattn.hybrid import dense

__all__ = ["EXECUTOR", "DenseHybrid"]


class DenseHybrid(Executor):
    name = "dense-hybrid"
    summary = (
        "a short self-attention hybrid with a fitted map, or the exact parts alone, as "
        "matrix products: torch CPU "
        "tensors (torch's fused attention kernel for the near keys; autograd "
        "differentiates it) or JAX arrays on the CPU (eager or traced; JAX differentiates it)"
    )
    takes = Takes(
        libraries=("torch-cpu", "jax-cpu"),
        exact_parts=True,
        state=False,
        maps=("fitted", "none"),
        dtypes=("float32", "float64"),
        backends=("auto",),  # (measured against the kernels and the portable parts)
    )

    def more_reasons(self, call: Call, scan: _dispatch.Plan) -> list[str]:
        if library(call.q) == "jax-cpu":
            kind = "jax"
        else:
            if not all(isinstance(n, int) for x in (call.q, call.k, call.v) for n in x.shape):
                return ["symbolic shapes (torch.compile with dynamic shapes)"]
            import torch

            grad = torch.is_grad_enabled() and any(
                x.requires_grad for x in (call.q, call.k, call.v)
            )
            kind = "torch-grad" if grad else "torch"
        if call.feature_map is None:  # the near keys alone: measured without a gradient
            if kind != "torch":
                return ["no feature map with a gradient or on JAX (the parts merge there)"]
            kind = "torch-near"
        why = dense.why_not(call.causal, kind, call.q.shape[-2], call.k.shape[-2])
        return [] if why is None else [why]

    def run(self, call: Call, scan: _dispatch.Plan, attend: Runner) -> Result:
        options = call.options()
        del options["backend"]
        checked = check_exact_call(call.q, call.k, call.v, call.feature_map, plan=scan, **options)
        xp = checked.info.xp
        out = dense.dense_attention(
            xp, checked.q, checked.k, checked.v, call.key_mask, checked.exact, call.feature_map,
            causal=call.causal, scale=checked.scale,
        )  # fmt: skip
        return xp.astype(out, checked.info.dtype, copy=False), None


EXECUTOR = DenseHybrid()
