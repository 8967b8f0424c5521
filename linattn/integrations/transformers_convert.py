"""Convert a transformers model's attention to fitted linear attention, weights frozen.

:func:`convert` fits every attention layer of a loaded model
(:func:`linattn.transfer.fit_layer`: per-head Hedgehog maps and far weights) for the
hybrid "exact window + sinks (+ exact keys) near, fitted features far", and leaves the
model running ``attn_implementation="linattn"`` with the fitted maps.  No weight
changes: the passes run under ``torch.no_grad`` and only the attention modules gain a
map (``module.__dict__["_linattn_fitted"]``, which the integration uses first).

Activations are captured through the attention call itself: what the layer's attention
function receives (queries and keys after rotary embeddings, key/value heads of
grouped-query attention not repeated, the key mask transformers built), layer by layer,
so memory holds one layer's calibration set.  Each layer's pass stops the forward once
its attention is reached.

The functions are re-exported by :mod:`linattn.integrations.transformers` (use them
from there: importing it makes ``attn_implementation="linattn"`` available).  This
module sits below it and imports nothing of it; the integration's attention calls
:func:`capture_hook` and :func:`map_from_file`.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from linattn.attention import with_exact_heads
from linattn.conversion import FitOptions, check_conversion, convert_layers
from linattn.features import FeatureMap
from linattn.transfer import (
    EXACT_HEADS_ENTRY,
    SINK_KEYS,
    LayerBatch,
    exact_heads_of,
    load_maps,
    save_maps,
)

__all__ = [
    "AttentionCall",
    "capture_hook",
    "convert",
    "layer_errors",
    "load_fitted",
    "map_from_file",
    "model_fingerprint",
    "save_fitted",
]

#: ``linattn.integrations.transformers.NAME`` (this module sits below that one).
_NAME = "linattn"
#: Where a module keeps its fitted map.
FITTED = "_linattn_fitted"
#: Where an attention module keeps its exact heads (query heads attending to every key
#: exactly, beside the fitted hybrid of the others; chosen by ``convert(exact_heads=)``).
EXACT_HEADS = "_linattn_exact_heads"
#: The options of ``config.linattn`` a conversion sets.
_OPTIONS = ("num_features", "window", "sink_keys", "exact_keys")
#: Configuration entries that say nothing about the model's computation (names, versions,
#: run-time switches, what a save or this integration adds): left out of the fingerprint.
_NOT_THE_MODEL = {
    "_name_or_path", "_commit_hash", "architectures", "transformers_version", "linattn",
    "attn_implementation", "_attn_implementation_autoset", "dtype", "torch_dtype",
    "output_attentions", "output_hidden_states", "return_dict", "use_cache",
}  # fmt: skip


class AttentionCall(NamedTuple):
    """One attention call as the integration has read it (for :func:`capture_hook`).

    ``key_mask`` and ``exact_key_mask`` are ``(B, 1, L_k)`` booleans or None; ``causal``
    is the call's causality, mask included; ``scaling`` and ``is_causal`` and ``kwargs``
    are transformers' arguments as given.
    """

    module: torch.nn.Module
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attention_mask: torch.Tensor | None
    scaling: float | None
    is_causal: bool | None
    kwargs: dict[str, Any]
    key_mask: torch.Tensor | None
    exact_key_mask: torch.Tensor | None
    causal: bool


Hook = Callable[[AttentionCall], "torch.Tensor | None"]
#: A transformers ``PreTrainedModel`` (its ``config`` and methods are untyped here).
Model = Any
_capture = threading.local()


def capture_hook() -> Hook | None:
    """The current thread's capture (inside :func:`convert` or :func:`layer_errors`).

    The integration's attention calls it with each :class:`AttentionCall`: it returns
    the output ``(B, L, H, d_v)`` to use, or None for the integration's own attention,
    or raises to end the forward pass once the layer it wants is captured.
    """
    hook: Hook | None = getattr(_capture, "hook", None)
    return hook


@contextlib.contextmanager
def hooked(hook: Hook) -> Iterator[None]:
    """Every attention call of the current thread goes to ``hook`` inside the block."""
    _capture.hook = hook
    try:
        yield
    finally:
        _capture.hook = None


class _Captured(Exception):
    """Ends a forward pass at the layer being captured."""


@dataclass
class _Capture:
    """One layer's capture: exact (or converted) attention before it, record it, stop."""

    stitch: str
    order: list[torch.nn.Module] = field(default_factory=list)
    target: int | None = None  # None: the first pass, which records the layer order
    batch: LayerBatch | None = None
    causal: bool = False
    scaling: float | None = None

    def __call__(self, call: AttentionCall) -> torch.Tensor | None:
        if self.target is None:
            if any(call.module is seen for seen in self.order):
                raise ValueError(
                    f"convert needs one attention module per layer; {type(call.module).__name__}"
                    " is called twice in one forward pass (layers sharing weights)"
                )
            self.order.append(call.module)
            return exact_attention(call)
        layer = next((i for i, m in enumerate(self.order) if m is call.module), None)
        if layer is None:
            raise ValueError(
                f"an attention module ({type(call.module).__name__}) ran that the first pass "
                "did not see: convert needs the same layers on every input"
            )
        if layer < self.target:
            return None if self.stitch == "converted" else exact_attention(call)
        query, key = call.query, call.key
        if query.shape[-2] != key.shape[-2]:
            raise ValueError(
                f"convert fits self-attention: got {query.shape[-2]} queries against "
                f"{key.shape[-2]} keys in {type(call.module).__name__} (cross-attention or "
                "a cache)"
            )
        batch, length = int(key.shape[0]), int(key.shape[-2])
        key_mask = (
            torch.ones(batch, length, dtype=torch.bool, device=key.device)
            if call.key_mask is None
            else call.key_mask.expand(batch, 1, length)[:, 0]
        )
        exact = None if call.exact_key_mask is None else call.exact_key_mask[:, 0]
        dtype = torch.promote_types(query.dtype, torch.float32)  # half precision: fit in float32
        q, k, v = (x.detach().to(dtype) for x in (query, key, call.value))
        self.batch = LayerBatch(q, k, v, key_mask, exact)
        self.causal, self.scaling = call.causal, call.scaling
        raise _Captured


def splice_exact_heads(
    module: torch.nn.Module,
    out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_mask: torch.Tensor | None,
    causal: bool,
    scaling: float | None,
) -> torch.Tensor:
    """``out`` ``(B, H, L_q, d_v)`` with ``module``'s exact heads (:data:`EXACT_HEADS`)
    replaced by softmax attention over every real key (:func:`linattn.with_exact_heads`:
    those heads only, query head ``h`` reading key head ``h // (H / H_kv)``, zeros for
    rows without a key)."""
    heads = module.__dict__.get(EXACT_HEADS)
    if not heads:
        return out
    spliced: torch.Tensor = with_exact_heads(
        out, query, key, value, heads, causal=causal, key_mask=key_mask, scale=scaling
    )
    return spliced


def exact_attention(call: AttentionCall) -> torch.Tensor:
    """SDPA on the call (its mask is SDPA's: the integration borrows SDPA's mask function)."""
    out, _ = sdpa_attention_forward(
        call.module, call.query, call.key, call.value, call.attention_mask,
        scaling=call.scaling, is_causal=call.is_causal, **call.kwargs,
    )  # fmt: skip
    result: torch.Tensor = out
    return result


# -- inputs -------------------------------------------------------------------------------


def check_batches(batches: Iterable[Any], name: str) -> list[dict[str, Any]]:
    """The batches as a list, each checked: input_ids and attention_mask, real tokens."""
    if isinstance(batches, Mapping):
        raise TypeError(
            f"{name} must be an iterable of batches (dicts of input_ids and attention_mask, "
            "tokenizer output); got one dict: wrap it in a list"
        )
    out: list[dict[str, Any]] = []
    for index, batch in enumerate(batches):
        if not isinstance(batch, Mapping) or not {"input_ids", "attention_mask"} <= set(batch):
            got = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
            raise ValueError(
                f"{name}[{index}] must be a dict with input_ids and attention_mask tensors "
                f"(tokenizer output with return_tensors='pt'); got {got}"
            )
        ids, mask = batch["input_ids"], batch["attention_mask"]
        if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(ids.shape):
            raise ValueError(
                f"{name}[{index}]: attention_mask must be a tensor shaped like input_ids "
                f"{tuple(ids.shape)}; got {getattr(mask, 'shape', type(mask).__name__)}"
            )
        if ids.ndim != 2 or not bool(mask.bool().any()):
            raise ValueError(
                f"{name}[{index}] has no real tokens (attention_mask is all 0, or the batch "
                f"is empty: shape {tuple(ids.shape)}): calibration batches need text"
            )
        out.append(dict(batch))
    if not out:
        raise ValueError(f"{name} must hold at least one batch; got none")
    return out


def model_device(model: Model) -> torch.device:
    parameter = next(model.parameters(), None)
    return torch.device("cpu") if parameter is None else parameter.device


def _run(model: Model, batch: dict[str, Any], capture: _Capture) -> LayerBatch | None:
    """One forward pass of ``batch`` under ``capture``, stopped once it has its layer:
    that layer's batch (None on the first pass, which runs to the end)."""
    device = model_device(model)
    inputs = {n: x.to(device) if isinstance(x, torch.Tensor) else x for n, x in batch.items()}
    if "use_cache" in inspect.signature(model.forward).parameters:
        inputs["use_cache"] = False  # no transformers cache: the keys are the inputs'
    capture.batch = None
    try:
        with hooked(capture):
            model(**inputs)
    except _Captured:
        captured, capture.batch = capture.batch, None
        return captured
    if capture.target is not None:
        raise ValueError(
            f"the forward pass never reached attention layer {capture.target}: convert needs "
            "the same layers on every input"
        )
    return None


class _ModelLayers:
    """A transformers model's side of :func:`linattn.conversion.convert_layers`: each
    layer's activations captured from the model's own forward pass (stopped at the layer;
    the layers before it exact or converted as ``capture.stitch`` says), each fitted map
    held by its attention module."""

    def __init__(self, model: Model, capture: _Capture, inputs: dict[str, list[dict[str, Any]]]):
        self.model, self.catcher, self.inputs = model, capture, inputs

    @property
    def count(self) -> int:
        return len(self.catcher.order)

    def capture(self, layer: int, split: str) -> list[LayerBatch]:
        self.catcher.target = layer
        out: list[LayerBatch] = []
        for batch in self.inputs[split]:
            captured = _run(self.model, batch, self.catcher)
            assert captured is not None
            out.append(captured)
        return out

    def fit_options(self, layer: int) -> dict[str, Any]:
        return {"causal": self.catcher.causal, "scale": self.catcher.scaling}

    def install(self, layer: int, feature_map: FeatureMap | None, heads: tuple[int, ...]) -> None:
        module = self.catcher.order[layer]
        module.__dict__[FITTED] = feature_map
        if heads:
            module.__dict__[EXACT_HEADS] = heads

    def advance(self, layer: int) -> None:
        pass  # (every capture runs the model from its inputs)


@dataclass
class SavedState:
    """What :func:`convert` changes on the model, to put back if it fails."""

    implementation: Any
    linattn: Any
    training: bool
    maps: list[tuple[torch.nn.Module, FeatureMap]]
    exact_heads: list[tuple[torch.nn.Module, tuple[int, ...]]]


def save_state(model: Model) -> SavedState:
    maps = [(m, m.__dict__[FITTED]) for m in model.modules() if FITTED in m.__dict__]
    exact = [(m, m.__dict__[EXACT_HEADS]) for m in model.modules() if EXACT_HEADS in m.__dict__]
    return SavedState(
        model.config._attn_implementation,
        getattr(model.config, "linattn", None),
        model.training,
        maps,
        exact,
    )


def restore_state(model: Model, saved: SavedState) -> None:
    for module in model.modules():
        module.__dict__.pop(FITTED, None)
        module.__dict__.pop(EXACT_HEADS, None)
    for module, fm in saved.maps:
        module.__dict__[FITTED] = fm
    for module, heads in saved.exact_heads:
        module.__dict__[EXACT_HEADS] = heads
    model.config.linattn = saved.linattn
    if saved.implementation is not None:
        model.set_attn_implementation(saved.implementation)
    model.train(saved.training)


def use_linattn(model: Model) -> None:
    if _NAME not in AttentionInterface._global_mapping:
        raise RuntimeError(
            "attn_implementation='linattn' is not registered: import "
            "linattn.integrations.transformers (or call its register())"
        )
    if model.config._attn_implementation != _NAME:
        model.set_attn_implementation(_NAME)


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
        :func:`save_fitted`.

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
        for module, _ in saved.maps:  # a new conversion starts from the exact model
            del module.__dict__[FITTED]
        for module, _ in saved.exact_heads:
            del module.__dict__[EXACT_HEADS]
        model.config.linattn = dict(options)
        model.eval()
        use_linattn(model)
        capture = _Capture(stitch)
        with torch.no_grad():
            _run(model, fit_inputs[0], capture)  # the layer order
            if not capture.order:
                raise ValueError(
                    f"{type(model).__name__} made no attention call through transformers' "
                    "attention interface: convert cannot reach its attention"
                )
            layers = _ModelLayers(model, capture, {"fit": fit_inputs, "validation": val_inputs})
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
        "exact_heads": [list(m.__dict__.get(EXACT_HEADS, ())) for m in capture.order],
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
        Converted (:func:`convert`, :func:`load_fitted`, perhaps refined).
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
    capture = _Capture(activations)
    results = []
    try:
        model.eval()
        use_linattn(model)
        with torch.no_grad():
            _run(model, inputs[0], capture)
            for layer, module in enumerate(capture.order):
                data = _ModelLayers(model, capture, {"batches": inputs}).capture(layer, "batches")
                fm = module.__dict__.get(FITTED)
                if fm is None:
                    raise ValueError(f"attention layer {layer} has no fitted map: convert first")
                parts = {
                    "window": settings.get("window"), "sink_keys": settings.get("sink_keys", 0),
                    "causal": capture.causal, "scale": fm.scale,
                }  # fmt: skip
                err, norm = attention_errors(fm, data, **parts)
                base, _ = attention_errors(None, data, **parts)
                fitted = np.sqrt(err / norm)
                fitted.reshape(-1)[list(module.__dict__.get(EXACT_HEADS, ()))] = 0.0  # exact
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


# -- saving and loading -------------------------------------------------------------------


def _tensor_digest(digest: Any, state: Mapping[str, torch.Tensor]) -> None:
    for name in sorted(state):
        tensor = state[name].detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())


def model_fingerprint(model: Model) -> str:
    """SHA-256 (16 hex digits) of the model's configuration and every weight.

    The configuration is its JSON less what does not change the computation (names,
    versions, ``config.linattn``, the attention implementation, output switches).
    """
    config = {
        name: value
        for name, value in model.config.to_dict().items()
        if name not in _NOT_THE_MODEL and not name.startswith("_")
    }
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=repr).encode())
    _tensor_digest(digest, model.state_dict())
    return digest.hexdigest()[:16]


def module_fingerprint(module: torch.nn.Module) -> str:
    """SHA-256 (16 hex digits) of one attention module's own weights (its projections)."""
    digest = hashlib.sha256(type(module).__name__.encode())
    _tensor_digest(digest, module.state_dict())
    return digest.hexdigest()[:16]


def save_fitted(model: Model, path: str | Path) -> Path:
    """Write ``model``'s fitted maps to one safetensors file.

    :func:`linattn.transfer.save_maps` with the model's fingerprint
    (:func:`model_fingerprint`) and the options (``config.linattn``'s, each map's module
    name and weights' fingerprint).  ``config.linattn["fitted"]`` becomes ``str(path)``,
    so a model saved with ``save_pretrained`` afterwards finds the file when loaded.

    Raises
    ------
    ValueError
        The model holds no fitted maps (convert it, or load them, first).
    """
    entries = [(name, m) for name, m in model.named_modules() if FITTED in m.__dict__]
    if not entries:
        raise ValueError("model has no fitted maps: convert(...) it or load_fitted(...) first")
    settings = dict(getattr(model.config, "linattn", None) or {})
    rule = settings.get("exact_keys")
    options: dict[str, Any] = {name: settings.get(name) for name in _OPTIONS}
    options["exact_keys"] = "callable" if callable(rule) else rule
    options["modules"] = [{"name": n, "fingerprint": module_fingerprint(m)} for n, m in entries]
    options[EXACT_HEADS_ENTRY] = [list(m.__dict__.get(EXACT_HEADS, ())) for _, m in entries]
    options["conversion"] = model.__dict__.get("_linattn_conversion")
    written = save_maps(
        path,
        [m.__dict__[FITTED] for _, m in entries],
        model_fingerprint=model_fingerprint(model),
        options=options,
    )
    model.config.linattn = {**settings, "fitted": str(path)}
    return written


def _settings_of(options: Mapping[str, Any], exact_keys: Any, path: str | Path) -> dict[str, Any]:
    settings = {name: options.get(name) for name in _OPTIONS}
    if options.get("exact_keys") == "callable":
        if not callable(exact_keys):
            raise ValueError(
                f"{path} was fitted with a callable exact_keys rule: pass the same rule as "
                "load_fitted(..., exact_keys=rule)"
            )
        settings["exact_keys"] = exact_keys
    elif exact_keys is not None:
        raise ValueError(
            f"exact_keys is only for a file fitted with a callable rule; {path} was fitted "
            f"with exact_keys={options.get('exact_keys')!r}"
        )
    return settings


def load_fitted(
    model: Model,
    path: str | Path,
    *,
    exact_keys: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Model:
    """Put the maps of ``path`` (from :func:`save_fitted`) on ``model``'s attention.

    Sets ``config.linattn`` to the options they were fitted with (``"fitted"``:
    ``str(path)``) and switches the model to ``attn_implementation="linattn"``.  No refit.

    Parameters
    ----------
    exact_keys : callable, optional
        The rule, when the maps were fitted with a callable ``exact_keys`` (a file
        cannot hold it).

    Raises
    ------
    ValueError
        ``path`` is not a fitted-maps file, was fitted for another model (the message
        gives both fingerprints) or written by another linattn version.
    """
    layers, options = load_maps(path, model_fingerprint=model_fingerprint(model))
    settings = _settings_of(options, exact_keys, path)
    modules = [model.get_submodule(entry["name"]) for entry in options["modules"]]
    heads = _file_exact_heads(options)
    for module, module_heads, (fm, _) in zip(modules, heads, layers, strict=True):
        if fm is not None:
            module.__dict__[FITTED] = fm
        _set_exact_heads(module, module_heads)
    model.config.linattn = {**settings, "fitted": str(path)}
    use_linattn(model)
    return model


def _file_exact_heads(options: Mapping[str, Any]) -> list[tuple[int, ...]]:
    """Each module's exact heads from a file's options (files written before
    :data:`EXACT_HEADS_ENTRY` kept them in the modules' entries)."""
    entries = options.get("modules", [])
    if EXACT_HEADS_ENTRY not in options:
        return [tuple(int(h) for h in entry.get("exact_heads", ())) for entry in entries]
    return exact_heads_of(options, len(entries))


def _set_exact_heads(module: torch.nn.Module, heads: tuple[int, ...]) -> None:
    if heads:
        module.__dict__[EXACT_HEADS] = heads
    else:
        module.__dict__.pop(EXACT_HEADS, None)


_files: dict[str, tuple[float, dict[str, Any], dict[str, Any]]] = {}
_files_lock = threading.Lock()


def map_from_file(
    module: torch.nn.Module, path: str | Path, settings: Mapping[str, Any]
) -> FeatureMap:
    """``module``'s map from the file ``config.linattn["fitted"]`` names; kept on it
    (with its exact heads).

    The integration's first call of a module without a map comes here.  The module is
    found in the file by its own weights' fingerprint (a module knows nothing of its
    model); the file's options must be the ones the model runs with.
    """
    key = str(Path(path).resolve())
    with _files_lock:
        modified = Path(key).stat().st_mtime if Path(key).exists() else -1.0
        cached = _files.get(key)
        if cached is None or cached[0] != modified:
            layers, options = load_maps(path, model_fingerprint=None)
            entries = options.get("modules", [])
            table = {
                entry["fingerprint"]: (fm, heads)
                for entry, heads, (fm, _) in zip(
                    entries, _file_exact_heads(options), layers, strict=False
                )
                if fm is not None
            }
            cached = _files[key] = (modified, table, options)
    _, table, options = cached
    fingerprint = module_fingerprint(module)
    found = table.get(fingerprint)
    if found is None:
        raise ValueError(
            f"config.linattn['fitted'] = {str(path)!r} holds no map for this model's "
            f"{type(module).__name__} (weights fingerprint {fingerprint}): the file was fitted "
            "for another model"
        )
    for name in ("window", "sink_keys"):
        if options.get(name) != settings.get(name):
            raise ValueError(
                f"{path} was fitted with {name}={options.get(name)!r}; config.linattn has "
                f"{name}={settings.get(name)!r}"
            )
    fitted_rule = options.get("exact_keys")
    rule = settings.get("exact_keys")
    if (fitted_rule == "callable") != callable(rule) or (
        not callable(rule) and fitted_rule != rule
    ):
        raise ValueError(
            f"{path} was fitted with exact_keys={fitted_rule!r}; config.linattn has "
            f"exact_keys={rule!r}"
        )
    fm, heads = found
    _set_exact_heads(module, heads)
    module.__dict__[FITTED] = fm
    return fm
