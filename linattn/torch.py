"""PyTorch layers: :class:`FastAttention` (an attention op with its own features) and
:class:`MultiheadAttention`, a drop-in for :class:`torch.nn.MultiheadAttention`.

The layers only wire projections, masks and the feature schedule to
:func:`linattn.linear_attention`; they never re-implement attention.  The random
projection is a registered buffer, so it is saved in ``state_dict``, moved by
``.to(device)`` and broadcast by DistributedDataParallel; redraws are seeded from
``seed`` plus a draw counter (also a buffer), so every rank draws the same matrix.
A fitted map's parameters (``feature_map=``, :mod:`linattn.fitted`) are buffers likewise:
fitted by :mod:`linattn.transfer` with the model frozen, not trained by the layer, unless
``train_map=True`` makes them ``nn.Parameter``s.
:func:`fitted_attention` is the call to train them with torch's autograd: the map's
parameters are tensors, differentiated through the dense form of the hybrid at training
lengths (:mod:`linattn._fitted_call`) or :func:`linattn.linear_attention_vjp`
(``parameters=True``) beyond.
Importing :mod:`linattn` never imports this module (or torch).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional

from linattn._call import hybrid_options
from linattn._dispatch import Backend
from linattn._fitted_call import check_dense_call, dense_hybrid, use_dense
from linattn._layer_maps import check_exact_heads, exact_heads_decoding_error, fitted_template
from linattn.attention import linear_attention, with_exact_heads
from linattn.features import FeatureMap, Kind, kind_spec
from linattn.projections import Norms, gaussian_projection
from linattn.state import LinearAttentionState
from linattn.vjp import linear_attention_vjp

__all__ = ["FastAttention", "MultiheadAttention", "fitted_attention"]

#: The hybrid's options (:mod:`linattn.hybrid`), passed to :func:`linattn.linear_attention`.
HYBRID_OPTIONS = ("window", "sink_keys")

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


class FastAttention(nn.Module):
    """Random-feature attention on ``(B, H, L, d)`` tensors, with a redraw schedule.

    Parameters
    ----------
    head_dim : int
        Dimension ``d`` of queries and keys.
    num_features : int, optional
        Random features ``m`` (default 256; a fitted map's own).
    kind : str, optional
        Feature kind (:class:`linattn.FeatureMap`); default ``"hyperbolic"`` for causal
        and ``"hyperbolic_oprf"`` (statistics from each call) for bidirectional attention.
        ``"hedgehog"`` makes a fitted map at its identity start.
    feature_map : FeatureMap, optional
        A fitted map (:meth:`linattn.FeatureMap.fitted`, :func:`linattn.transfer.load_maps`):
        its parameters become buffers (``query_weight``, ``query_bias``, ``key_weight``,
        ``key_bias``, ``far_weight``; the keys' absent when tied), saved in ``state_dict``
        and loaded back.  Per-head parameters need inputs with that many heads.
    train_map : bool, default False
        A fitted map's parameters become ``nn.Parameter``s (same names in ``state_dict``)
        that the layer's optimiser trains: calls with gradients enabled run
        :func:`fitted_attention` (no decoding state there), others the map made from
        the parameters' current values.  The far weight is used as ``max(g, 0)``: a head
        whose ``g`` falls to 0 has chosen the exact parts and gets no gradient.
    causal : bool, default False
        Query ``i`` attends to keys ``j <= i``.
    window, sink_keys : optional
        The exact sliding window and sink keys of the hybrid, passed to
        :func:`linattn.linear_attention` (where it accepts them).
    exact_heads : sequence of int, default ()
        Query heads that attend to every key exactly (softmax), the others as above: a
        converted model's exact heads (:func:`linattn.transfer.exact_heads_of` of its
        maps' file; :func:`linattn.with_exact_heads`).  Such a layer does not decode (no
        state keeps their keys).
    redraw_interval : int, optional
        Draw a new projection every this many forward calls made in training mode with
        gradients enabled (calls that recompute a checkpointed activation in the backward
        pass do not count); ``None`` never redraws.  ``eval()`` never redraws.
    seed : int, default 0
        The first projection's seed; the ``n``-th redraw uses ``seed + n``.
    orthogonal, norms, scale, rebalance
        As for :class:`linattn.FeatureMap` (``rebalance`` defaults to ``not causal``).
    chunk_size, backend
        As for :func:`linattn.linear_attention`.

    Examples
    --------
    >>> import torch
    >>> from linattn.torch import FastAttention
    >>> attention = FastAttention(16, 64, causal=True, redraw_interval=100)
    >>> q = k = v = torch.randn(2, 4, 32, 16)
    >>> attention(q, k, v).shape
    torch.Size([2, 4, 32, 16])
    >>> sorted(attention.state_dict())
    ['draws', 'forward_calls', 'projection']

    A fitted map, one per head, with a window and a sink:

    >>> import numpy as np
    >>> import linattn as la
    >>> fm = la.FeatureMap.fitted(np.zeros((4, 16, 8)), tied=True, far_weight=0.5)
    >>> fitted = FastAttention(16, feature_map=fm, causal=True, window=4, sink_keys=1)
    >>> fitted(q, k, v).shape, sorted(fitted.state_dict())[:3]
    (torch.Size([2, 4, 32, 16]), ['draws', 'far_weight', 'forward_calls'])
    """

    projection: torch.Tensor | None
    forward_calls: torch.Tensor
    draws: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        num_features: int | None = None,
        *,
        kind: Kind | None = None,
        feature_map: FeatureMap | None = None,
        causal: bool = False,
        window: int | None = None,
        sink_keys: int = 0,
        redraw_interval: int | None = None,
        seed: int = 0,
        orthogonal: bool = True,
        norms: Norms = "chi",
        scale: float | None = None,
        rebalance: bool | None = None,
        chunk_size: int | None = None,
        backend: Backend | None = None,
        train_map: bool = False,
        exact_heads: Sequence[int] = (),
    ) -> None:
        super().__init__()
        self.exact_heads = check_exact_heads(exact_heads)
        if not isinstance(causal, bool):
            raise TypeError(f"causal must be True or False; got {causal!r}")
        if not isinstance(train_map, bool):
            raise TypeError(f"train_map must be True or False; got {train_map!r}")
        interval: object = redraw_interval  # (what was given: the annotation says what to give)
        if interval is not None and (
            isinstance(interval, bool) or not isinstance(interval, int) or interval < 1
        ):
            raise ValueError(
                f"redraw_interval must be a positive integer or None; got {interval!r}"
            )
        kind = kind if kind is not None else ("hyperbolic" if causal else "hyperbolic_oprf")
        rebalance = (not causal) if rebalance is None else rebalance
        if feature_map is not None:
            template = fitted_template(feature_map, head_dim, num_features, redraw_interval)
            kind, num_features, rebalance = "hedgehog", template.num_features, False
        else:
            # The map checks every option; its projection becomes the buffer.
            template = FeatureMap(
                head_dim,
                256 if num_features is None else num_features,
                kind=kind,
                orthogonal=orthogonal,
                norms=norms,
                scale=scale,
                seed=seed,
                rebalance=rebalance and kind_spec(kind).random,
            )
            num_features = template.num_features
        self.head_dim, self.num_features, self.kind = head_dim, num_features, kind
        self.causal, self.seed, self.redraw_interval = causal, seed, redraw_interval
        self.orthogonal, self.norms, self.scale = orthogonal, norms, template.scale
        self.rebalance, self.chunk_size, self.backend = template.rebalance, chunk_size, backend
        self.hybrid = hybrid_options(window=window, sink_keys=sink_keys)
        projection = template.projection
        # float64, as drawn: the map made from the buffer is the seed's map, bit for bit.
        self.register_buffer(
            "projection", None if projection is None else torch.from_numpy(projection.copy())
        )
        self.register_buffer("forward_calls", torch.zeros((), dtype=torch.int64))
        self.register_buffer("draws", torch.zeros((), dtype=torch.int64))
        parameters = template.parameters
        self.fitted = parameters is not None
        arrays = {} if parameters is None else parameters.arrays()
        if train_map and not self.fitted:
            raise ValueError(
                "train_map=True needs a fitted map (feature_map= or kind='hedgehog'); got "
                f"kind={kind!r}"
            )
        self.train_map = train_map
        for name in FITTED_BUFFERS if self.fitted else ():
            value = arrays.get(name)
            tensor = None if value is None else torch.tensor(value)
            if train_map:
                self.register_parameter(name, None if tensor is None else nn.Parameter(tensor))
            else:
                self.register_buffer(name, tensor)
        self._feature_map = template
        self._counts = (0, 0)  # host copies of (forward_calls, draws): no device sync per call
        # The map is always one adopted from the buffer, so a redraw changes no static
        # field that torch.compile guards on (no recompilation).
        self._seen: tuple[Any, ...] = ()
        self._sync()
        self.register_load_state_dict_post_hook(_after_load)
        if redraw_interval is not None:
            # Host logic: where an outer torch.compile region traces this layer, the hook
            # is a graph break (two per layer); a layer without a schedule has none.
            self.register_forward_pre_hook(_before_forward)

    @property
    def feature_map(self) -> FeatureMap:
        """The :class:`linattn.FeatureMap` made from the projection buffer.

        It follows the buffer through ``load_state_dict``, :meth:`redraw_projection` and
        the schedule; write the buffer by those means, not in place.
        """
        self._sync()
        return self._feature_map

    def extra_repr(self) -> str:
        heads = f", exact_heads={self.exact_heads}" if self.exact_heads else ""
        return (
            f"head_dim={self.head_dim}, num_features={self.num_features}, kind={self.kind!r}, "
            f"causal={self.causal}, redraw_interval={self.redraw_interval}, seed={self.seed}"
            + heads
        )

    @torch.no_grad()
    def redraw_projection(self) -> None:
        """Draw the next projection now, from ``seed + draws + 1`` (the same on every rank).

        Examples
        --------
        >>> from linattn.torch import FastAttention
        >>> attention = FastAttention(8, 16)
        >>> before = attention.projection.clone()
        >>> attention.redraw_projection()
        >>> int(attention.draws), bool((attention.projection != before).any())
        (1, True)
        """
        self._sync()
        calls, draws = self._counts
        if self.projection is not None:
            rows = self.num_features // kind_spec(self.kind).rows_per_feature
            fresh = gaussian_projection(
                rows,
                self.head_dim,
                orthogonal=self.orthogonal,
                norms=self.norms,
                seed=self.seed + draws + 1,
            )
            self.projection.copy_(torch.from_numpy(fresh))
        self._set_counts(calls, draws + 1)
        if self.projection is not None:
            self._seen = ()  # rebuild the map from the new buffer
            self._sync()

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_mask: torch.Tensor | None = None,
        state: LinearAttentionState | None = None,
        return_state: bool = False,
        *,
        causal: bool | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, LinearAttentionState]:
        """Attention of ``q (B, H, L_q, d)`` over ``k (B, H_kv, L_k, d)``, ``v``.

        ``H_kv`` may divide ``H`` (grouped-query attention; a state then has batch shape
        ``(B, H_kv, H / H_kv)``).  ``key_mask`` is True for keys that take part, of shape
        ``(B, L_k)`` or broadcasting against ``(B, H, L_k)``.  Autocast is off inside:
        half-precision inputs are computed with float32 state and returned in their dtype.
        ``causal`` overrides the layer's setting for this call.
        """
        if key_mask is not None and key_mask.ndim == 2 and q.ndim == 4:
            key_mask = key_mask[:, None, :]  # (B, L): one mask per sequence
        if self.exact_heads and (state is not None or return_state):
            raise exact_heads_decoding_error(self.exact_heads)
        if self.train_map:
            if torch.is_grad_enabled() and state is None and not return_state:
                out = self._train_map_forward(q, k, v, key_mask, causal)
                return self._with_exact_heads(out, q, k, v, key_mask, causal)
            self._sync()  # the map from the parameters' current values
        with torch.autocast(q.device.type, enabled=False):
            result = linear_attention(
                q,
                k,
                v,
                self._feature_map,
                causal=self.causal if causal is None else causal,
                key_mask=key_mask,
                state=state,
                return_state=return_state,
                chunk_size=self.chunk_size,
                backend=self.backend,
                **self.hybrid,
            )
        if return_state:
            out, new_state = result
            return out, new_state
        return self._with_exact_heads(result, q, k, v, key_mask, causal)

    def _with_exact_heads(
        self, out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        key_mask: torch.Tensor | None, causal: bool | None,
    ) -> torch.Tensor:  # fmt: skip
        """``out`` with the layer's exact heads spliced in (:func:`linattn.with_exact_heads`)."""
        if not self.exact_heads:
            return out
        with torch.autocast(q.device.type, enabled=False):
            spliced: torch.Tensor = with_exact_heads(
                out, q, k, v, self.exact_heads, causal=self.causal if causal is None else causal,
                key_mask=key_mask, scale=self.scale,
            )  # fmt: skip
        return spliced

    def _train_map_forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        key_mask: torch.Tensor | None, causal: bool | None,
    ) -> torch.Tensor:  # fmt: skip
        """:func:`fitted_attention` on the map's parameters (``train_map=True``)."""
        far_weight = self.far_weight.clamp_min(0.0)
        with torch.autocast(q.device.type, enabled=False):
            out = fitted_attention(
                q, k, v, self.query_weight, self.query_bias, key_weight=self.key_weight,
                key_bias=self.key_bias, far_weight=far_weight, tied=self.key_weight is None,
                causal=self.causal if causal is None else causal, key_mask=key_mask,
                scale=self.scale, chunk_size=self.chunk_size, backend=self.backend,
                **self.hybrid,
            )  # fmt: skip
        return out

    # -- the schedule, outside any compiled region -----------------------------------

    def _buffer_versions(self) -> tuple[Any, ...]:
        """What changes when anyone writes a buffer (load_state_dict, DDP, ``.to``)."""
        fitted = tuple(getattr(self, name) for name in FITTED_BUFFERS) if self.fitted else ()
        return tuple(
            None if b is None else (b._version, b.data_ptr(), b.dtype, b.device)
            for b in (self.projection, self.forward_calls, self.draws, *fitted)
        )

    def _sync(self) -> None:
        """Rebuild the feature map and host counters if a buffer was written from outside."""
        seen = self._buffer_versions()
        if seen == self._seen:
            return
        self._counts = (int(self.forward_calls), int(self.draws))
        if self.projection is not None:
            adopted = FeatureMap.from_projection(
                self.projection.detach().to(torch.float64).cpu().numpy(),
                kind=self.kind,
                scale=self.scale,
            )
            # from_projection makes unrebalanced maps; the layer's option carries over.
            self._feature_map = adopted.replace(rebalance=self.rebalance)
        if self.fitted:
            host = {
                name: None if b is None else b.detach().to(torch.float64).cpu().numpy()
                for name in FITTED_BUFFERS
                for b in [getattr(self, name)]
            }
            self._feature_map = FeatureMap.fitted(
                host["query_weight"],
                host["query_bias"],
                key_weight=host["key_weight"],
                key_bias=host["key_bias"],
                far_weight=np.maximum(np.asarray(host["far_weight"], float), 0.0),  # max(g, 0)
                tied=host["key_weight"] is None,
                scale=self.scale,
            )
        self._seen = self._buffer_versions()

    def _set_counts(self, calls: int, draws: int) -> None:
        self.forward_calls.fill_(calls)  # a fill from a host int: no device sync
        self.draws.fill_(draws)
        self._counts = (calls, draws)
        self._seen = self._buffer_versions()

    def _count_forward(self) -> None:
        if not (self.training and self.redraw_interval and torch.is_grad_enabled()):
            return
        # Activation-checkpoint recomputation runs inside a backward pass (a graph task);
        # counting it would redraw between a forward and its own recomputation.
        if torch._C._current_graph_task_id() != -1:
            return
        self._sync()
        calls, draws = self._counts
        with torch.no_grad():
            self._set_counts(calls + 1, draws)
        if (calls + 1) % self.redraw_interval == 0:
            self.redraw_projection()


@torch.compiler.disable
def _before_forward(module: FastAttention, args: Any) -> None:
    """The redraw schedule and buffer checks: host logic, never traced by torch.compile."""
    module._count_forward()
    module._sync()


def _after_load(module: FastAttention, incompatible: Any) -> None:
    """A loaded projection (or counters) replaces the map's."""
    module._sync()


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
        ``seed``, ...).

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
