"""Sphinx configuration: MyST pages, numpydoc docstrings, furo, every example a doctest."""

from __future__ import annotations

import re
from typing import Any

import linattn

project = "linattn"
author = "The linattn developers"
copyright = "The linattn developers"
release = version = linattn.__version__

extensions = [
    "myst_parser",
    "numpydoc",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.doctest",
    "sphinx.ext.mathjax",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "README.md"]
myst_enable_extensions = ["dollarmath", "colon_fence", "deflist"]
myst_heading_anchors = 3

autosummary_generate = True
autodoc_typehints = "none"
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False

html_theme = "furo"
html_title = f"linattn {release}"
html_static_path = ["_static"]

# Docstring examples run under `pytest --doctest-modules linattn`; the doctest
# builder runs the {doctest} blocks of these pages.
doctest_test_doctest_blocks = ""
doctest_global_setup = """
import importlib.util
import numpy as np
import linattn as la

def _gpu_cupy():
    if importlib.util.find_spec("cupy") is None:
        return False
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False

has_torch = importlib.util.find_spec("torch") is not None
has_jax = importlib.util.find_spec("jax") is not None
has_cupy_gpu = _gpu_cupy()
"""


def _document_every_public_name(app: Any, docname: str, source: list[str]) -> None:
    """Append any name of ``linattn.__all__`` that the API page does not list yet."""
    if docname != "api":
        return
    listed = set(re.findall(r"^\s+(\w+)\s*$", source[0], flags=re.MULTILINE))
    missing = [name for name in linattn.__all__ if name not in listed]
    if missing:
        lines = "\n".join(f"   {name}" for name in missing)
        source[0] += (
            "\n## Other public names\n\n```{eval-rst}\n.. currentmodule:: linattn\n\n"
            f".. autosummary::\n   :toctree: api/generated\n\n{lines}\n```\n"
        )


def setup(app: Any) -> None:
    app.connect("source-read", _document_every_public_name)
