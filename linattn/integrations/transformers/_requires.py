"""What the transformers integration needs, checked before anything imports it: a
missing torch or transformers is named, with the extra that installs it (a bare
``ModuleNotFoundError`` from deep inside said neither what nor how)."""

from __future__ import annotations

import importlib.util

__all__: list[str] = []

_MISSING = [name for name in ("torch", "transformers") if importlib.util.find_spec(name) is None]
if _MISSING:
    raise ModuleNotFoundError(
        f"linattn.integrations.transformers needs {' and '.join(_MISSING)}: pip install "
        "'linattn[transformers]' (install the CPU build of torch first where there is no "
        "NVIDIA GPU: README.md)",
        name=_MISSING[0],
    )
