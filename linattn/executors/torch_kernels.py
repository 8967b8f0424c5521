"""Torch CPU tensors with exact parts (window, sinks, exact keys), run by the compiled
kernels NumPy arrays get: the one-pass hybrid passes, the window kernel.

The tensors reach, as NumPy views, the executor the plan chooses for the same call on
NumPy arrays (a hybrid-*-fused one or hybrid-parts, whose window part is compiled),
through the custom operator ``linattn::exact_parts_forward``.  Its gradient is
``linattn::exact_parts_backward``: the parts' adjoints on NumPy views
(:func:`linattn._call.exact_parts_vjp`: the window kernel's backward, the far keys'
compiled scan).  Both operators are opaque to ``torch.compile`` (no graph break) and
allocate nothing of ``L x d_v`` but their results.

The operators (:mod:`linattn.executors.torch_operators`) take tensors and scalars only:
the feature map travels as its fingerprint, and the NumPy call runs through the plan's
runner (:mod:`linattn.executors.sub_calls`).
"""

from __future__ import annotations

from linattn import _dispatch
from linattn._call import Call
from linattn.executors.base import Executor, Result, Runner, Takes

__all__ = ["EXECUTOR", "TorchKernels"]


class TorchKernels(Executor):
    name = "torch-kernels"
    summary = (
        "torch CPU tensors with exact parts, through the compiled kernels the same call on "
        "NumPy arrays gets (custom operators, forward and backward)"
    )
    takes = Takes(
        libraries=("torch-cpu",),
        exact_parts=True,
        state=False,  # (decoding runs on the tensors)
        dtypes=("float32", "float64"),
        backends=("auto", "numba"),
    )
    compiled = True

    def more_reasons(self, call: Call, scan: _dispatch.Plan) -> list[str]:
        # Read from types, devices, shapes and dtypes only: no array is made (the plan
        # runs inside torch.compile's tracing, which would trace NumPy calls too).
        if not isinstance(call.sink_keys, int):
            return ["sink_keys is not an int"]
        masks = {"key_mask": call.key_mask, "exact_key_mask": call.exact_key_mask}
        for name, x in {"q": call.q, "k": call.k, "v": call.v, **masks}.items():
            if x is None:
                continue
            if _dispatch.library_of(x) != "torch" or x.device.type != "cpu":
                return ["not torch CPU tensors"]
            if not all(isinstance(n, int) for n in x.shape):
                return ["symbolic shapes (torch.compile with dynamic shapes)"]
            if name in masks and str(x.dtype) != "torch.bool":
                return [f"{name} is {str(x.dtype).removeprefix('torch.')}, not bool"]
        why = _dispatch.numpy_kernels_why_not(scan.backend)
        return [] if why is None else [why]

    def run(self, call: Call, scan: _dispatch.Plan, attend: Runner) -> Result:
        """The output, no state."""
        from linattn.executors import torch_operators  # (registers them; imports torch)

        map_key = "" if call.feature_map is None else call.feature_map.fingerprint
        out = torch_operators.exact_parts_forward(
            call.q,
            call.k,
            call.v,
            call.key_mask,
            call.exact_key_mask,
            map_key,
            bool(call.causal),
            call.window,
            int(call.sink_keys),
            call.chunk_size,
            call.scale,
            None if call.backend is None else str(call.backend),
        )
        return out, None


EXECUTOR = TorchKernels()
