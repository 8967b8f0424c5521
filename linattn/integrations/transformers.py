"""Hugging Face transformers: ``attn_implementation="linattn"`` and a decoding cache.

:func:`register` adds :func:`attention_forward` to transformers' ``AttentionInterface``.
It borrows SDPA's mask function, so the attention receives a boolean 4-D mask (or None
for a plain causal one), accepted when it is padding, optionally causal, only.
:class:`LinearAttentionCache` holds one
:class:`linattn.LinearAttentionState` per layer and passes only the new tokens on.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicLayer
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from linattn._call import hybrid_options
from linattn._gqa import grouped
from linattn.attention import linear_attention
from linattn.features import SOFTMAX_KINDS, FeatureMap
from linattn.state import LinearAttentionState

__all__ = ["NAME", "LinearAttentionCache", "attention_forward", "register"]

NAME = "linattn"
#: Defaults set by :func:`register`; a model's ``config.linattn`` (a dict) overrides them.
_options: dict[str, Any] = {"num_features": 256, "kind": None, "seed": 0}
#: The cache layer the current thread's attention call belongs to (set by its update).
_active = threading.local()


def register(**options: Any) -> None:
    """Make ``attn_implementation="linattn"`` available to every transformers model.

    Parameters
    ----------
    **options
        ``num_features`` (256), ``kind`` (``"hyperbolic"`` for decoders,
        ``"hyperbolic_oprf"`` with per-call statistics for encoders), ``seed`` (0),
        ``window`` and ``sink_keys`` (the window/sink hybrid).  A model's
        ``config.linattn = {...}`` overrides them per model.

    Examples
    --------
    >>> from linattn.integrations.transformers import register
    >>> register(num_features=128)
    >>> from transformers import AttentionInterface
    >>> "linattn" in AttentionInterface._global_mapping
    True
    """
    unknown = set(options) - {"num_features", "kind", "seed", "window", "sink_keys"}
    if unknown:
        raise TypeError(
            f"register takes num_features, kind, seed, window, sink_keys; got {sorted(unknown)}"
        )
    hybrid_options(window=options.get("window"), sink_keys=options.get("sink_keys", 0))
    _options.update(options)
    AttentionInterface.register(NAME, attention_forward)
    # Without a mask function of its own an implementation gets no mask at all; SDPA's
    # boolean 4-D masks (None where causality alone says it all) are converted below.
    AttentionMaskInterface.register(NAME, sdpa_mask)


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: ``(B, H, L, d)`` in, ``(B, L, H, d)`` out."""
    if dropout > 0:
        raise ValueError(
            f"attention dropout must be 0 with attn_implementation='linattn' (no attention "
            f"weights exist to drop); got dropout={dropout} (set the config's attention "
            "dropout to 0, or call model.eval())"
        )
    if kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None:
        raise ValueError("linattn cannot apply position biases or softcapping; got one")
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", False))
    layer = getattr(_active, "layer", None)
    _active.layer = None
    if layer is None and causal and key.shape[-2] > query.shape[-2]:
        raise ValueError(
            "past_key_values must be a linattn.integrations.transformers.LinearAttentionCache "
            "with attn_implementation='linattn'; got another transformers cache (keys "
            f"{key.shape[-2]} long for {query.shape[-2]} queries: e.g. generate's default "
            "DynamicCache)"
        )
    if layer is not None and attention_mask is not None:
        # The mask covers the cached keys too; the state already holds them, masked.
        attention_mask = attention_mask[..., -key.shape[-2] :]
    key_mask, mask_causal = key_mask_from(attention_mask, query.shape[-2], key.shape[-2])
    causal = causal or mask_causal
    feature_map = _feature_map(module, query.shape[-1], scaling, causal)
    q, k, v, key_mask, ungroup = grouped(query, key, value, key_mask)
    options = {
        name: _settings(module)[name]
        for name in ("window", "sink_keys")
        if name in _settings(module)
    }
    with torch.autocast(query.device.type, enabled=False):
        if layer is not None:
            out, layer.state = linear_attention(
                q,
                k,
                v,
                feature_map,
                causal=True,
                key_mask=key_mask,
                state=layer.state,
                return_state=True,
                **hybrid_options(**options),
            )
        else:
            out = linear_attention(
                q,
                k,
                v,
                feature_map,
                causal=causal,
                key_mask=key_mask,
                **hybrid_options(**options),
            )
    return ungroup(out).transpose(1, 2).contiguous(), None


def key_mask_from(
    attention_mask: torch.Tensor | None, query_length: int, key_length: int
) -> tuple[torch.Tensor | None, bool]:
    """``(key_mask (B, 1, L_k) True = keep, causal)`` from the mask transformers passes.

    2-D ``(B, L)`` masks are padding masks (1 keep, 0 padding; with a cache, the last
    ``L_k`` columns are the new keys').  4-D ``(B, 1, L_q, L_k)`` masks, boolean (True
    keep) or additive (0 keep, ``-inf`` or the dtype's minimum masked), must be padding
    and optionally causal; anything else (ALiBi or T5 biases, other patterns) raises.
    """
    if attention_mask is None:
        return None, False
    if attention_mask.ndim == 2:
        return attention_mask[:, None, -key_length:].to(torch.bool), False
    if attention_mask.ndim != 4:
        raise ValueError(
            f"attention_mask must be 2-D (B, L) or 4-D (B, 1, L_q, L_k); got shape "
            f"{tuple(attention_mask.shape)}"
        )
    if attention_mask.dtype == torch.bool:
        keep = attention_mask
    else:
        lowest = torch.finfo(attention_mask.dtype).min
        masked = (attention_mask == lowest) | torch.isneginf(attention_mask)
        if bool(((attention_mask != 0) & ~masked).any()):
            raise ValueError(
                "attention_mask must hold only 0 and -inf (or the dtype's minimum): linattn "
                "cannot add attention biases (ALiBi, T5 relative positions); got other values"
            )
        keep = ~masked
    if keep.shape[1] != 1 or keep.shape[-2:] != (query_length, key_length):
        raise ValueError(
            f"attention_mask must have shape (B, 1, {query_length}, {key_length}); got "
            f"{tuple(keep.shape)}"
        )
    padding = keep.any(dim=-2)  # (B, 1, L_k): keys some query sees
    below = torch.ones(query_length, key_length, dtype=torch.bool, device=keep.device)
    below = below.tril(key_length - query_length)
    for causal in (False, True):
        pattern = padding[:, :, None, :] & (below if causal else True)
        # Queries that see nothing (padding rows) may hold anything.
        rows = keep.any(dim=-1, keepdim=True)
        if torch.equal(keep & rows, pattern & rows):
            return padding, causal
    raise ValueError(
        "attention_mask must be a padding mask, optionally causal: linattn cannot apply "
        "other 4-D masks (sliding windows, block patterns, packed sequences); got one"
    )


class _StateLayer(DynamicLayer):
    """One layer of :class:`LinearAttentionCache`: a state, and the count of tokens."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.state: LinearAttentionState | None = None
        self.seen = 0

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
        self.state, self.seen = None, 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("LinearAttentionCache does not support beam search")


class LinearAttentionCache(Cache):
    """A transformers cache of one :class:`linattn.LinearAttentionState` per layer.

    Memory is ``num_features x (d + 1)`` per head and layer, whatever the length; each
    step's attention sees only the new tokens and continues the state.

    Examples
    --------
    >>> from linattn.integrations.transformers import LinearAttentionCache
    >>> cache = LinearAttentionCache()
    >>> cache.get_seq_length()
    0
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(layer_class_to_replicate=_StateLayer)


def _settings(module: torch.nn.Module) -> dict[str, Any]:
    config = getattr(module, "config", None)
    return {**_options, **dict(getattr(config, "linattn", None) or {})}


def _feature_map(
    module: torch.nn.Module, head_dim: int, scaling: float | None, causal: bool
) -> FeatureMap:
    """One map per layer, kept on the module (the same projection every call)."""
    key = (head_dim, scaling, causal, tuple(sorted(_settings(module).items())))
    cached = module.__dict__.get("_linattn_feature_map")
    if cached is not None and cached[0] == key:
        return cached[1]
    settings = _settings(module)
    kind = settings["kind"] or ("hyperbolic" if causal else "hyperbolic_oprf")
    feature_map = FeatureMap(
        head_dim,
        settings["num_features"],
        kind=kind,  # type: ignore[arg-type]
        scale=scaling,
        seed=settings["seed"] + _layer_index(module),  # each layer its own draw
        rebalance=not causal and kind in SOFTMAX_KINDS,  # per-call statistics: encoders only
    )
    module.__dict__["_linattn_feature_map"] = (key, feature_map)
    return feature_map


def _layer_index(module: torch.nn.Module) -> int:
    index = getattr(module, "layer_idx", None)
    return index if isinstance(index, int) else 0
