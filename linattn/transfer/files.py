"""The fitted-maps file: one model's maps in a safetensors file (:func:`save_maps`,
:func:`load_maps`) with what they were fitted to (the model's attention signature,
:mod:`linattn.transfer.fingerprint`), the linattn version, the options and the format
(:data:`FORMAT`); :func:`exact_heads_of` reads a conversion's exact heads from them.

One format for every route: the NumPy BERT's conversion (``linattn convert``,
:func:`linattn.models.convert.convert_encoder`), the transformers integration's
``convert`` and ``refine`` write the same file, and each reads the others' (the
signature is computed from the attention layers' weights, whichever library holds them,
and survives a cast to bfloat16 or float16).  A file names its format; this version
reads :data:`READABLE` (files of linattn versions before the signature, format 1, are
checked by their route's own fingerprint).

A file is written under a temporary name in its folder and renamed when whole, so that
an interrupted write never leaves a partial file under the final name (a later load, or
a conversion resuming from it, would take it); the metadata lists the layers that have
maps, and a load checks that every one of them is there, whole.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from linattn.features import FeatureMap
from linattn.transfer.fingerprint import digest, mismatch

__all__ = [
    "EXACT_HEADS_ENTRY",
    "FORMAT",
    "READABLE",
    "Fingerprint",
    "exact_heads_of",
    "load_maps",
    "save_maps",
]

#: The ``format`` entry of a fitted-maps file's metadata (the one written).
FORMAT = "linattn-fitted-maps/2"
#: The formats this version reads: 1 (a route's own fingerprint of every weight) and 2
#: (the attention signature, the modules' names).
READABLE = ("linattn-fitted-maps/1", FORMAT)
#: What a model is checked against: its fingerprint (format 1's string), its signature
#: (:func:`linattn.transfer.fingerprint.signature`), or a function of the file's options
#: that returns either (the modules a file names decide which tensors are signed).
Fingerprint = str | Mapping[str, Any] | Callable[[Mapping[str, Any]], str | Mapping[str, Any]]
#: The options entry of a fitted-maps file that lists each layer's exact heads (query
#: heads attending to every key exactly: :func:`linattn.with_exact_heads`).
EXACT_HEADS_ENTRY = "exact_heads_per_layer"


def save_maps(
    path: str | Path,
    maps: Sequence[FeatureMap | None],
    *,
    model_fingerprint: str | Mapping[str, Any],
    options: dict[str, Any] | None = None,
    complete: bool = True,
) -> Path:
    """Write one model's fitted maps (one per layer, None for none) to a safetensors file.

    ``complete=False`` marks a conversion's checkpoint (the layers fitted so far): it
    resumes a conversion, and :func:`load_maps` refuses it for use.

    The metadata holds ``FORMAT``, the linattn version, ``model_fingerprint`` (the
    model's attention signature, ``linattn.transfer.fingerprint.signature``, and its
    digest; a string is kept as it is), each map's softmax scale and ``options`` (JSON:
    how the maps were fitted and are to be called).  Needs the ``safetensors`` package.

    Examples
    --------
    >>> import tempfile, pathlib
    >>> import linattn as la
    >>> fm = la.FeatureMap(4, 8, kind="hedgehog")
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "maps.safetensors"
    >>> _ = save_maps(path, [fm, None], model_fingerprint="abc", options={"window": 4})
    >>> layers, options = load_maps(path, model_fingerprint="abc")
    >>> layers[0][0].fingerprint == fm.fingerprint, layers[1], options
    (True, (None, None), {'window': 4})
    """
    from safetensors.numpy import save_file

    import linattn

    tensors: dict[str, np.ndarray] = {}
    for layer, fm in enumerate(maps):
        if fm is None:
            continue
        if fm.parameters is None:
            raise ValueError(f"maps[{layer}] must be a fitted map; got kind={fm.kind!r}")
        for name, array in fm.parameters.arrays().items():
            tensors[f"layer.{layer}.{name}"] = np.ascontiguousarray(array)
    signed: dict[str, str] = {}
    if isinstance(model_fingerprint, Mapping):
        signed = {"model_signature": json.dumps(model_fingerprint)}
        model_fingerprint = digest(model_fingerprint)
    metadata = {
        "format": FORMAT,
        "linattn_version": linattn.__version__,
        "model_fingerprint": str(model_fingerprint),
        **signed,
        "num_layers": str(len(maps)),
        "options": json.dumps(options or {}, sort_keys=True),
        "scales": json.dumps([None if m is None else m.scale for m in maps]),
        "layers": json.dumps([layer for layer, fm in enumerate(maps) if fm is not None]),
        "complete": json.dumps(bool(complete)),
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(handle)
    try:
        save_file(tensors, temporary, metadata=metadata)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    return path


def exact_heads_of(options: Mapping[str, Any], num_layers: int) -> list[tuple[int, ...]]:
    """Each layer's exact heads from a fitted-maps file's options (:func:`load_maps`),
    ``()`` for every layer where the file lists none.

    Examples
    --------
    >>> exact_heads_of({"exact_heads_per_layer": [[2], []]}, 2)
    [(2,), ()]
    >>> exact_heads_of({}, 2)
    [(), ()]
    """
    listed = options.get(EXACT_HEADS_ENTRY) or [[]] * num_layers
    if len(listed) != num_layers:
        raise ValueError(
            f"options[{EXACT_HEADS_ENTRY!r}] must list {num_layers} layers; got {len(listed)}"
        )
    return [tuple(int(h) for h in heads) for heads in listed]


def load_maps(
    path: str | Path,
    *,
    model_fingerprint: Fingerprint | None,
    partial: bool = False,
    legacy: Callable[[], str] | None = None,
) -> tuple[list[tuple[FeatureMap | None, np.ndarray | None]], dict[str, Any]]:
    """A model's fitted maps as ``[(feature_map, far_weight) per layer]``, and the options.

    Each map goes to :func:`linattn.linear_attention` as it is (its far weight is
    ``feature_map.parameters.far_weight``, returned for reading).  No refit.  A model
    converted with exact heads lists them per layer in the options
    (:func:`exact_heads_of`): pass each layer's to :func:`linattn.with_exact_heads` after
    ``linear_attention``.

    ``partial=True`` also takes a conversion's checkpoint (``save_maps(...,
    complete=False)``: the layers fitted so far), as a conversion resuming does.

    Raises
    ------
    ValueError
        The file is not a fitted-maps file, is in a format this version cannot read
        (the message names the version that wrote it), was fitted for another model
        (``model_fingerprint``: a signature that does not match the file's, or a string
        that differs from it; ``None`` skips this check; a format-1 file, which has no
        signature, is checked by ``legacy()``, its route's fingerprint), is damaged (a
        layer it lists missing or malformed) or is a checkpoint of an unfinished
        conversion (without ``partial``).
    """
    from safetensors import safe_open

    import linattn

    path = Path(path)
    try:
        with safe_open(str(path), framework="numpy") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    except Exception as error:  # OSError, or safetensors' own error for a foreign file
        raise ValueError(f"path must be a linattn fitted-maps file; {path}: {error}") from None
    written = metadata.get("format", "")
    if not written.startswith("linattn-fitted-maps/"):
        raise ValueError(f"path must be a linattn fitted-maps file ({FORMAT}); {path} is not")
    if written not in READABLE:
        raise ValueError(
            f"{path} is in format {written}, written by linattn "
            f"{metadata.get('linattn_version')}; this linattn ({linattn.__version__}) reads "
            f"{', '.join(READABLE)}: upgrade linattn"
        )
    try:
        scales = json.loads(metadata["scales"])
        count = int(metadata["num_layers"])
        options = json.loads(metadata["options"])
        listed = json.loads(metadata["layers"]) if "layers" in metadata else None
        complete = json.loads(metadata.get("complete", "true"))
    except (KeyError, ValueError) as error:
        raise ValueError(f"{path} is damaged: its metadata lacks or garbles {error}") from None
    if model_fingerprint is not None:
        _check_model(path, metadata, options, model_fingerprint, legacy)
    if not isinstance(scales, list) or len(scales) != count:
        raise ValueError(f"{path} is damaged: {count} layers but scales for {scales!r}")
    try:
        present = sorted(
            {int(name.split(".")[1]) for name in tensors if name.endswith(".query_weight")}
        )
    except (IndexError, ValueError):
        raise ValueError(f"{path} is damaged: tensors {sorted(tensors)}") from None
    if listed is not None and present != listed:
        raise ValueError(
            f"{path} is damaged: it lists maps for layers {listed}, holds them for {present}"
        )
    if not complete and not partial:
        raise ValueError(
            f"{path} is the checkpoint of an unfinished conversion (maps for layers "
            f"{present} of {count}): run the conversion again to resume it"
        )
    layers: list[tuple[FeatureMap | None, np.ndarray | None]] = []
    for layer in range(count):
        prefix = f"layer.{layer}."
        if f"{prefix}query_weight" not in tensors:
            layers.append((None, None))
            continue
        try:
            fm = _fitted_map(tensors, prefix, scales[layer])
        except (KeyError, ValueError, TypeError) as error:
            raise ValueError(f"{path} is damaged: layer {layer}'s map: {error}") from None
        assert fm.parameters is not None
        layers.append((fm, fm.parameters.far_weight))
    return layers, options


def _check_model(
    path: Path,
    metadata: Mapping[str, str],
    options: Mapping[str, Any],
    expected: Fingerprint,
    legacy: Callable[[], str] | None,
) -> None:
    """ValueError unless the file was fitted to the model ``expected`` describes."""
    if callable(expected):
        expected = expected(options)
    found = metadata.get("model_fingerprint")
    if "model_signature" in metadata and isinstance(expected, Mapping):
        why = mismatch(json.loads(metadata["model_signature"]), expected)
        if why is not None:
            raise ValueError(
                f"{path} was fitted for another model ({why}; fingerprint {found}); this "
                f"model's is {digest(expected)}"
            )
        return
    if isinstance(expected, Mapping):  # (a format-1 file: its route's own fingerprint)
        if legacy is None:
            raise ValueError(
                f"{path} has no model signature (written by linattn "
                f"{metadata.get('linattn_version')}): load it through the route that wrote "
                "it, or pass model_fingerprint=None to skip the check"
            )
        expected = legacy()
    if found != expected:
        raise ValueError(
            f"{path} was fitted for another model (fingerprint {found}); this model's is "
            f"{expected}"
        )


def _fitted_map(tensors: Mapping[str, np.ndarray], prefix: str, scale: Any) -> FeatureMap:
    """One layer's map from a file's tensors (``KeyError`` naming a missing one)."""
    tied = f"{prefix}key_weight" not in tensors
    key_weight = tensors[f"{prefix}{'query' if tied else 'key'}_weight"]
    far_weight = tensors[f"{prefix}far_weight"]
    if key_weight.ndim == 2:  # one far weight (safetensors keeps 0-d arrays as (1,))
        far_weight = far_weight.reshape(())
    return FeatureMap.fitted(
        tensors[f"{prefix}query_weight"],
        tensors[f"{prefix}query_bias"],
        key_weight=None if tied else tensors[f"{prefix}key_weight"],
        key_bias=None if tied else tensors[f"{prefix}key_bias"],
        far_weight=far_weight,
        tied=tied,
        scale=scale,
    )
