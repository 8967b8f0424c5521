"""The causal kernels as torch custom operators: ``torch.ops.linattn.causal_forward``
(and ``causal_forward_scaled``, which also returns each row's ``log_scale``) and
``torch.ops.linattn.causal_backward``, on CPU and CUDA tensors.

Registered through ``torch.library.custom_op`` when this module is first imported
(by :mod:`linattn_numba.libraries` or by ``linattn``, when a torch tensor first reaches a
kernel; ``import linattn`` never imports torch).  The operators are opaque to
``torch.compile`` (no graph break: each has a fake implementation that gives output
shapes and dtypes from the inputs' alone), differentiable through ``register_autograd``
(also under ``torch.func.grad`` and ``vjp``), and refuse ``torch.func.vmap`` with a
clear ``NotImplementedError``.  The device code is imported inside each kernel: the CPU
one from the passes of :mod:`linattn_numba.cpu` (NumPy views of the tensors), the CUDA
one from :mod:`linattn_numba.gpu.host` (numba-cuda, imported only when a CUDA tensor
arrives).

Gradients.  The kernel's own stabilisers (the output ``log_shift`` and the per-row
and per-key shifts inside it) are treated as constants by the backward pass.  That
is exact for the normalised outputs ``O[..., :d_v] / O[..., d_v]`` and for anything
computed from the state that does not change when the shift does, because
numerator and denominator share every shift.  The output ``log_shift`` is therefore
marked non-differentiable, and so is ``causal_forward_scaled``'s ``log_scale`` (the
true ``[num | den]`` is ``exp(log_scale)`` times the output row): the log-normaliser
``log(outputs_aug[..., -1]) + log_scale`` gets its exact gradient through the
denominator column.  The *input* state ``(S, mu)`` stands for ``S exp(mu)``,
so the input ``mu`` gets the gradient of that product, ``d mu = sum_e dS * S``: a
state whose ``mu`` was computed with gradients (by the array-API path) continues
exactly.

Examples
--------
>>> import torch
>>> from linattn_numba import torch_ops
>>> lq = torch.zeros(1, 3, 1)  # one feature, equal: causal attention is a running mean
>>> va = torch.tensor([[[0.0, 1.0], [1.0, 1.0], [2.0, 1.0]]], requires_grad=True)
>>> kv, mu = torch.zeros(1, 1, 2), torch.full((1, 1), -torch.inf)
>>> out, kv_out, mu_out = torch.ops.linattn.causal_forward(lq, lq, va, kv, mu, 2)
>>> (out[..., 0] / out[..., 1]).tolist()
[[0.0, 0.5, 1.0]]
>>> out[..., 0].sum().backward()
>>> va.grad[0, :, 0].tolist()  # each value reaches its own and every later output
[3.0, 2.0, 1.0]
>>> out, _, _, scale = torch_ops.causal("cpu", lq, lq, va, kv, mu, 2, return_log_scale=True)
>>> (out[..., 1].log() + scale).exp().tolist()  # the true denominators
[[1.0, 2.0, 3.0]]
"""

from __future__ import annotations

from linattn_numba.torch_ops.fused import (
    bidirectional,
    bidirectional_backward,
    bidirectional_forward,
    causal_fused,
    causal_fused_backward,
    causal_fused_forward,
)
from linattn_numba.torch_ops.scan import (
    causal,
    causal_backward,
    causal_forward,
    causal_forward_scaled,
)
from linattn_numba.torch_ops.support import NAMESPACE

__all__ = [
    "NAMESPACE",
    "bidirectional",
    "bidirectional_backward",
    "bidirectional_forward",
    "causal",
    "causal_backward",
    "causal_forward",
    "causal_forward_scaled",
    "causal_fused",
    "causal_fused_backward",
    "causal_fused_forward",
]
