""":class:`MultiheadAttention`, a drop-in for :class:`torch.nn.MultiheadAttention` that
runs :class:`linattn.torch.FastAttention` (:meth:`MultiheadAttention.from_torch` swaps a
model's layer, weights included), and its masks' translation.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional

from linattn.torch.layers import FastAttention


class MultiheadAttention(nn.Module):
    """A drop-in for :class:`torch.nn.MultiheadAttention` running linear attention.

    Same constructor, parameter names (``in_proj_weight`` or ``q/k/v_proj_weight``,
    ``in_proj_bias``, ``out_proj``) and call, so a model swaps its attention in one line:
    ``MultiheadAttention.from_torch(model.attn)``.  No attention matrix exists, so
    ``need_weights`` defaults to False and the call returns ``(output, None)``.

    Parameters
    ----------
    embed_dim, num_heads, bias, kdim, vdim, batch_first, device, dtype
        As for :class:`torch.nn.MultiheadAttention`.
    dropout : float, default 0.0
        Only 0: linear attention has no attention weights to drop.
    add_bias_kv, add_zero_attn : bool, default False
        Only False.
    causal : bool, default False
        Causal attention (also chosen per call by ``is_causal=True`` or a causal
        ``attn_mask``).
    **options
        Passed to :class:`FastAttention` (``num_features``, ``kind``, ``redraw_interval``,
        ``seed``, ...); without ``feature_map`` the default is ``kind="hyperbolic",
        rebalance=False``, which serves causal and bidirectional calls alike (each call
        may choose: ``is_causal=True``, a causal ``attn_mask``).

    Examples
    --------
    >>> import torch
    >>> from linattn.torch import MultiheadAttention
    >>> mha = torch.nn.MultiheadAttention(32, 4, batch_first=True)
    >>> fast = MultiheadAttention.from_torch(mha, num_features=64)
    >>> x = torch.randn(2, 10, 32)
    >>> out, weights = fast(x, x, x)
    >>> out.shape, weights
    (torch.Size([2, 10, 32]), None)
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device: Any = None,
        dtype: Any = None,
        *,
        causal: bool = False,
        **options: Any,
    ) -> None:
        super().__init__()
        if embed_dim <= 0 or num_heads <= 0 or embed_dim % num_heads:
            raise ValueError(
                f"embed_dim must be a positive multiple of num_heads; got embed_dim="
                f"{embed_dim}, num_heads={num_heads}"
            )
        if dropout != 0.0:
            raise ValueError(
                f"dropout must be 0.0: linear attention has no attention weights to drop; "
                f"got {dropout!r}"
            )
        for name, value in (("add_bias_kv", add_bias_kv), ("add_zero_attn", add_zero_attn)):
            if value:
                raise ValueError(f"{name} must be False (not supported); got {value!r}")
        factory = {"device": device, "dtype": dtype}
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.batch_first, self.dropout = batch_first, 0.0
        if self._qkv_same_embed_dim:
            self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim, **factory))
        else:
            self.q_proj_weight = nn.Parameter(torch.empty(embed_dim, embed_dim, **factory))
            self.k_proj_weight = nn.Parameter(torch.empty(embed_dim, self.kdim, **factory))
            self.v_proj_weight = nn.Parameter(torch.empty(embed_dim, self.vdim, **factory))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * embed_dim, **factory)) if bias else None
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        if "feature_map" not in options:
            # A drop-in's calls choose causal per call (``is_causal``, a causal
            # ``attn_mask``: nn.TransformerDecoderLayer's): by default a map that needs no
            # statistics, which serves both (OPRF and rebalancing need them fixed for
            # causal calls, and raised there).
            options.setdefault("kind", "hyperbolic")
            options.setdefault("rebalance", False)
        self.attention = FastAttention(self.head_dim, causal=causal, **options)
        self.attention.to(device)
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        """torch's initialisation: Xavier-uniform projections, zero biases."""
        for name in ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight"):
            if hasattr(self, name):
                nn.init.xavier_uniform_(getattr(self, name))
        if self.out_proj.bias is not None:
            nn.init.zeros_(self.out_proj.bias)

    @classmethod
    def from_torch(cls, mha: nn.MultiheadAttention, **options: Any) -> MultiheadAttention:
        """The same layer, weights included, with linear attention; ``options`` as above.

        Raises
        ------
        ValueError
            For an ``mha`` with dropout (pass ``dropout=0.0`` to drop it), ``bias_k`` /
            ``bias_v`` or ``add_zero_attn``.
        """
        if not isinstance(mha, nn.MultiheadAttention):
            raise TypeError(f"mha must be a torch.nn.MultiheadAttention; got {type(mha).__name__}")
        weight = mha.out_proj.weight
        config: dict[str, Any] = {
            "dropout": mha.dropout,
            "bias": mha.in_proj_bias is not None,
            "add_bias_kv": mha.bias_k is not None,
            "add_zero_attn": mha.add_zero_attn,
            "kdim": mha.kdim,
            "vdim": mha.vdim,
            "batch_first": mha.batch_first,
            "device": weight.device,
            "dtype": weight.dtype,
        }
        layer = cls(mha.embed_dim, mha.num_heads, **{**config, **options})
        missing, unexpected = layer.load_state_dict(mha.state_dict(), strict=False)
        left = [name for name in missing if not name.startswith("attention.")]
        if left or unexpected:
            raise ValueError(
                f"mha's state_dict does not match: missing {left}, unexpected {unexpected}"
            )
        layer.train(mha.training)
        return layer

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = False,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, None]:
        """As :meth:`torch.nn.MultiheadAttention.forward`; returns ``(output, None)``.

        ``attn_mask`` may only be the causal mask (boolean True above the diagonal, or
        ``-inf`` there and 0 elsewhere); ``key_padding_mask`` is True for padding.
        """
        if need_weights:
            raise ValueError(
                "need_weights must be False: linear attention never forms the attention "
                "weights; got need_weights=True (use torch.nn.MultiheadAttention to inspect "
                "them)"
            )
        batched = query.ndim == 3
        if not batched:  # (L, E): one unbatched sequence
            query, key, value = (
                x.unsqueeze(0 if self.batch_first else 1) for x in (query, key, value)
            )
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        if not self.batch_first:
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))
        causal = self.attention.causal or is_causal
        if attn_mask is not None and not is_causal:
            _check_causal_mask(attn_mask, query.shape[1], key.shape[1])
            causal = True
        q, k, v = self._in_projection(query, key, value)
        keep = None if key_padding_mask is None else _keep_from_padding(key_padding_mask)
        out = self.attention(q, k, v, keep, causal=causal)
        batch, length = query.shape[0], query.shape[1]
        out = out.transpose(1, 2).reshape(batch, length, self.embed_dim)
        out = self.out_proj(out)
        if not self.batch_first:
            out = out.transpose(0, 1)
        if not batched:
            out = out.squeeze(0 if self.batch_first else 1)
        return out, None

    def _in_projection(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(B, L, E)`` inputs to ``(B, H, L, head_dim)`` queries, keys and values."""
        if self._qkv_same_embed_dim:
            weights = self.in_proj_weight.chunk(3)
        else:
            weights = (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight)
        biases = (None,) * 3 if self.in_proj_bias is None else self.in_proj_bias.chunk(3)
        heads = []
        for x, w, b in zip((query, key, value), weights, biases, strict=True):
            y = functional.linear(x, w, b)
            heads.append(y.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2))
        return heads[0], heads[1], heads[2]


def _keep_from_padding(key_padding_mask: torch.Tensor) -> torch.Tensor:
    """torch's padding mask (True, or ``-inf``, for padding) to linattn's keep mask."""
    if key_padding_mask.dtype == torch.bool:
        return ~key_padding_mask
    if key_padding_mask.is_floating_point():
        padding = torch.isneginf(key_padding_mask)
        if bool(((key_padding_mask != 0) & ~padding).any()):
            raise ValueError(
                "key_padding_mask must be boolean (True for padding) or hold only 0 and "
                "-inf; got a float mask with other values (an additive bias)"
            )
        return ~padding
    raise TypeError(f"key_padding_mask must be boolean or float; got {key_padding_mask.dtype}")


def _check_causal_mask(attn_mask: torch.Tensor, query_length: int, key_length: int) -> None:
    """``attn_mask`` must be the causal mask; anything else linear attention cannot honour."""
    shape = (query_length, key_length)
    upper = torch.ones(shape, dtype=torch.bool, device=attn_mask.device).triu(1)
    if attn_mask.dtype == torch.bool:
        causal = tuple(attn_mask.shape) == shape and torch.equal(attn_mask, upper)
    else:
        expected = torch.zeros(shape, dtype=attn_mask.dtype, device=attn_mask.device)
        expected = expected.masked_fill(upper, -math.inf)
        causal = tuple(attn_mask.shape) == shape and torch.equal(attn_mask, expected)
    if not causal:
        raise ValueError(
            f"attn_mask must be the causal mask of shape {shape} (True, or -inf, above the "
            f"diagonal) or None: linear attention cannot apply arbitrary masks; got a "
            f"{attn_mask.dtype} mask of shape {tuple(attn_mask.shape)} that is not causal"
        )
