"""Convert a transformers model's attention to fitted linear attention, weights frozen.

:func:`convert` fits every attention layer of a loaded model
(:func:`linattn.transfer.fit_layer`: per-head Hedgehog maps and far weights) for the
hybrid "exact window + sinks (+ exact keys) near, fitted features far", and leaves the
model running ``attn_implementation="linattn"`` with the fitted maps.  No weight
changes: the passes run under ``torch.no_grad`` and only the attention modules gain a
map (their record's ``fitted``, :mod:`linattn.integrations.transformers.state`, which the
integration uses first).  The layer loop is the one every model family shares,
:func:`linattn.conversion.convert_layers`; :class:`ModelLayers` is this family's side of
it, each layer's activations captured from the model's own forward pass
(:mod:`linattn.integrations.transformers.capture`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from linattn.conversion import FitOptions, check_conversion, convert_layers
from linattn.features import FeatureMap
from linattn.integrations.transformers.capture import Capture, check_batches, run
from linattn.integrations.transformers.options import Model, use_linattn
from linattn.integrations.transformers.state import (
    EMPTY,
    LinattnState,
    clear,
    state_of,
    update,
)
from linattn.transfer import SINK_KEYS, LayerBatch

__all__ = ["ModelLayers", "SavedState", "convert", "layer_errors", "restore_state", "save_state"]


class ModelLayers:
    """A transformers model's side of :func:`linattn.conversion.convert_layers`: each
    layer's activations captured from the model's own forward pass (stopped at the layer;
    the layers before it exact or converted as ``capture.stitch`` says), each fitted map
    kept in its attention module's record (``update(module, fitted=...)``)."""

    def __init__(self, model: Model, capture: Capture, inputs: dict[str, list[dict[str, Any]]]):
        self.model, self.catcher, self.inputs = model, capture, inputs

    @property
    def count(self) -> int:
        return len(self.catcher.order)

    def capture(self, layer: int, split: str) -> list[LayerBatch]:
        self.catcher.target = layer
        out: list[LayerBatch] = []
        for batch in self.inputs[split]:
            captured = run(self.model, batch, self.catcher)
            assert captured is not None
            out.append(on_host(captured))
        return out

    def fit_options(self, layer: int) -> dict[str, Any]:
        return {"causal": self.catcher.causal, "scale": self.catcher.scaling}

    def install(self, layer: int, feature_map: FeatureMap | None, heads: tuple[int, ...]) -> None:
        module = self.catcher.order[layer]
        update(module, fitted=feature_map, **({"exact_heads": heads} if heads else {}))

    def advance(self, layer: int) -> None:
        pass  # (every capture runs the model from its inputs)


def on_host(batch: LayerBatch) -> LayerBatch:
    """A batch of CPU tensors as NumPy arrays (the same memory where it is contiguous):
    the fit then runs as ``linattn convert``'s does, its pieces on threads and BLAS on
    one (on torch tensors it ran single-threaded through the array API, 2.5-7x slower).
    Tensors on an accelerator stay where they are."""
    if not all(x is None or x.device.type == "cpu" for x in batch):
        return batch
    return LayerBatch(*(None if x is None else np.ascontiguousarray(x.numpy()) for x in batch))


@dataclass
class SavedState:
    """What :func:`convert` (or ``refine``) changes on the model, to put back if it fails:
    the attention implementation, ``config.linattn``, the mode, and each module's record
    (:class:`linattn.integrations.transformers.state.LinattnState`, immutable: kept as
    it is)."""

    implementation: Any
    linattn: Any
    training: bool
    records: list[tuple[torch.nn.Module, LinattnState]]


def save_state(model: Model) -> SavedState:
    """What :func:`restore_state` puts back on ``model``."""
    records = [(m, state_of(m)) for m in model.modules()]
    return SavedState(
        model.config._attn_implementation,
        getattr(model.config, "linattn", None),
        model.training,
        [(m, record) for m, record in records if record is not EMPTY],
    )


def restore_state(model: Model, saved: SavedState) -> None:
    """``model`` as :func:`save_state` found it (modules without a record then lose theirs)."""
    kept = {id(m): record for m, record in saved.records}
    for module in model.modules():
        clear(module, kept.get(id(module), EMPTY))
    model.config.linattn = saved.linattn
    if saved.implementation is not None:
        model.set_attn_implementation(saved.implementation)
    model.train(saved.training)


# -- the conversion -----------------------------------------------------------------------


def convert(
    model: Model,
    batches: Iterable[Mapping[str, Any]],
    validation: Iterable[Mapping[str, Any]],
    *,
    window: int | None = 16,
    sink_keys: int = SINK_KEYS,
    num_features: int = 64,
    exact_keys: str | Callable[[torch.Tensor], torch.Tensor] | None = None,
    exact_heads: int = 0,
    stitch: str = "exact",
    steps: int = 300,
    learning_rate: float = 1e-2,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> Model:
    """Fit every attention layer of ``model``; return it running the fitted hybrid.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A loaded model whose attention goes through transformers' attention interface
        (BERT-like encoders, GPT-2-like and Llama-like decoders, grouped-query attention
        included).  Its weights are not changed; it is put in eval mode for the passes
        and returned in the mode it came in.
    batches, validation : iterable of dict
        Tokenizer output (``input_ids``, ``attention_mask`` and whatever else the model
        takes, e.g. ``token_type_ids``) from disjoint texts: ``batches`` for the gradient
        steps, ``validation`` for early stopping and each head's choice of ``g = 0``.
        Keep a third split for measuring (:func:`layer_errors`).
    window, sink_keys : int
        The exact parts (:func:`linattn.linear_attention`'s), as the model will run: the
        ``window`` nearest keys and the first ``sink_keys`` keys of every row (default
        :data:`linattn.transfer.SINK_KEYS`, StreamingLLM's four).
    num_features : int, default 64
        Features per head (even).
    exact_keys : None, "special" or callable
        Keys attended exactly, encoders only (as ``register``'s option): ``"special"``
        makes each row's first and last real token (``[CLS]``, ``[SEP]``) exact.
    exact_heads : int, default 0
        Query heads per layer that attend to every key exactly (softmax attention, beside
        the fitted hybrid of the other heads): the ones with the largest share of the
        layer's fitted error on ``validation``
        (:meth:`linattn.transfer.LayerFit.error_shares`), typically heads that look one
        key up, which no small feature map follows (``docs/estimators.md``, "Exact
        heads").  Each costs exact attention's ``O(L^2)`` time and memory; decoding,
        :class:`linattn.integrations.transformers.LinearAttentionCache` keeps the keys
        and values of the key heads they read (a KV cache of those heads, growing with
        the length).
    stitch : {"exact", "converted"}
        Fit layer ``l`` on the exact model's activations, or on those of the model whose
        layers before ``l`` are already converted.
    steps, learning_rate, seed, progress
        As :func:`linattn.transfer.fit_layer` (layer ``l`` uses ``seed + l``; ``progress``
        lines start with ``"layer l: "``).

    Returns
    -------
    model
        The same model: ``attn_implementation="linattn"``, each attention module holding
        its fitted map, ``config.linattn`` the options above.  Save the maps with
        :func:`~linattn.integrations.transformers.save_fitted`.

    Raises
    ------
    ValueError
        A batch without ``input_ids``/``attention_mask`` or without real tokens, an
        unknown ``stitch``, ``exact_keys`` in a causal model, ``exact_heads`` below 0 or
        above a layer's heads, options the integration refuses (named as
        ``config.linattn``'s).  The model is left as it was.
    """
    check_conversion(stitch, exact_heads)
    fit_inputs = check_batches(batches, "batches")
    val_inputs = check_batches(validation, "validation")
    options = {
        "num_features": num_features, "window": window, "sink_keys": sink_keys,
        "exact_keys": exact_keys,
    }  # fmt: skip
    saved = save_state(model)
    try:
        for module, _ in saved.records:  # a new conversion starts from the exact model
            update(module, fitted=None, exact_heads=())
        model.config.linattn = dict(options)
        model.eval()
        use_linattn(model)
        capture = Capture(stitch)
        with torch.no_grad():
            run(model, fit_inputs[0], capture)  # the layer order
            if not capture.order:
                raise ValueError(
                    f"{type(model).__name__} made no attention call through transformers' "
                    "attention interface: convert cannot reach its attention"
                )
            layers = ModelLayers(model, capture, {"fit": fit_inputs, "validation": val_inputs})
            fit_options = FitOptions(
                num_features, window, sink_keys, steps, learning_rate, seed, exact_heads
            )
            fits = convert_layers(layers, fit_options, progress=progress)
    except BaseException:
        restore_state(model, saved)
        raise
    model.train(saved.training)
    model.__dict__["_linattn_conversion"] = {
        "stitch": stitch, "steps": steps, "learning_rate": learning_rate, "seed": seed,
        "validation_error": [f.validation_error.tolist() for f in fits if f is not None],
        "exact_parts_error": [f.exact_parts_error.tolist() for f in fits if f is not None],
        "error_shares": [f.error_shares().tolist() for f in fits if f is not None],
        "exact_heads": [list(state_of(m).exact_heads) for m in capture.order],
    }  # fmt: skip
    return model


def layer_errors(
    model: Model, batches: Iterable[Mapping[str, Any]], *, activations: str = "exact"
) -> list[dict[str, np.ndarray]]:
    """Each layer's attention error on ``batches`` (held-out texts), fitted and not.

    Each layer's output is compared with exact softmax attention of the same queries,
    keys and values over the real query rows.

    Parameters
    ----------
    model : transformers model
        Converted (:func:`convert`, :func:`~linattn.integrations.transformers.load_fitted`, perhaps
        refined).
    batches : iterable of dict
        Tokenizer outputs: ``input_ids`` and ``attention_mask``.
    activations : {"exact", "converted"}
        Where each layer's queries, keys and values come from: the exact model (every
        layer before it exact, as stitching (a) fits them) or the converted model itself
        (every layer before it converted: the activations the converted model runs on).

    Returns
    -------
    list of dict
        Per attention layer: ``"fitted"`` (the converted hybrid; 0 for exact heads) and
        ``"exact_parts"``
        (window, sinks and exact keys alone: ``g = 0``), relative errors
        ``||out - exact|| / ||exact||`` per query head, ``(H,)``, and
        ``"exact_squared_norm"``, ``||exact||**2`` per head (the weights that combine
        the heads' errors into the layer's: ``sqrt(sum(e**2 * n) / sum(n))``).
    """
    from linattn.transfer import attention_errors

    if activations not in ("exact", "converted"):
        raise ValueError(f"activations must be 'exact' or 'converted'; got {activations!r}")
    inputs = check_batches(batches, "batches")
    settings = dict(getattr(model.config, "linattn", None) or {})
    saved = save_state(model)
    capture = Capture(activations)
    results = []
    try:
        model.eval()
        use_linattn(model)
        with torch.no_grad():
            run(model, inputs[0], capture)
            for layer, module in enumerate(capture.order):
                data = ModelLayers(model, capture, {"batches": inputs}).capture(layer, "batches")
                fm = state_of(module).fitted
                if fm is None:
                    raise ValueError(f"attention layer {layer} has no fitted map: convert first")
                parts = {
                    "window": settings.get("window"), "sink_keys": settings.get("sink_keys", 0),
                    "causal": capture.causal, "scale": fm.scale,
                }  # fmt: skip
                err, norm = attention_errors(fm, data, **parts)
                base, _ = attention_errors(None, data, **parts)
                fitted = np.sqrt(err / norm)
                fitted.reshape(-1)[list(state_of(module).exact_heads)] = 0.0  # exact
                results.append(
                    {
                        "fitted": fitted,
                        "exact_parts": np.sqrt(base / norm),
                        "exact_squared_norm": norm,
                    }
                )
    finally:
        model.train(saved.training)
    return results
