"""Convert a NumPy BERT encoder's attention to fitted linear attention, weights frozen.

Every layer gets per-head fitted maps and far weights (:func:`linattn.transfer.fit_layer`)
for the hybrid ``window`` + ``sink_keys`` + each row's ``[SEP]`` exact, fitted features
on every other key.  Activations are streamed layer by layer: memory holds one layer's
hidden states of the calibration texts, never every layer's queries and keys.

Stitching the layers (``stitch``):

* ``"exact"``: layer ``l`` is fitted on the exact model's activations;
* ``"converted"``: layer ``l`` is fitted on the activations produced with the layers
  before it already converted (each fit sees the inputs it will meet).

The layer loop is :func:`linattn.conversion.convert_layers`, shared with the transformers
integration; this module is the encoder's adapter to it.

The fitted maps save to and load from one safetensors file with the model's fingerprint
and the library version (:func:`save_fitted`, :func:`load_fitted`).
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import linattn as la
from linattn.conversion import FitOptions, check_conversion, convert_layers
from linattn.models.bert import BertEncoder, exact_attention
from linattn.models.positions import POSITIONS_ENTRY, extend_positions
from linattn.transfer import (
    EXACT_HEADS_ENTRY,
    SINK_KEYS,
    LayerBatch,
    LayerFit,
    exact_heads_of,
    load_maps,
    save_maps,
)
from linattn.transfer.fingerprint import signature

__all__ = [
    "ConvertedEncoder",
    "FittedAttention",
    "convert_encoder",
    "load_fitted",
    "model_fingerprint",
    "model_signature",
    "module_names",
    "save_fitted",
]

Batch = tuple[np.ndarray, np.ndarray]  # (input_ids (B, L), key_mask (B, L))


def module_names(encoder: BertEncoder) -> list[str]:
    """The attention modules' names, as transformers' ``BertModel`` names them (the
    encoder's weights are named alike): what a fitted-maps file lists, so that the
    transformers integration finds each layer's module."""
    return [f"encoder.layer.{layer}.attention.self" for layer in range(encoder.config.num_layers)]


def model_signature(encoder: BertEncoder) -> dict[str, Any]:
    """What fitted maps are fitted to (:func:`linattn.transfer.fingerprint.signature`):
    the encoder's shape and positions, and each attention module's weights, as the
    transformers integration computes it for the same model in any dtype."""
    layers = []
    for name in module_names(encoder):
        prefix = name + "."
        layers.append(
            {k[len(prefix) :]: w for k, w in encoder.weights.items() if k.startswith(prefix)}
        )
    config = encoder.config
    facts = {
        "layers": config.num_layers, "heads": config.num_heads, "head_dim": config.head_dim,
        "positions": encoder.max_length,
    }  # fmt: skip
    return signature(facts, layers)


def model_fingerprint(encoder: BertEncoder) -> str:
    """SHA-256 (16 hex digits) of the encoder's configuration and every weight: the
    fingerprint of fitted-maps files of format 1 (before :func:`model_signature`).

    Examples
    --------
    >>> from linattn.models.bert import BertConfig, random_weights
    >>> config = BertConfig(8, 2, 1, 1e-12)
    >>> len(model_fingerprint(BertEncoder(random_weights(config, 50), config)))
    16
    """
    digest = hashlib.sha256(repr(encoder.config).encode())
    for name in sorted(encoder.weights):
        digest.update(name.encode() + np.ascontiguousarray(encoder.weights[name]).tobytes())
    return digest.hexdigest()[:16]


def length_batches(
    input_ids: np.ndarray, key_mask: np.ndarray, rows: np.ndarray, size: int
) -> list[Batch]:
    """``rows`` in batches of ``size`` by length, each cut to its longest row (little
    padding to compute on): the calibration batches :func:`convert_encoder` takes.

    Examples
    --------
    >>> ids, mask = np.ones((3, 5), dtype=int), np.arange(5) < np.array([[2], [5], [3]])
    >>> [b[0].shape for b in length_batches(ids, mask, np.arange(3), 2)]
    [(2, 3), (1, 5)]
    """
    lengths = np.asarray(key_mask).sum(axis=1)
    order = np.asarray(rows)[np.argsort(lengths[rows], kind="stable")]
    out = []
    for start in range(0, len(order), size):
        chosen = order[start : start + size]
        width = int(lengths[chosen].max())
        out.append((input_ids[chosen, :width], key_mask[chosen, :width]))
    return out


def sep_mask(key_mask: np.ndarray) -> np.ndarray:
    """``(B, L)``: each row's last real token (``[SEP]``)."""
    exact = np.zeros(key_mask.shape, dtype=bool)
    lengths = key_mask.sum(axis=1)
    rows = np.flatnonzero(lengths > 0)
    exact[rows, lengths[rows] - 1] = True
    return exact


@dataclass
class FittedAttention:
    """The attention callable of a converted encoder (``attention(q, k, v, mask, layer)``).

    ``maps[l]`` is layer ``l``'s fitted map (None: the exact parts alone);
    ``exact_heads[l]`` (when given) the heads of layer ``l`` that attend exactly, softmax
    attention over every real key, as the model's own (``convert_encoder(exact_heads=)``).
    """

    maps: list[la.FeatureMap | None]
    window: int | None
    sink_keys: int = SINK_KEYS
    exact_sep: bool = True
    exact_heads: list[tuple[int, ...]] = field(default_factory=list)
    #: The longest calibration input (tokens; None: not recorded): longer inputs warn once.
    calibrated_length: int | None = None
    _warned: bool = field(default=False, repr=False)

    def __call__(
        self, q: np.ndarray, k: np.ndarray, v: np.ndarray, key_mask: np.ndarray, layer: int
    ) -> np.ndarray:
        length = int(q.shape[-2])
        if self.calibrated_length and length > self.calibrated_length and not self._warned:
            self._warned = True
            warnings.warn(
                f"the fitted maps were calibrated on inputs of up to {self.calibrated_length} "
                f"tokens; this one has {length}: it runs, outside the calibrated range "
                "(convert with --max-length to calibrate at this length)",
                stacklevel=2,
            )
        mask = key_mask[:, None, :]
        exact = sep_mask(key_mask)[:, None, :] if self.exact_sep else None
        fm = self.maps[layer]
        out: np.ndarray = la.linear_attention(
            q,
            k,
            v,
            fm,
            key_mask=mask,
            window=self.window,
            sink_keys=self.sink_keys,
            exact_key_mask=exact,
            scale=None if fm is not None else 1.0 / np.sqrt(q.shape[-1]),
        )
        heads = self.exact_heads[layer] if layer < len(self.exact_heads) else ()
        spliced: np.ndarray = la.with_exact_heads(out, q, k, v, heads, key_mask=mask)
        return spliced


@dataclass
class ConvertedEncoder:
    """What :func:`convert_encoder` returns: the attention callable and each layer's fit."""

    attention: FittedAttention
    fits: list[LayerFit | None]
    options: dict[str, Any] = field(default_factory=dict)
    fingerprint: dict[str, Any] = field(default_factory=dict)  # (its model_signature)

    @property
    def seconds(self) -> float:
        """The fits' total wall time (activations included in the caller's clock only)."""
        return float(sum(f.seconds for f in self.fits if f is not None))


class _EncoderLayers:
    """The NumPy BERT encoder's side of :func:`linattn.conversion.convert_layers`: the
    calibration splits' hidden states streamed layer by layer (memory holds one layer's,
    never every layer's queries and keys), the fitted maps gathered in ``attention``."""

    def __init__(
        self,
        encoder: BertEncoder,
        splits: dict[str, list[Batch]],
        attention: FittedAttention,
        stitch: str,
    ) -> None:
        self.encoder, self.splits, self.attention, self.stitch = encoder, splits, attention, stitch
        self.hidden = {
            name: [encoder.embed(np.asarray(ids)) for ids, _ in batches]
            for name, batches in splits.items()
        }
        self.layer: int | None = None  # the layer whose activations are below
        self.data: dict[str, tuple[list[LayerBatch], list[Any]]] = {}

    @property
    def count(self) -> int:
        return self.encoder.config.num_layers

    def _activations(self, layer: int) -> dict[str, tuple[list[LayerBatch], list[Any]]]:
        if self.layer != layer:
            self.layer, self.data = layer, {}
            for name, batches in self.splits.items():
                out, qkv = [], []
                for h, (_, mask) in zip(self.hidden[name], batches, strict=True):
                    q, k, v = self.encoder.qkv(h, layer)
                    exact = sep_mask(mask) if self.attention.exact_sep else None
                    out.append(LayerBatch(q, k, v, np.asarray(mask, dtype=bool), exact))
                    qkv.append((q, k, v))
                self.data[name] = (out, qkv)
        return self.data

    def capture(self, layer: int, split: str) -> list[LayerBatch]:
        return self._activations(layer)[split][0]

    def fit_options(self, layer: int) -> dict[str, Any]:
        return {}

    def install(
        self, layer: int, feature_map: la.FeatureMap | None, heads: tuple[int, ...]
    ) -> None:
        self.attention.maps.append(feature_map)
        self.attention.exact_heads.append(heads)

    def advance(self, layer: int) -> None:
        data = self._activations(layer)
        for name, batches in self.splits.items():
            advanced = []
            for h, (q, k, v), (_, mask) in zip(
                self.hidden[name], data[name][1], batches, strict=True
            ):
                mask = np.asarray(mask, dtype=bool)
                if self.stitch == "exact":
                    context = exact_attention(q, k, v, mask, layer)
                else:
                    context = self.attention(q, k, v, mask, layer)
                advanced.append(
                    self.encoder.finish_layer(h, np.asarray(context, np.float32), layer)
                )
            self.hidden[name] = advanced
        self.layer, self.data = None, {}


def convert_encoder(
    encoder: BertEncoder,
    fit: Sequence[Batch],
    validation: Sequence[Batch],
    *,
    window: int | None = 16,
    sink_keys: int = SINK_KEYS,
    num_features: int = 64,
    stitch: str = "exact",
    steps: int = 300,
    learning_rate: float = 1e-2,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
    checkpoint: str | Path | None = None,
    exact_sep: bool = True,
    exact_heads: int = 0,
    query_rows: int | None = None,
) -> ConvertedEncoder:
    """Fit every layer's maps and far weights; the encoder's weights stay as they are.

    Parameters
    ----------
    encoder : BertEncoder
    fit, validation : sequence of (input_ids, key_mask)
        Tokenised calibration batches from disjoint texts (see
        :func:`linattn.transfer.fit_layer`); keep a third split for measuring.
    window, sink_keys : int
        The exact parts: the ``window`` nearest keys and the first ``sink_keys`` keys
        (default :data:`linattn.transfer.SINK_KEYS`) of every row; ``window=None,
        sink_keys=0, exact_sep=False``: fitted maps alone, no exact part.
    num_features : int, default 64
    stitch : {"exact", "converted"}
        Fit each layer on the exact model's activations, or on those of the model with
        the earlier layers converted.
    steps, learning_rate, seed, progress
        As :func:`linattn.transfer.fit_layer` (``seed + layer`` per layer).
    exact_sep : bool, default True
        Each row's ``[SEP]`` is an exact key too.
    exact_heads : int, default 0
        Heads per layer attending to every key exactly (softmax attention), beside the
        fitted hybrid of the others: the ones with the largest share of the layer's
        fitted error on ``validation`` (:meth:`linattn.transfer.LayerFit.worst_heads`);
        each costs exact attention's ``O(L^2)`` time and memory.
    checkpoint : path, optional
        A fitted-maps file written after every layer; a rerun with the same options
        resumes after the layers it holds (their ``fits`` entries are None).
    query_rows : int, optional
        Query rows the fit's loss takes of each batch longer than this (sampled, every
        key counted: :func:`linattn.transfer.fit_layer`): calibration at length in
        ``query_rows x L`` memory per head.  None: every row.

    The calibration batches' longest input and the encoder's position extension
    (:func:`linattn.models.positions.extend_positions`) are recorded in the options
    (``"max_length"``, ``"position_extension"``), so that a file says how long its
    inputs were and how the model was extended.

    Examples
    --------
    >>> from linattn.models.bert import BertConfig, random_weights
    >>> config = BertConfig(8, 2, 1, 1e-12)
    >>> enc = BertEncoder(random_weights(config, 50), config)
    >>> ids, mask = np.arange(12).reshape(2, 6) % 50, np.ones((2, 6), dtype=bool)
    >>> done = convert_encoder(enc, [(ids, mask)], [(ids, mask)], window=2, num_features=4,
    ...                        steps=5, progress=lambda line: None)
    >>> len(done.fits), enc.encode(ids, mask, done.attention).shape
    (1, (2, 8))
    """
    check_conversion(stitch, exact_heads)
    if not fit or not validation:
        raise ValueError("fit and validation must each hold at least one batch")
    for name, split in (("fit", fit), ("validation", validation)):
        for ids, mask in split:
            if np.asarray(mask).shape != np.asarray(ids).shape or not np.any(mask):
                raise ValueError(
                    f"{name} batches must be (input_ids, key_mask) of one (B, L) shape with "
                    "real tokens; got one without them or with mismatched shapes"
                )
    options: dict[str, Any] = {
        "window": window,
        "sink_keys": sink_keys,
        "exact_keys": "sep" if exact_sep else None,
        "num_features": num_features,
        "stitch": stitch,
        "steps": steps,
        "seed": seed,
        "exact_heads": exact_heads,
        "calibration": calibration_digest(fit, validation),
        "query_rows": query_rows,
        "max_length": max(int(np.asarray(ids).shape[-1]) for ids, _ in (*fit, *validation)),
        POSITIONS_ENTRY: encoder.position_extension,
    }
    options["modules"] = [{"name": name} for name in module_names(encoder)]
    fingerprint = model_signature(encoder)
    done, done_heads = _resumed(checkpoint, fingerprint, options)
    attention = FittedAttention([], window, sink_keys, exact_sep)
    layers = _EncoderLayers(
        encoder, {"fit": list(fit), "validation": list(validation)}, attention, stitch
    )

    def save_checkpoint(layer: int) -> None:
        if checkpoint is not None:
            save_maps(
                checkpoint, attention.maps, model_fingerprint=fingerprint,
                options=_with_heads(options, attention),
                complete=len(attention.maps) == encoder.config.num_layers,
            )  # fmt: skip

    fits = convert_layers(
        layers,
        FitOptions(
            num_features, window, sink_keys, steps, learning_rate, seed, exact_heads, query_rows
        ),
        progress=progress,
        resumed=list(zip(done, done_heads, strict=True)),
        resumed_from=str(checkpoint),
        after_layer=save_checkpoint,
    )
    return ConvertedEncoder(attention, fits, options, fingerprint)


Batches = Sequence[tuple[np.ndarray, np.ndarray]]


def calibration_digest(fit: Batches, validation: Batches) -> str:
    """A digest of the calibration batches (their token ids and masks, in order): a
    checkpoint resumes only a conversion on the same texts.

    Examples
    --------
    >>> ids, mask = np.arange(6).reshape(1, 6), np.ones((1, 6), bool)
    >>> calibration_digest([(ids, mask)], []) == calibration_digest([(ids, mask)], [])
    True
    >>> calibration_digest([(ids, mask)], []) == calibration_digest([(ids[:, ::-1], mask)], [])
    False
    """
    digest = hashlib.sha256()
    for name, split in (("fit", fit), ("validation", validation)):
        digest.update(name.encode())
        for ids, mask in split:
            for x in (np.asarray(ids, np.int64), np.asarray(mask, bool)):
                digest.update(repr(x.shape).encode())
                digest.update(np.ascontiguousarray(x).tobytes())
    return digest.hexdigest()[:16]


def _with_heads(options: dict[str, Any], attention: FittedAttention) -> dict[str, Any]:
    return {**options, EXACT_HEADS_ENTRY: [list(heads) for heads in attention.exact_heads]}


def _resumed(
    checkpoint: str | Path | None, fingerprint: dict[str, Any], options: dict[str, Any]
) -> tuple[list[la.FeatureMap | None], list[tuple[int, ...]]]:
    """The layers a checkpoint of this model and these options holds (none: []), and
    their exact heads."""
    if checkpoint is None or not Path(checkpoint).exists():
        return [], []
    layers, saved = load_maps(checkpoint, model_fingerprint=fingerprint, partial=True)
    asked = {name: saved.get(name) for name in options}
    if asked != options:
        differ = {
            name: {"checkpoint": asked[name], "this conversion": options[name]}
            for name in options if asked[name] != options[name]
        }  # fmt: skip
        what = "other texts" if list(differ) == ["calibration"] else "other options"
        raise ValueError(
            f"checkpoint {checkpoint} holds maps fitted on {what} ({differ}): remove it or "
            "pass another path"
        )
    return [fm for fm, _ in layers], exact_heads_of(saved, len(layers))


def save_fitted(path: str | Path, converted: ConvertedEncoder) -> Path:
    """Write the fitted maps (and exact heads) to one safetensors file
    (:func:`linattn.transfer.save_maps`)."""
    return save_maps(
        path,
        converted.attention.maps,
        model_fingerprint=converted.fingerprint,
        options=_with_heads(converted.options, converted.attention),
    )


def load_fitted(
    path: str | Path, encoder: BertEncoder
) -> tuple[list[tuple[la.FeatureMap | None, np.ndarray | None]], dict[str, Any]]:
    """The fitted maps of ``encoder`` (:func:`linattn.transfer.load_maps`, the model's
    signature checked; a file of format 1 by :func:`model_fingerprint`)."""
    return load_maps(
        path, model_fingerprint=model_signature(encoder), legacy=lambda: model_fingerprint(encoder)
    )


def attention_from_file(path: str | Path, encoder: BertEncoder) -> FittedAttention:
    """The converted encoder's attention callable, loaded with no refit.

    A file fitted on an encoder with extended positions
    (:func:`linattn.models.positions.extend_positions`, recorded in its options) extends
    ``encoder`` the same way first (in place), so that the file and the model agree; the
    callable warns when an input is longer than the file's calibration inputs.
    """
    _, options = load_maps(path, model_fingerprint=None, partial=True)
    extension = options.get(POSITIONS_ENTRY)
    if extension and encoder.position_extension != extension:
        if encoder.position_extension:
            raise ValueError(
                f"{path} was fitted on the model with positions extended as {extension}; "
                f"this encoder's are extended as {encoder.position_extension}"
            )
        extend_positions(encoder, int(extension["length"]), str(extension["method"]))
    layers, options = load_fitted(path, encoder)
    return FittedAttention(
        [fm for fm, _ in layers], options["window"], options["sink_keys"], True,
        exact_heads_of(options, len(layers)), calibrated_length=options.get("max_length"),
    )  # fmt: skip
