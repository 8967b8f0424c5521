"""``LinearAttentionCache``: transformers' decoding cache, one linear-attention state
per layer (and, for a layer with exact heads, the keys and values those heads read).
"""

from __future__ import annotations

import math
import threading
from typing import Any, NamedTuple

import torch
from transformers.cache_utils import Cache, DynamicLayer

from linattn.state import LinearAttentionState

__all__ = ["KeptKeys", "LinearAttentionCache", "StateLayer", "take_layer"]

#: The cache layer the current thread's attention call belongs to (set by its update).
_active = threading.local()


def take_layer() -> StateLayer | None:
    """The cache layer the current thread's attention call continues (None without a
    :class:`LinearAttentionCache`), forgotten once taken."""
    layer: StateLayer | None = getattr(_active, "layer", None)
    _active.layer = None
    return layer


class KeptKeys(NamedTuple):
    """The keys and values so far of the key heads that a layer's exact heads read."""

    key_heads: tuple[int, ...]  # key heads kept, ascending
    keys: torch.Tensor  # (B, len(key_heads), L, d)
    values: torch.Tensor  # (B, len(key_heads), L, d_v)
    key_mask: torch.Tensor  # (B, L) True = a real key


class StateLayer(DynamicLayer):
    """One layer of :class:`LinearAttentionCache`: a state, the count of tokens, and for
    a layer with exact heads the keys and values those heads read."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.state: LinearAttentionState | None = None
        self.seen = 0
        self.exact: KeptKeys | None = None

    def exact_heads(
        self,
        out: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_mask: torch.Tensor | None,
        scaling: float | None,
        heads: tuple[int, ...],
    ) -> torch.Tensor:
        """``out`` ``(B, H, L_q, d_v)`` with ``heads`` attending exactly, causally, to
        every real key so far: the new ``key``/``value`` (``(B, H_kv, L_q, .)``) join
        the kept ones of the key heads they read (query head ``h`` reads key head ``h //
        (H / H_kv)``), a KV cache of those heads only; a row without keys gets zeros."""
        group = query.shape[-3] // key.shape[-3]
        key_heads = tuple(sorted({h // group for h in heads}))
        batch, length = key.shape[0], key.shape[-2]
        mask = (
            torch.ones(batch, length, dtype=torch.bool, device=key.device)
            if key_mask is None
            else key_mask.expand(batch, 1, length)[:, 0]
        )
        new = KeptKeys(key_heads, key[:, key_heads], value[:, key_heads], mask)
        if self.exact is not None:
            if self.exact.key_heads != key_heads:
                raise ValueError(
                    f"this cache layer kept key heads {self.exact.key_heads} for exact heads; "
                    f"got a call whose exact heads read {key_heads} (one cache per model)"
                )
            new = KeptKeys(
                key_heads,
                torch.cat([self.exact.keys, new.keys], dim=-2),
                torch.cat([self.exact.values, new.values], dim=-2),
                torch.cat([self.exact.key_mask, mask], dim=-1),
            )
        self.exact = new
        dtype = torch.promote_types(query.dtype, torch.float32)
        rows = [key_heads.index(h // group) for h in heads]
        q = query[:, list(heads)].to(dtype)
        k, v = new.keys[:, rows].to(dtype), new.values[:, rows].to(dtype)
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        total, count = k.shape[-2], q.shape[-2]
        below = torch.ones(count, total, dtype=torch.bool, device=q.device).tril(total - count)
        allowed = new.key_mask[:, None, None, :] & below  # (B, 1, L_q, L_k)
        logits = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, -math.inf)
        weights = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # rows without keys: 0
        spliced = out.clone()
        spliced[:, list(heads)] = (weights @ v).to(out.dtype)
        return spliced

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.seen += int(key_states.shape[-2])
        _active.layer = self  # the attention call that follows continues this state
        return key_states, value_states  # only the new tokens

    def get_seq_length(self) -> int:
        return self.seen

    def reset(self) -> None:
        self.state, self.seen, self.exact = None, 0, None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("LinearAttentionCache does not support beam search")


class LinearAttentionCache(Cache):
    """A transformers cache of one :class:`linattn.LinearAttentionState` per layer.

    Memory is ``num_features x (d + 1)`` per head and layer, whatever the length; each
    step's attention sees only the new tokens and continues the state.  A layer with
    exact heads (``convert(..., exact_heads=)``) also keeps the keys and values of the
    key heads those read, which grow with the length: they attend to every real key so
    far, as without the cache.

    Examples
    --------
    >>> from linattn.integrations.transformers import LinearAttentionCache
    >>> cache = LinearAttentionCache()
    >>> cache.get_seq_length()
    0
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(layer_class_to_replicate=StateLayer)
