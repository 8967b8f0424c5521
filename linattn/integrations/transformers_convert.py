"""Deprecated: moved to the package :mod:`linattn.integrations.transformers`.

Each name this module had is the package's object (``convert``, ``layer_errors``,
``save_fitted``, ``load_fitted``, ... from :mod:`linattn.integrations.transformers`;
the capture hook's helpers from its ``capture`` module).  Reading one here warns
(``DeprecationWarning``) and names its new place; this module goes in the next release.
The per-module keys ``FITTED`` and ``EXACT_HEADS`` are gone: an attention module keeps
one record, ``linattn.integrations.transformers.state_of(module)`` (``.fitted``,
``.exact_heads``).
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

import linattn.integrations.transformers as package

_CAPTURE = ("AttentionCall", "Hook", "capture_hook", "check_batches", "exact_attention")
_CONVERT = ("SavedState", "convert", "layer_errors", "restore_state", "save_state")
_FILES = ("load_fitted", "map_from_file", "model_fingerprint", "module_fingerprint")
#: Each name of this module and the module that now holds it.
MOVED = {
    **dict.fromkeys((*_CAPTURE, "hooked", "model_device"), f"{package.__name__}.capture"),
    **dict.fromkeys(_CONVERT, f"{package.__name__}.convert"),
    **dict.fromkeys((*_FILES, "save_fitted"), f"{package.__name__}.files"),
    **dict.fromkeys(("Model", "use_linattn"), f"{package.__name__}.options"),
    "splice_exact_heads": f"{package.__name__}.attention",
}
#: What ``from linattn.integrations.transformers_convert import *`` gave.
__all__ = sorted(
    (
        "AttentionCall",
        "capture_hook",
        "convert",
        "layer_errors",
        "load_fitted",
        "map_from_file",
        "model_fingerprint",
        "save_fitted",
    )
)


def __getattr__(name: str) -> Any:
    if name in ("FITTED", "EXACT_HEADS"):
        raise AttributeError(
            f"linattn.integrations.transformers_convert.{name} is removed: an attention "
            "module keeps one record, linattn.integrations.transformers.state_of(module) "
            "(.fitted, .exact_heads)"
        )
    if name not in MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    where = package.__name__ if name in package.__all__ else MOVED[name]
    warnings.warn(
        f"linattn.integrations.transformers_convert is deprecated: import {name} from {where}",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(MOVED[name]), name)
