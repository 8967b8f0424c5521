"""A BERT encoder forward pass in NumPy float32 with the attention pluggable.

The sentence-transformers recipe of all-MiniLM-L6-v2: token, position and segment
embeddings, LayerNorm, ``num_layers`` post-LayerNorm encoder layers (GELU with the
exact ``erf``), mean pooling over real tokens and L2 normalisation.  Each layer's
attention is a callable ``attention(q, k, v, key_mask, layer) -> out`` on
``(B, H, L, d)`` arrays with ``key_mask`` of shape ``(B, L)`` (True for real tokens),
so an estimator replaces softmax attention in every layer without touching the rest.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.special import erf

__all__ = ["EXACT_BLOCK_ELEMENTS", "Attention", "BertConfig", "BertEncoder", "exact_attention"]

#: ``attention(q, k, v, key_mask, layer) -> out``: ``(B, H, L, d)`` arrays, a (B, L) mask.
Attention = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int], np.ndarray]


@dataclass(frozen=True, slots=True)
class BertConfig:
    """The few numbers of a Hugging Face ``config.json`` the forward pass needs."""

    hidden_size: int
    num_heads: int
    num_layers: int
    layer_norm_eps: float

    @classmethod
    def from_json(cls, config: Mapping[str, Any]) -> BertConfig:
        act = config.get("hidden_act", "gelu")
        if act != "gelu":
            raise ValueError(f"config.json hidden_act must be 'gelu' (exact erf); got {act!r}")
        return cls(
            hidden_size=int(config["hidden_size"]),
            num_heads=int(config["num_attention_heads"]),
            num_layers=int(config["num_hidden_layers"]),
            layer_norm_eps=float(config.get("layer_norm_eps", 1e-12)),
        )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def exact_attention(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, key_mask: np.ndarray, layer: int
) -> np.ndarray:
    """Softmax attention over the real keys, as BERT computes it (the model's own).

    Examples
    --------
    >>> q = k = v = np.eye(2, dtype=np.float32)[None, None]
    >>> exact_attention(q, k, v, np.array([[True, False]]), 0)[0, 0]
    array([[1., 0.],
           [1., 0.]], dtype=float32)
    """
    batch, heads, length = q.shape[0], q.shape[1], q.shape[2]
    per_row = max(1, batch * heads * k.shape[-2])
    block = max(1, EXACT_BLOCK_ELEMENTS // per_row)
    if length > block:  # in blocks of query rows: O(L x block) memory per head, not L x L
        parts = [exact_attention(q[..., i : i + block, :], k, v, key_mask, layer)
                 for i in range(0, length, block)]  # fmt: skip
        return np.concatenate(parts, axis=-2)
    logits = (q @ np.swapaxes(k, -1, -2)) / np.float32(math.sqrt(q.shape[-1]))
    logits = np.where(key_mask[:, None, None, :], logits, np.float32(-np.inf))
    weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
    out: np.ndarray = (weights / weights.sum(axis=-1, keepdims=True)) @ v
    return out


#: :func:`exact_attention` holds at most about this many logits at once (64 MiB of
#: float32): longer inputs run in blocks of query rows.
EXACT_BLOCK_ELEMENTS = 1 << 24


def _layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(axis=-1, keepdims=True)
    centred = x - mean
    variance = np.mean(centred * centred, axis=-1, keepdims=True)
    out: np.ndarray = centred / np.sqrt(variance + np.float32(eps)) * weight + bias
    return out


def _gelu(x: np.ndarray) -> np.ndarray:
    out: np.ndarray = (0.5 * x * (1.0 + erf(x / np.float32(math.sqrt(2.0))))).astype(np.float32)
    return out


class BertEncoder:
    """A BERT encoder over float32 weights named as in Hugging Face's ``BertModel``.

    Parameters
    ----------
    weights : mapping of str to ndarray
        ``embeddings.*`` and ``encoder.layer.N.*`` tensors (a ``model.safetensors``).
    config : BertConfig

    Examples
    --------
    >>> config = BertConfig(8, 2, 1, 1e-12)
    >>> enc = BertEncoder(random_weights(config, 50), config)
    >>> ids, mask = np.array([[1, 2, 3]]), np.array([[True, True, False]])
    >>> float(np.linalg.norm(enc.encode(ids, mask)))  # doctest: +ELLIPSIS
    1.0...
    """

    def __init__(self, weights: Mapping[str, np.ndarray], config: BertConfig) -> None:
        self.config = config
        missing = [name for name in _names(config) if name not in weights]
        if missing:
            raise ValueError(
                f"weights must hold every BERT tensor of a {config.num_layers}-layer model; "
                f"missing {missing[:3]}{' ...' if len(missing) > 3 else ''}"
            )
        self.weights = {
            name: np.asarray(weights[name], dtype=np.float32) for name in _names(config)
        }
        #: What :func:`linattn.models.positions.extend_positions` did (None: nothing).
        self.position_extension: dict[str, Any] | None = None

    @property
    def max_length(self) -> int:
        """The longest input: the position table's rows."""
        return int(self.weights["embeddings.position_embeddings.weight"].shape[0])

    def _w(self, name: str) -> np.ndarray:
        return self.weights[name]

    def embed(self, input_ids: np.ndarray) -> np.ndarray:
        """Token + position + segment-0 embeddings, LayerNormed: ``(B, L, hidden)``."""
        length = input_ids.shape[1]
        if length > self.max_length:
            raise ValueError(
                f"input_ids has {length} tokens; the model has {self.max_length} positions "
                "(linattn.models.positions.extend_positions gives it more)"
            )
        x = (
            self._w("embeddings.word_embeddings.weight")[input_ids]
            + self._w("embeddings.position_embeddings.weight")[:length]
            + self._w("embeddings.token_type_embeddings.weight")[0]
        )
        return _layer_norm(
            x,
            self._w("embeddings.LayerNorm.weight"),
            self._w("embeddings.LayerNorm.bias"),
            self.config.layer_norm_eps,
        )

    def qkv(self, hidden: np.ndarray, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Layer ``layer``'s queries, keys and values of ``hidden``: ``(B, H, L, d)`` each."""
        batch, length, _ = hidden.shape
        prefix = f"encoder.layer.{layer}.attention.self."

        def project(name: str) -> np.ndarray:
            out = hidden @ self._w(prefix + name + ".weight").T + self._w(prefix + name + ".bias")
            out = out.reshape(batch, length, self.config.num_heads, self.config.head_dim)
            return np.ascontiguousarray(out.transpose(0, 2, 1, 3))

        return project("query"), project("key"), project("value")

    def finish_layer(self, hidden: np.ndarray, context: np.ndarray, layer: int) -> np.ndarray:
        """The rest of layer ``layer`` after attention: output projection, FFN, LayerNorms."""
        batch, _, length, _ = context.shape
        prefix = f"encoder.layer.{layer}."
        eps = self.config.layer_norm_eps
        merged = context.transpose(0, 2, 1, 3).reshape(batch, length, self.config.hidden_size)
        attended = merged @ self._w(prefix + "attention.output.dense.weight").T
        attended = _layer_norm(
            attended + self._w(prefix + "attention.output.dense.bias") + hidden,
            self._w(prefix + "attention.output.LayerNorm.weight"),
            self._w(prefix + "attention.output.LayerNorm.bias"),
            eps,
        )
        inner = _gelu(
            attended @ self._w(prefix + "intermediate.dense.weight").T
            + self._w(prefix + "intermediate.dense.bias")
        )
        out = inner @ self._w(prefix + "output.dense.weight").T + self._w(
            prefix + "output.dense.bias"
        )
        return _layer_norm(
            out + attended,
            self._w(prefix + "output.LayerNorm.weight"),
            self._w(prefix + "output.LayerNorm.bias"),
            eps,
        )

    def hidden_states(
        self, input_ids: np.ndarray, key_mask: np.ndarray, attention: Attention = exact_attention
    ) -> np.ndarray:
        """The last layer's token states ``(B, L, hidden)`` with ``attention`` in every layer."""
        key_mask = np.asarray(key_mask, dtype=bool)
        hidden = self.embed(np.asarray(input_ids))
        for layer in range(self.config.num_layers):
            q, k, v = self.qkv(hidden, layer)
            context = np.asarray(attention(q, k, v, key_mask, layer), dtype=np.float32)
            hidden = self.finish_layer(hidden, context, layer)
        return hidden

    def encode(
        self, input_ids: np.ndarray, key_mask: np.ndarray, attention: Attention = exact_attention
    ) -> np.ndarray:
        """Sentence embeddings ``(B, hidden)``: mean over real tokens, unit L2 norm."""
        key_mask = np.asarray(key_mask, dtype=bool)
        hidden = self.hidden_states(input_ids, key_mask, attention)
        weights = key_mask[..., None].astype(np.float32)
        pooled = (hidden * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1e-9)
        norm = np.linalg.norm(pooled, axis=-1, keepdims=True)
        embeddings: np.ndarray = pooled / np.maximum(norm, 1e-12)
        return embeddings


def _names(config: BertConfig) -> list[str]:
    names = [
        "embeddings.word_embeddings.weight",
        "embeddings.position_embeddings.weight",
        "embeddings.token_type_embeddings.weight",
        "embeddings.LayerNorm.weight",
        "embeddings.LayerNorm.bias",
    ]
    per_layer = [
        "attention.self.query",
        "attention.self.key",
        "attention.self.value",
        "attention.output.dense",
        "attention.output.LayerNorm",
        "intermediate.dense",
        "output.dense",
        "output.LayerNorm",
    ]
    for layer in range(config.num_layers):
        for part in per_layer:
            names += [f"encoder.layer.{layer}.{part}.weight", f"encoder.layer.{layer}.{part}.bias"]
    return names


def random_weights(config: BertConfig, vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Small random weights of the right shapes (tests and examples; no model needed)."""
    rng = np.random.default_rng(seed)
    hidden, inner = config.hidden_size, 4 * config.hidden_size
    shapes = {
        "embeddings.word_embeddings.weight": (vocab, hidden),
        "embeddings.position_embeddings.weight": (512, hidden),
        "embeddings.token_type_embeddings.weight": (2, hidden),
    }
    out: dict[str, np.ndarray] = {}
    for name in _names(config):
        if name in shapes:
            shape: tuple[int, ...] = shapes[name]
        elif "LayerNorm" in name:
            shape = (hidden,)
        elif name.endswith(".bias"):
            shape = (inner,) if "intermediate" in name else (hidden,)
        elif "intermediate" in name:
            shape = (inner, hidden)
        elif name.startswith("encoder") and ".output.dense" in name and "attention" not in name:
            shape = (hidden, inner)
        else:
            shape = (hidden, hidden)
        scale = 1.0 if "LayerNorm.weight" in name else 0.1
        out[name] = (scale * rng.standard_normal(shape)).astype(np.float32)
        if "LayerNorm.weight" in name:
            out[name] = np.ones(shape, dtype=np.float32)
    return out
