"""What fitted maps were fitted to: a model's attention signature, the same whichever
route computed it (the NumPy BERT, transformers, a sentence-transformers model) and
whatever dtype the model was loaded in.

A map fitted to one layer's attention belongs with that layer's query and key
projections.  The signature holds the model's shape (layers, heads, head size, and the
positions it reads) and, per attention layer, a few numbers per weight tensor: its root
mean square and its projections on fixed pseudo-random signs (:func:`tensor_signature`).
Two signatures match when the shapes are equal and every number agrees within
:data:`TOLERANCE` of its tensor's root mean square: a cast to bfloat16 or float16 moves
them by about ``2^-9`` of it, another model's weights by about 1.

Examples
--------
>>> import numpy as np
>>> w = np.random.default_rng(0).normal(size=(8, 8)).astype(np.float32)
>>> a = signature({"layers": 1}, [{"query.weight": w}])
>>> b = signature({"layers": 1}, [{"query.weight": w.astype(np.float16)}])
>>> mismatch(a, b) is None
True
>>> mismatch(a, signature({"layers": 1}, [{"query.weight": w[::-1].copy()}]))
"layer 0's query.weight differs (another model's weights)"
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = [
    "PROJECTIONS",
    "TOLERANCE",
    "digest",
    "layer_mismatch",
    "mismatch",
    "signature",
    "tensor_signature",
]

#: Projections per tensor.
PROJECTIONS = 4
#: Two tensors' numbers agree when they differ by at most this much of its root mean
#: square (a bfloat16 cast moves them by about 0.002, another tensor by about 1).
TOLERANCE = 0.02


def tensor_signature(tensor: Any) -> list[float]:
    """``[rms, p_1 .. p_k]``: the tensor's root mean square and its projections on
    :data:`PROJECTIONS` fixed sign vectors, each divided by ``sqrt(n)`` (float64 on the
    host, from any array with ``numpy()`` or ``__array__``)."""
    values = np.asarray(_host(tensor), dtype=np.float64).reshape(-1)
    n = max(values.size, 1)
    rms = float(np.sqrt(np.mean(values**2))) if values.size else 0.0
    signs = np.random.default_rng(0).choice([-1.0, 1.0], size=(PROJECTIONS, _PERIOD))
    periods = -(-values.size // _PERIOD)
    padded = np.zeros(periods * _PERIOD)
    padded[: values.size] = values
    projections = signs @ padded.reshape(periods, _PERIOD).sum(axis=0) / np.sqrt(n)
    return [rms, *(float(p) for p in projections)]


#: The sign vectors repeat with this period (a prime): a tensor's projections cost one
#: pass over it, whatever its size.
_PERIOD = 4099


def layer_mismatch(a: Mapping[str, Any], b: Mapping[str, Any]) -> str | None:
    """Why two layers' signatures (``signature(...)["layers"][i]``) are not one
    layer's (None: they are)."""
    if sorted(a) != sorted(b):
        return f"tensors {sorted(a)} are not {sorted(b)}"
    for name in a:
        x, y = np.asarray(a[name]), np.asarray(b[name])
        scale = max(abs(float(x[0])), abs(float(y[0])), 1e-30)
        if x.shape != y.shape or np.any(np.abs(x - y) > TOLERANCE * scale):
            return f"{name} differs (another model's weights)"
    return None


def signature(facts: Mapping[str, Any], layers: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A model's signature: its ``facts`` (shapes, JSON values) and, per attention layer,
    :func:`tensor_signature` of each of its tensors (by name: ``"query.weight"``, ...)."""
    return {
        "facts": dict(facts),
        "layers": [
            {name: tensor_signature(tensors[name]) for name in sorted(tensors)}
            for tensors in layers
        ],
    }


def mismatch(found: Mapping[str, Any], expected: Mapping[str, Any]) -> str | None:
    """Why two signatures are not one model's (None: they are)."""
    if found.get("facts") != expected.get("facts"):
        return f"its shape {found.get('facts')} is not {expected.get('facts')}"
    ours, theirs = found.get("layers", []), expected.get("layers", [])
    if len(ours) != len(theirs):
        return f"{len(ours)} attention layers, not {len(theirs)}"
    for layer, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        why = layer_mismatch(a, b)
        if why is not None:
            return f"layer {layer}'s {why}"
    return None


def digest(sig: Mapping[str, Any]) -> str:
    """16 hex digits naming a signature in messages: its facts and its numbers to two
    significant digits (for reading; :func:`mismatch` decides)."""
    rounded = [
        {name: [float(f"{v:.2g}") for v in values] for name, values in layer.items()}
        for layer in sig.get("layers", [])
    ]
    text = json.dumps({"facts": sig.get("facts"), "layers": rounded}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _host(tensor: Any) -> Any:
    if hasattr(tensor, "detach"):  # torch: any dtype (bfloat16 has no NumPy twin)
        return tensor.detach().to("cpu").double().numpy()
    return tensor
