"""Deprecated: moved to :mod:`linattn.integrations.transformers` (``refine``, ``LOSSES``).

Reading a name here warns (``DeprecationWarning``) and gives the package's object; this
module goes in the next release.
"""

from __future__ import annotations

import warnings
from typing import Any

import linattn.integrations.transformers as package

#: What ``from linattn.integrations.transformers_refine import *`` gave.
__all__ = sorted(("LOSSES", "refine"))


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"linattn.integrations.transformers_refine is deprecated: import {name} from "
        f"{package.__name__}",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(package, name)
