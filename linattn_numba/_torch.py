"""Wrap a compiled forward/backward pair as a differentiable torch kernel (any device).

The device code (CPU via ``.numpy()``, CUDA via ``__cuda_array_interface__``) lives
with each kernel; this module only builds the ``torch.autograd.Function``.

The kernel's own stabilisers (the output ``log_shift`` and the per-row and per-key
shifts inside it) are treated as constants by the backward pass.  That is exact for
the normalised outputs ``O[..., :d_v] / O[..., d_v]`` and for anything computed from
the state that does not change when the shift does, because numerator and
denominator share every shift.  The output ``log_shift`` is therefore marked
non-differentiable.  The *input* state ``(S, mu)`` stands for ``S exp(mu)``, so the
input ``mu`` gets the gradient of that product, ``d mu = sum_e dS * S``: a state whose
``mu`` was computed with gradients (by the array-API path) continues exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["autograd_kernel"]

Forward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
Backward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]


def autograd_kernel(forward: Forward, backward: Backward) -> Callable[..., Any]:
    """A kernel ``(lq, lk, va, kv, mu, chunk_size) -> (out_aug, kv_out, mu_out)`` with autograd.

    Parameters
    ----------
    forward : callable
        ``forward(lq, lk, va, kv, mu, chunk_size) -> (out_aug, kv_out, mu_out)`` on
        torch tensors (no autograd inside).
    backward : callable
        ``backward(lq, lk, va, kv, mu, chunk_size, d_out_aug, d_kv_out)
        -> (d_lq, d_lk, d_va, d_kv)`` on torch tensors.

    Returns
    -------
    callable
        Same signature as ``forward``; gradients reach ``lq``, ``lk``, ``va``, ``kv``
        and ``mu`` (the last through the product ``kv exp(mu)`` it stands for).

    Examples
    --------
    >>> import torch
    >>> def fwd(lq, lk, va, kv, mu, c):
    ...     return 2 * va, kv + 1, mu.clone()
    >>> def bwd(lq, lk, va, kv, mu, c, d_out, d_kv):
    ...     return torch.zeros_like(lq), torch.zeros_like(lk), 2 * d_out, d_kv
    >>> kernel = autograd_kernel(fwd, bwd)
    >>> va = torch.ones(3, requires_grad=True)
    >>> out, kv, mu = kernel(va, va, va, torch.zeros(1), torch.zeros(1), 4)
    >>> out.sum().backward()
    >>> va.grad
    tensor([2., 2., 2.])
    """

    class CausalKernel(torch.autograd.Function):
        @staticmethod
        def forward(
            ctx: Any,
            lq: torch.Tensor,
            lk: torch.Tensor,
            va: torch.Tensor,
            kv: torch.Tensor,
            mu: torch.Tensor,
            chunk_size: int,
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            out, kv_out, mu_out = forward(
                lq.detach(), lk.detach(), va.detach(), kv.detach(), mu.detach(), chunk_size
            )
            ctx.save_for_backward(lq, lk, va, kv, mu)
            ctx.chunk_size = chunk_size
            ctx.shapes = (out.shape, kv_out.shape)
            ctx.mark_non_differentiable(mu_out)
            return out, kv_out, mu_out

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(
            ctx: Any, d_out: torch.Tensor | None, d_kv: torch.Tensor | None, _d_mu: Any
        ) -> tuple[torch.Tensor | None, ...]:
            lq, lk, va, kv, mu = ctx.saved_tensors
            out_shape, kv_shape = ctx.shapes
            if d_out is None:
                d_out = torch.zeros(out_shape, dtype=va.dtype, device=va.device)
            if d_kv is None:
                d_kv = torch.zeros(kv_shape, dtype=kv.dtype, device=kv.device)
            grads = backward(
                lq, lk, va, kv, mu, ctx.chunk_size, d_out.contiguous(), d_kv.contiguous()
            )
            needed = ctx.needs_input_grad
            d_mu = (grads[3] * kv).sum(-1) if needed[4] else None  # S exp(mu) is the state
            return (
                *(g if needed[i] else None for i, g in enumerate(grads)),
                d_mu,
                None,  # chunk_size
            )

    return CausalKernel.apply  # (lq, lk, va, kv, mu, chunk_size), positional
