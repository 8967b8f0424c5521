"""Sphinx configuration: MyST pages, numpydoc docstrings, furo, every example a doctest.

The build is nitpicky: every cross-reference must resolve.  Intersphinx is not used (the
build must work offline): names of other projects stay plain text (see
``numpydoc_xref_aliases``), and docstrings link only to linattn's own objects.
"""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Any

from numpydoc.xref import DEFAULT_LINKS

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

templates_path = ["_templates"]  # autosummary/class.rst: every public member, listed
autosummary_generate = True
autodoc_typehints = "none"
autodoc_member_order = "groupwise"
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False

nitpicky = True
# Parameter types link to linattn's classes; every other word of a numpydoc type
# ("array, shape (..., L, d)", "int, optional") stays plain text.  numpydoc's own
# aliases point at Python's and NumPy's intersphinx inventories, which this offline
# build does not load, so they are mapped to plain text too.
numpydoc_xref_param_type = True
numpydoc_xref_ignore = "all"
numpydoc_xref_aliases = {word: word for word in DEFAULT_LINKS} | {
    name: f"linattn.{name}" for name in ("FeatureMap", "LinearAttentionState")
}
# Private modules (``linattn._checks``, ``linattn_numba._cuda``, ...) have no pages: a
# docstring may name their objects, but those names stay plain text.
nitpick_ignore_regex = [(r"py:.*", r"linattn(_numba)?\._\w+(\..*)?")]

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


def _resolve_reexported(app: Any, env: Any, node: Any, contnode: Any) -> Any:
    """Resolve ``linattn.<module>.<name>`` to the documented ``linattn.<name>``.

    Docstrings may cite a public name by the module that defines it (for example
    ``linattn.state.combine``); the reference documents it where users import it.
    """
    if node.get("refdomain") != "py":
        return None
    target = node.get("reftarget", "")
    parts = target.split(".")
    if len(parts) < 3 or parts[0] != "linattn":
        return None
    if parts[2] not in linattn.__all__:
        return None
    public = "linattn." + ".".join(parts[2:])
    return env.get_domain("py").resolve_xref(
        env, node["refdoc"], app.builder, node["reftype"], public, node, contnode
    )


def _describe_attribute(
    app: Any, what: str, name: str, obj: Any, options: Any, lines: list[str]
) -> None:
    """Give an attribute without its own docstring the description its class gives it.

    Frozen value objects (``FeatureMap``, ``LinearAttentionState``) describe their
    fields in the class docstring, under Attributes or (stored constructor arguments)
    Parameters; the attribute's own entry repeats that description.  Sphinx fires no
    event for an instance attribute without any docstring (a dataclass field without
    slots): such a field needs a ``#:`` comment, which autodoc reads and this keeps.
    """
    if what != "attribute" or any(line.strip() for line in lines):
        return
    owner_name, _, attribute = name.rpartition(".")
    module_name, _, class_name = owner_name.rpartition(".")
    try:
        owner = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError):
        return
    from numpydoc.docscrape import NumpyDocString

    doc = NumpyDocString(inspect.getdoc(owner) or "")
    for section in ("Attributes", "Parameters"):
        for parameter in doc[section]:
            names = [n.strip() for n in parameter.name.split(",")]
            if attribute in names and parameter.desc:
                lines[:] = list(parameter.desc)
                return


def setup(app: Any) -> None:
    app.connect("source-read", _document_every_public_name)
    app.connect("missing-reference", _resolve_reexported)
    # Before numpydoc (priority 500), which then formats the borrowed text.
    app.connect("autodoc-process-docstring", _describe_attribute, priority=400)
