"""The attention op of :mod:`linattn.torch`: :class:`FastAttention` on ``(B, H, L, d)``
tensors, its feature map's buffers (or parameters) and its redraw schedule.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from linattn._call import hybrid_options
from linattn._dispatch import Backend
from linattn._layer_maps import check_exact_heads, exact_heads_decoding_error, fitted_template
from linattn.attention import linear_attention, with_exact_heads
from linattn.features import FeatureMap, Kind, kind_spec
from linattn.projections import Norms, gaussian_projection
from linattn.state import LinearAttentionState
from linattn.torch.fitted import FITTED_BUFFERS, fitted_attention

#: The hybrid's options (:mod:`linattn.hybrid`), passed to :func:`linattn.linear_attention`.
HYBRID_OPTIONS = ("window", "sink_keys")


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
