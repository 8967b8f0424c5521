"""The differentiable fitted call of :mod:`linattn.torch`: :func:`fitted_attention`, a
fitted map whose parameters are tensors, trained with torch's autograd.

The dense form of the hybrid at training lengths (:mod:`linattn._fitted_call`), else
:func:`linattn.linear_attention` forward and :func:`linattn.linear_attention_vjp`
(``parameters=True``) backward, in one :class:`torch.autograd.Function`.
"""

from __future__ import annotations

from typing import Any

import torch

from linattn._dispatch import Backend
from linattn._fitted_call import check_dense_call, dense_hybrid, use_dense
from linattn.attention import linear_attention
from linattn.features import FeatureMap
from linattn.vjp import linear_attention_vjp

#: A fitted map's parameters, one buffer each (``key_*`` are ``None`` for tied maps).
FITTED_BUFFERS = ("query_weight", "query_bias", "key_weight", "key_bias", "far_weight")


def fitted_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_weight: torch.Tensor,
    query_bias: torch.Tensor | None = None,
    *,
    key_weight: torch.Tensor | None = None,
    key_bias: torch.Tensor | None = None,
    far_weight: torch.Tensor | float | None = None,
    tied: bool = False,
    causal: bool = False,
    key_mask: torch.Tensor | None = None,
    window: int | None = None,
    sink_keys: int = 0,
    exact_key_mask: torch.Tensor | None = None,
    scale: float | None = None,
    chunk_size: int | None = None,
    backend: Backend | None = None,
    dense: bool | None = None,
) -> torch.Tensor:
    """:func:`linattn.linear_attention` with a fitted map whose parameters are tensors,
    differentiable in them as in ``q``, ``k`` and ``v``.

    The map is :meth:`linattn.FeatureMap.fitted` of the parameters' values (checked
    there: shapes, heads, ``far_weight >= 0``).  Long inputs take the library's path: the
    forward pass is :func:`linattn.linear_attention`'s (its compiled kernels included),
    the backward pass :func:`linattn.linear_attention_vjp` with ``parameters=True``, on
    host copies.  Self-attention of at most
    :data:`linattn._fitted_call.DENSE_MAX_LENGTH` tokens (training lengths) takes the
    dense form, the same hybrid as ``L x L`` weights per head in torch, differentiated
    by autograd on the tensors' device (faster there; ``dense=`` forces either).
    ``far_weight`` must stay non-negative: parametrise it (``far_weight=log_g.exp()``);
    a head with ``g = 0`` has chosen the exact parts and gets no gradient.

    Parameters
    ----------
    q, k, v : torch.Tensor
        As for :func:`linattn.linear_attention`.
    query_weight, query_bias, key_weight, key_bias, far_weight, tied, scale
        As for :meth:`linattn.FeatureMap.fitted` (``key_*`` absent when ``tied``);
        tensors, gradients for those that require them.
    causal, key_mask, window, sink_keys, exact_key_mask, chunk_size, backend
        As for :func:`linattn.linear_attention`.
    dense : bool, optional
        ``True``: the dense form; ``False``: the library's path; ``None`` (default):
        the dense form for self-attention of at most ``DENSE_MAX_LENGTH`` tokens when no
        ``backend`` is named (:func:`linattn._fitted_call.use_dense`, the one place that
        chooses).

    Returns
    -------
    torch.Tensor
        The attention output, ``(..., L, d_v)``.

    Examples
    --------
    >>> import torch
    >>> from linattn.torch import fitted_attention
    >>> w = torch.eye(4).repeat(2, 1, 1).requires_grad_()  # 2 heads, d = 4, m = 8
    >>> q = k = v = torch.randn(1, 2, 6, 4)
    >>> out = fitted_attention(q, k, v, w, tied=True, window=2, sink_keys=1)
    >>> out.sum().backward()
    >>> w.grad.shape
    torch.Size([2, 4, 4])
    """
    parameters = (query_weight, query_bias, key_weight, key_bias, far_weight)
    values = {
        name: value.detach() if isinstance(value, torch.Tensor) else value
        for name, value in zip(FITTED_BUFFERS, parameters, strict=True)
    }
    options = {
        "causal": causal, "key_mask": key_mask, "window": window, "sink_keys": sink_keys,
        "exact_key_mask": exact_key_mask, "chunk_size": chunk_size, "backend": backend,
    }  # fmt: skip
    if use_dense(dense, backend, q, k):  # no host copy of the map
        check_dense_call(q, k, v, values, tied, scale, options)
        dense_out: torch.Tensor = dense_hybrid(
            q, k, v, query_weight, query_bias, key_weight=key_weight, key_bias=key_bias,
            far_weight=far_weight, tied=tied, causal=causal, key_mask=key_mask,
            window=window, sink_keys=sink_keys, exact_key_mask=exact_key_mask, scale=scale,
        )  # fmt: skip
        return dense_out
    feature_map = FeatureMap.fitted(values.pop("query_weight"), **values, tied=tied, scale=scale)
    out: torch.Tensor = _FittedAttention.apply(feature_map, options, q, k, v, *parameters)
    return out


class _FittedAttention(torch.autograd.Function):
    """``linear_attention`` forward, ``linear_attention_vjp(parameters=True)`` backward."""

    @staticmethod
    def forward(
        ctx: Any, feature_map: FeatureMap, options: dict[str, Any], q: torch.Tensor,
        k: torch.Tensor, v: torch.Tensor, *parameters: Any,
    ) -> torch.Tensor:  # fmt: skip
        ctx.feature_map, ctx.options = feature_map, options
        ctx.parameters = parameters
        ctx.save_for_backward(q, k, v)
        out: torch.Tensor = linear_attention(q, k, v, feature_map, **options)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        q, k, v = ctx.saved_tensors
        dq, dk, dv, d_parameters = linear_attention_vjp(
            q, k, v, ctx.feature_map, grad.contiguous(), parameters=True, **ctx.options
        )
        out: list[Any] = [None, None, dq, dk, dv]
        for name, value in zip(FITTED_BUFFERS, ctx.parameters, strict=True):
            wanted = isinstance(value, torch.Tensor) and value.requires_grad
            cotangent = d_parameters.get(name)
            out.append(
                torch.as_tensor(cotangent, dtype=value.dtype, device=value.device)
                if wanted and cotangent is not None
                else None
            )
        return tuple(out)
