"""The fitted-maps file: one model's maps in a safetensors file (:func:`save_maps`,
:func:`load_maps`) with the model's fingerprint, the linattn version and the options
(:data:`FORMAT`); :func:`exact_heads_of` reads a conversion's exact heads from them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from linattn.features import FeatureMap

__all__ = ["EXACT_HEADS_ENTRY", "FORMAT", "exact_heads_of", "load_maps", "save_maps"]

#: The ``format`` entry of a fitted-maps file's metadata.
FORMAT = "linattn-fitted-maps/1"
#: The options entry of a fitted-maps file that lists each layer's exact heads (query
#: heads attending to every key exactly: :func:`linattn.with_exact_heads`).
EXACT_HEADS_ENTRY = "exact_heads_per_layer"


def save_maps(
    path: str | Path,
    maps: Sequence[FeatureMap | None],
    *,
    model_fingerprint: str,
    options: dict[str, Any] | None = None,
) -> Path:
    """Write one model's fitted maps (one per layer, None for none) to a safetensors file.

    The metadata holds ``FORMAT``, the linattn version, ``model_fingerprint`` (the
    caller's digest of the model's weights and configuration), each map's softmax scale
    and ``options`` (JSON: how the maps were fitted and are to be called).  Needs the
    ``safetensors`` package.

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
    metadata = {
        "format": FORMAT,
        "linattn_version": linattn.__version__,
        "model_fingerprint": str(model_fingerprint),
        "num_layers": str(len(maps)),
        "options": json.dumps(options or {}, sort_keys=True),
        "scales": json.dumps([None if m is None else m.scale for m in maps]),
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=metadata)
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
    path: str | Path, *, model_fingerprint: str | None
) -> tuple[list[tuple[FeatureMap | None, np.ndarray | None]], dict[str, Any]]:
    """A model's fitted maps as ``[(feature_map, far_weight) per layer]``, and the options.

    Each map goes to :func:`linattn.linear_attention` as it is (its far weight is
    ``feature_map.parameters.far_weight``, returned for reading).  No refit.  A model
    converted with exact heads lists them per layer in the options
    (:func:`exact_heads_of`): pass each layer's to :func:`linattn.with_exact_heads` after
    ``linear_attention``.

    Raises
    ------
    ValueError
        The file is not a fitted-maps file, was fitted for another model (its
        ``model_fingerprint`` differs; ``None`` skips this check) or written by another
        linattn version.
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
    if metadata.get("format") != FORMAT:
        raise ValueError(f"path must be a linattn fitted-maps file ({FORMAT}); {path} is not")
    found = metadata.get("model_fingerprint")
    if model_fingerprint is not None and found != model_fingerprint:
        raise ValueError(
            f"{path} was fitted for another model (fingerprint {found}); this model's is "
            f"{model_fingerprint}"
        )
    if metadata.get("linattn_version") != linattn.__version__:
        raise ValueError(
            f"{path} was written by linattn {metadata.get('linattn_version')}; this is "
            f"{linattn.__version__}: refit the maps"
        )
    scales = json.loads(metadata["scales"])
    layers: list[tuple[FeatureMap | None, np.ndarray | None]] = []
    for layer in range(int(metadata["num_layers"])):
        prefix = f"layer.{layer}."
        if f"{prefix}query_weight" not in tensors:
            layers.append((None, None))
            continue
        tied = f"{prefix}key_weight" not in tensors
        key_weight = tensors[f"{prefix}{'query' if tied else 'key'}_weight"]
        far_weight = tensors[f"{prefix}far_weight"]
        if key_weight.ndim == 2:  # one far weight (safetensors keeps 0-d arrays as (1,))
            far_weight = far_weight.reshape(())
        fm = FeatureMap.fitted(
            tensors[f"{prefix}query_weight"],
            tensors[f"{prefix}query_bias"],
            key_weight=None if tied else tensors[f"{prefix}key_weight"],
            key_bias=None if tied else tensors[f"{prefix}key_bias"],
            far_weight=far_weight,
            tied=tied,
            scale=scales[layer],
        )
        assert fm.parameters is not None
        layers.append((fm, fm.parameters.far_weight))
    return layers, json.loads(metadata["options"])
