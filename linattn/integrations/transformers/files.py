"""Fitted maps in a file: a model's fingerprint, :func:`save_fitted`, :func:`load_fitted`,
and :func:`map_from_file`, which the integration's attention calls for a module whose
model names a file (``config.linattn["fitted"]``) on the module's first call.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from linattn.features import FeatureMap
from linattn.integrations.transformers.options import NAME, Model, use_linattn
from linattn.integrations.transformers.state import state_of, update
from linattn.transfer import EXACT_HEADS_ENTRY, exact_heads_of, load_maps, save_maps
from linattn.transfer.fingerprint import layer_mismatch, signature

__all__ = [
    "file_exact_heads",
    "load_fitted",
    "map_from_file",
    "model_fingerprint",
    "model_signature",
    "module_fingerprint",
    "resolve_fitted",
    "save_fitted",
    "save_pretrained",
]

#: The options of ``config.linattn`` a conversion sets.
_OPTIONS = ("num_features", "window", "sink_keys", "exact_keys")
#: Configuration entries that say nothing about the model's computation (names, versions,
#: run-time switches, what a save or this integration adds): left out of the fingerprint.
_NOT_THE_MODEL = {
    "_name_or_path", "_commit_hash", "architectures", "transformers_version", "linattn",
    "attn_implementation", "_attn_implementation_autoset", "dtype", "torch_dtype",
    "output_attentions", "output_hidden_states", "return_dict", "use_cache",
}  # fmt: skip


def _tensor_digest(digest: Any, state: Mapping[str, torch.Tensor]) -> None:
    for name in sorted(state):
        tensor = state[name].detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())


def model_signature(model: Model, names: Sequence[str]) -> dict[str, Any]:
    """What fitted maps are fitted to: the model's shape and positions and the weights of
    its attention modules ``names`` (:func:`linattn.transfer.fingerprint.signature`),
    the same as :func:`linattn.models.convert.model_signature` for the same BERT, in
    any dtype."""
    config = model.config
    heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // heads
    facts = {
        "layers": len(names), "heads": heads, "head_dim": int(head_dim),
        "positions": getattr(config, "max_position_embeddings", None),
    }  # fmt: skip
    layers = [dict(_module(model, name).state_dict()) for name in names]
    return signature(facts, layers)


def _module(model: Model, name: str) -> torch.nn.Module:
    """``model``'s module ``name``, or the one module whose name ends with it (a file
    written for ``BertModel`` names ``encoder.layer.0.attention.self``; a
    ``BertForSequenceClassification`` holds it as ``bert.encoder...``)."""
    try:
        found: torch.nn.Module = model.get_submodule(name)
        return found
    except AttributeError:
        pass
    matches = [m for n, m in model.named_modules() if n.endswith("." + name)]
    if len(matches) != 1:
        raise ValueError(
            f"the file's maps are for module {name!r}, which this model "
            f"({type(model).__name__}) {'has more than once' if matches else 'lacks'}"
        )
    module: torch.nn.Module = matches[0]
    return module


def model_fingerprint(model: Model) -> str:
    """SHA-256 (16 hex digits) of the model's configuration and every weight: the
    fingerprint of fitted-maps files of format 1 (before :func:`model_signature`).

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
    name and weights' fingerprint).  ``config.linattn["fitted"]`` becomes the file's
    absolute path (a relative one broke a model loaded from another directory), so a
    model saved with ``save_pretrained`` afterwards finds the file when loaded.

    Raises
    ------
    ValueError
        The model holds no fitted maps (convert it, or load them, first).
    """
    entries = [(name, m) for name, m in model.named_modules() if state_of(m).fitted is not None]
    if not entries:
        raise ValueError("model has no fitted maps: convert(...) it or load_fitted(...) first")
    settings = dict(getattr(model.config, "linattn", None) or {})
    rule = settings.get("exact_keys")
    options: dict[str, Any] = {name: settings.get(name) for name in _OPTIONS}
    options["exact_keys"] = "callable" if callable(rule) else rule
    options["modules"] = [{"name": n, "fingerprint": module_fingerprint(m)} for n, m in entries]
    options[EXACT_HEADS_ENTRY] = [list(state_of(m).exact_heads) for _, m in entries]
    options["conversion"] = model.__dict__.get("_linattn_conversion")
    calibrated = [n for _, m in entries if (n := state_of(m).calibrated_length) is not None]
    if calibrated:  # (a file fitted at length, loaded and saved again, keeps its range)
        options["max_length"] = max(calibrated)
    written = save_maps(
        path,
        [state_of(m).fitted for _, m in entries],
        model_fingerprint=model_signature(model, [n for n, _ in entries]),
        options=options,
    )
    model.config.linattn = {**settings, "fitted": str(Path(path).resolve())}
    return written


#: The maps' file inside a folder :func:`save_pretrained` writes.
MAPS_FILE = "linattn-maps.safetensors"


def save_pretrained(model: Any, folder: str | Path) -> Path:
    """Save a converted model as one folder that moves and is shared as a whole: the
    model as transformers (or sentence-transformers) saves it, its fitted maps inside
    (:data:`MAPS_FILE`, named relative to the folder in ``config.linattn``), and
    ``"attn_implementation": "linattn"`` in its ``config.json``.

    Load it with ``AutoModel.from_pretrained(folder)`` or ``SentenceTransformer(folder)``
    after ``import linattn.integrations.transformers``; without that import transformers
    refuses the folder (``attn_implementation="linattn"`` is unknown to it) instead of
    running exact attention.

    Parameters
    ----------
    model : transformers model or sentence_transformers.SentenceTransformer
        Converted (:func:`~linattn.integrations.transformers.convert`) or loaded with
        its maps (:func:`load_fitted`); a SentenceTransformer's first module's model.
    folder : path
        Written (created if needed).

    Returns
    -------
    Path
        The maps' file.

    Examples
    --------
    >>> save_pretrained(model, "minilm-linattn")  # doctest: +SKIP
    >>> SentenceTransformer("minilm-linattn").encode(["a long document ..."])  # doctest: +SKIP
    """
    folder = Path(folder)
    sentence = hasattr(model, "save") and hasattr(model, "_first_module")
    hf = model._first_module().auto_model if sentence else model
    if not any(state_of(m).fitted is not None for m in hf.modules()):
        raise ValueError("model has no fitted maps: convert(...) it or load_fitted(...) first")
    settings = dict(getattr(hf.config, "linattn", None) or {})
    hf.config.linattn = {**settings, "fitted": MAPS_FILE}  # (config.json: relative)
    try:
        if sentence:
            model.save(str(folder))
        else:
            model.save_pretrained(folder)
    finally:
        hf.config.linattn = settings
    inner = folder / (_first_module_path(folder) if sentence else "")
    maps = save_fitted(hf, inner / MAPS_FILE)  # (config.linattn["fitted"]: absolute here)
    config_file = inner / "config.json"
    config = json.loads(config_file.read_text())
    config["attn_implementation"] = NAME
    config["linattn"] = {**config.get("linattn", {}), "fitted": MAPS_FILE}
    temporary = config_file.with_name(config_file.name + ".tmp")
    temporary.write_text(json.dumps(config, indent=2, sort_keys=True))
    temporary.replace(config_file)
    return maps


def _first_module_path(folder: Path) -> str:
    """Where a SentenceTransformer saved its first module (``modules.json``'s ``path``
    of module 0: the folder itself in sentence-transformers 3 and later)."""
    modules = json.loads((folder / "modules.json").read_text())
    return str(next(m for m in modules if int(m["idx"]) == 0)["path"])


def resolve_fitted(path: str, config: Any) -> str:
    """``config.linattn["fitted"]`` as a path: relative ones are the model folder's
    (``config._name_or_path``, where :func:`save_pretrained` put the file)."""
    if Path(path).is_absolute():
        return path
    base = Path(str(getattr(config, "_name_or_path", "") or ""))
    candidate = base / path
    return str(candidate) if base.is_dir() and candidate.exists() else path


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
        says what differs and gives both fingerprints) or is in a format this linattn
        cannot read.  Files of every route load here: ``linattn convert``'s and
        :func:`linattn.models.convert.convert_encoder`'s too (their modules are named
        as in ``BertModel``), into the model in any dtype.
    """

    def signed(options: Mapping[str, Any]) -> dict[str, Any]:
        return model_signature(model, [entry["name"] for entry in options["modules"]])

    layers, options = load_maps(
        path, model_fingerprint=signed, legacy=lambda: model_fingerprint(model)
    )
    settings = _settings_of(options, exact_keys, path)
    modules = [_module(model, entry["name"]) for entry in options["modules"]]
    heads = file_exact_heads(options)
    for module, module_heads, (fm, _) in zip(modules, heads, layers, strict=True):
        fitted = {} if fm is None else {"fitted": fm}
        calibrated = options.get("max_length")
        update(module, exact_heads=tuple(module_heads), calibrated_length=calibrated, **fitted)
    model.config.linattn = {**settings, "fitted": str(Path(path).resolve())}
    use_linattn(model)
    return model


def _file_signature(path: str | Path) -> list[dict[str, Any]] | None:
    """The per-layer signatures a file holds (None: a format-1 file, which has none)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        metadata = f.metadata() or {}
    if "model_signature" not in metadata:
        return None
    layers: list[dict[str, Any]] = json.loads(metadata["model_signature"])["layers"]
    return layers


def file_exact_heads(options: Mapping[str, Any]) -> list[tuple[int, ...]]:
    """Each module's exact heads from a file's options (files written before
    :data:`EXACT_HEADS_ENTRY` kept them in the modules' entries)."""
    entries = options.get("modules", [])
    if EXACT_HEADS_ENTRY not in options:
        return [tuple(int(h) for h in entry.get("exact_heads", ())) for entry in entries]
    return exact_heads_of(options, len(entries))


#: Each file's maps by layer: (its modification time, [(format 1's module fingerprint,
#: format 2's layer signature, map, exact heads)], its options).
_FileTable = list[tuple[Any, dict[str, Any] | None, FeatureMap, tuple[int, ...]]]
_files: dict[str, tuple[float, _FileTable, dict[str, Any]]] = {}
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
            signed = _file_signature(path)
            table = [
                (entry.get("fingerprint"), None if signed is None else signed[i], fm, heads)
                for i, (entry, heads, (fm, _)) in enumerate(
                    zip(entries, file_exact_heads(options), layers, strict=False)
                )
                if fm is not None
            ]
            cached = _files[key] = (modified, table, options)
    _, table, options = cached
    mine = signature({}, [dict(module.state_dict())])["layers"][0]
    fingerprint = None
    found = None
    for old, layer, fm, heads in table:
        if layer is not None and layer_mismatch(layer, mine) is None:
            found = (fm, heads)
            break
        if layer is None:  # (format 1: the module's weights' exact hash)
            fingerprint = fingerprint or module_fingerprint(module)
            if old == fingerprint:
                found = (fm, heads)
                break
    if found is None:
        raise ValueError(
            f"config.linattn['fitted'] = {str(path)!r} holds no map for this model's "
            f"{type(module).__name__} (no layer of the file has its weights): the file was "
            "fitted for another model"
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
    update(
        module, fitted=fm, exact_heads=tuple(heads),
        calibrated_length=options.get("max_length"),
    )  # fmt: skip
    return fm
