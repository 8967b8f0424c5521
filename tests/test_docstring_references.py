"""Every Sphinx cross reference in the docstrings of ``linattn`` and ``linattn_numba``
names something that exists.

The docstrings (of modules, classes and functions) are read from the source with
:mod:`ast`.  In each, a reference ``:role:`target``` (``mod``, ``func``, ``class``,
``meth``, ``attr``, ``data``, ``exc``, ``obj``, ``const``; ``~``, a ``title <target>`` and
a trailing ``()`` allowed) is resolved as Sphinx would look for it:

* a target under ``linattn`` or ``linattn_numba``: the longest importable module prefix
  is imported, the rest looked up with ``getattr`` (an ``:attr:`` may also be an
  annotated, dataclass or ``self.name =`` attribute of its class);
* any other target is relative: its first name is looked up in the enclosing classes
  (innermost first), the module's globals and the builtins, the rest with ``getattr``.
  A dotted target whose first name is another library (``torch.nn.Module``,
  ``argparse.ArgumentTypeError``), and a ``:mod:`` of another library, are not checked.

To stay fast, a target is first looked for in the source (the names the modules and
classes bind, imports followed; nothing under ``if TYPE_CHECKING``); only what the source
does not show is looked up in the imported modules, so that torch, jax or transformers
are imported only for a reference into them that the source cannot settle.

A target whose module cannot be imported because an optional library (torch, jax,
transformers, numba, numba-cuda, ...) is missing is skipped, as is anything of
``linattn_numba.gpu`` when ``numba.cuda`` cannot be imported.  The unresolved references
are reported together, one ``path:line: role target (why)`` a line.
"""

from __future__ import annotations

import ast
import builtins
import functools
import importlib
import importlib.util
import inspect
import re
import sys
import textwrap
import types
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("linattn", "linattn_numba")

#: The libraries a module of the packages may need that an installation may lack.
OPTIONAL = frozenset(
    {
        "torch",
        "jax",
        "jaxlib",
        "flax",
        "transformers",
        "dask",
        "distributed",
        "numba",
        "numba_cuda",
        "cupy",
        "safetensors",
        "tokenizers",
        "rich",
        "matplotlib",
        "psutil",
        "scipy",
        "threadpoolctl",
    }
)

#: ``:role:`text``` and ``:py:role:`text``` (the text may wrap onto the next line).
REFERENCE = re.compile(
    r"(?<![\w:`]):(?:py:)?(mod|func|class|meth|attr|data|exc|obj|const):`([^`]+)`"
)


@dataclass(frozen=True)
class Reference:
    path: str  # relative to the repository, with / separators
    line: int
    module: str  # the dotted name of the module whose docstring it is in
    classes: tuple[str, ...]  # the classes around the docstring, outermost first
    role: str
    text: str  # as written between the backticks

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: :{self.role}:`{self.text}`"


class Skip(Exception):
    """The reference cannot be checked here (an optional library is missing)."""


class Unresolved(Exception):
    """The reference names nothing."""


# -- reading the docstrings -------------------------------------------------------------


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _source_files() -> list[Path]:
    return [path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))]


def references_in(source: str, path: str, module: str) -> list[Reference]:
    """The references in the docstrings of one module's source."""
    found: list[Reference] = []

    def visit(node: ast.AST, scope: tuple[tuple[str, bool], ...]) -> None:
        # scope: the definitions around ``node``, outermost first, as (name, is a class)
        inside = scope
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            inside = (*scope, (node.name, isinstance(node, ast.ClassDef)))
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            docstring = ast.get_docstring(node, clean=False)
            if docstring is not None:
                # the docstring's own line: the references' lines count on from it
                first_line = node.body[0].lineno
                classes = []  # the classes reachable from the module by getattr
                for name, is_class in inside:
                    if not is_class:
                        break
                    classes.append(name)
                for match in REFERENCE.finditer(docstring):
                    line = first_line + docstring.count("\n", 0, match.start())
                    text = " ".join(match.group(2).split())
                    found.append(
                        Reference(path, line, module, tuple(classes), match.group(1), text)
                    )
        for child in ast.iter_child_nodes(node):
            visit(child, inside)

    visit(ast.parse(source, filename=path), ())
    return found


def all_references() -> list[Reference]:
    found = []
    for path in _source_files():
        relative = path.relative_to(ROOT).as_posix()
        found += references_in(path.read_text(encoding="utf-8"), relative, _module_name(path))
    return found


def target_of(text: str) -> str | None:
    """The name a reference's text points at (None: a ``!`` reference, not a link)."""
    titled = re.fullmatch(r".*?<(.+)>", text)
    target = titled.group(1).strip() if titled else text
    if target.startswith("!"):
        return None
    return target.lstrip("~.").removesuffix("()")


# -- importing ---------------------------------------------------------------------------


def _missing_library(error: BaseException) -> str | None:
    """The optional library whose absence made an import fail, if that is why."""
    seen: BaseException | None = error
    while seen is not None:
        name = getattr(seen, "name", None) if isinstance(seen, ImportError) else None
        if name and name.split(".")[0] in OPTIONAL:
            return name
        seen = seen.__cause__ or seen.__context__
    return None


@functools.cache
def _imported(name: str) -> types.ModuleType | BaseException:
    if name.split(".")[-1] == "__main__":  # importing it would run the command line
        return Skip(f"{name} is not imported (it runs the command line)")
    if name.startswith("linattn_numba.gpu") and not _cuda_imports():
        return Skip("numba.cuda cannot be imported")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return importlib.import_module(name)
    except ImportError as error:
        missing = _missing_library(error)
        if missing is not None:
            return Skip(f"importing {name} needs {missing}")
        return Unresolved(f"importing {name} failed: {error!r}")
    except Exception as error:  # a syntax error, an error at import time
        return Unresolved(f"importing {name} failed: {error!r}")


def _import(name: str) -> types.ModuleType:
    module = _imported(name)
    if isinstance(module, BaseException):
        raise module
    return module


@functools.cache
def _cuda_imports() -> bool:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            importlib.import_module("numba.cuda")
    except Exception:
        return False
    return True


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _is_other_library(name: str) -> bool:
    """Whether ``name`` is a top-level module of another library (or the standard one)."""
    return name not in PACKAGES and (
        name in OPTIONAL or name in sys.stdlib_module_names or _is_module(name)
    )


# -- resolving from the source ----------------------------------------------------------
# Most references are found in the source alone, which saves importing torch, jax and
# transformers; what is not found there is looked up in the imported modules.


def _module_file(name: str) -> Path | None:
    if name.split(".")[0] not in PACKAGES:
        return None
    base = ROOT.joinpath(*name.split("."))
    for path in (base / "__init__.py", base.with_suffix(".py")):
        if path.is_file():
            return path
    return None


def _absolute_module(module: str, node: ast.ImportFrom) -> str:
    """The module an ``ImportFrom`` names, relative imports resolved."""
    if not node.level:
        return node.module or ""
    path = _module_file(module)
    package = module.split(".")
    package = package if path is not None and path.name == "__init__.py" else package[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _targets(target: ast.expr) -> list[str]:
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, ast.Tuple | ast.List):
        return [name for element in target.elts for name in _targets(element)]
    return []


#: What a name is bound to: a class or function definition, ``("value",)`` (an
#: assignment), ``("annotation",)`` (no value), ``("instance",)`` (a ``self.name =``),
#: ``("module", name)`` or ``("from", module, name)``.
Binding = ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef | tuple[str, ...]


def _bind(module: str, body: list[ast.stmt], names: dict[str, Binding]) -> None:
    """The names the statements bind when they run (not those under ``TYPE_CHECKING``)."""
    for node in body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                names.update(dict.fromkeys(_targets(target), ("value",)))
        elif isinstance(node, ast.AnnAssign):
            for name in _targets(node.target):
                if node.value is not None:
                    names[name] = ("value",)
                else:
                    names.setdefault(name, ("annotation",))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = ("module", alias.name)
                else:
                    first = alias.name.split(".")[0]
                    names[first] = ("module", first)
        elif isinstance(node, ast.ImportFrom):
            source = _absolute_module(module, node)
            for alias in node.names:
                if alias.name != "*":
                    names[alias.asname or alias.name] = ("from", source, alias.name)
        elif isinstance(node, ast.Delete):
            for target in node.targets:
                for name in _targets(target):
                    names.pop(name, None)
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                _bind(module, node.body, names)
            _bind(module, node.orelse, names)
        elif isinstance(node, ast.Try | ast.TryStar):
            for block in (node.body, *(h.body for h in node.handlers), node.orelse):
                _bind(module, block, names)
            _bind(module, node.finalbody, names)
        elif isinstance(node, ast.With | ast.For | ast.While):
            _bind(module, node.body, names)


@functools.cache
def _module_names(module: str) -> dict[str, Binding]:
    path = _module_file(module)
    if path is None:
        return {}
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except SyntaxError:  # half written: importing it reports it
        return {}
    names: dict[str, Binding] = {}
    _bind(module, tree.body, names)
    return names


@functools.cache
def _class_names(node: ast.ClassDef, module: str) -> dict[str, Binding]:
    names: dict[str, Binding] = {}
    for method in node.body:  # the ``self.name = ...`` of its methods
        if isinstance(method, ast.FunctionDef | ast.AsyncFunctionDef) and method.args.args:
            self = method.args.args[0].arg
            for child in ast.walk(method):
                if (
                    isinstance(child, ast.Attribute)
                    and isinstance(child.ctx, ast.Store)
                    and isinstance(child.value, ast.Name)
                    and child.value.id == self
                ):
                    names[child.attr] = ("instance",)
    _bind(module, node.body, names)
    return names


def _static_member(
    binding: Binding, rest: list[str], role: str, module: str, depth: int = 0
) -> bool:
    """Whether ``rest`` is found, from the source, below what a name is bound to; False
    when the source does not tell.  Raises :class:`Skip` when it is in another library."""
    if depth > 20:
        return False
    if isinstance(binding, ast.ClassDef):
        if not rest:
            return True
        member = _class_names(binding, module).get(rest[0])
        if member is None:  # (inherited, perhaps)
            return False
        return _static_member(member, rest[1:], role, module, depth + 1)
    if isinstance(binding, ast.FunctionDef | ast.AsyncFunctionDef):
        return not rest
    if binding[0] in ("annotation", "instance"):
        return not rest and role in ("attr", "data", "obj")
    if binding[0] == "module":
        if binding[1].split(".")[0] not in PACKAGES:
            if rest:
                raise Skip(f"{binding[1]} is another library")
            return True
        return _static_in(binding[1], rest, role, depth + 1)
    if binding[0] == "from":
        if binding[1].split(".")[0] not in PACKAGES:
            if rest:
                raise Skip(f"{binding[1]} is another library")
            return True
        return _static_in(binding[1], [binding[2], *rest], role, depth + 1)
    return not rest  # a value: its attributes are not in the source


def _static_in(module: str, names: list[str], role: str, depth: int = 0) -> bool:
    """Whether ``module.names`` is found from the source (False: it does not tell)."""
    if not names:
        return _module_file(module) is not None
    binding = _module_names(module).get(names[0])
    if binding is not None:
        return _static_member(binding, names[1:], role, module, depth)
    submodule = f"{module}.{names[0]}"
    return _module_file(submodule) is not None and _static_in(submodule, names[1:], role, depth)


def _static_absolute(target: str, role: str) -> bool:
    parts = target.split(".")
    for known in range(len(parts), 0, -1):
        module = ".".join(parts[:known])
        if _module_file(module) is not None:
            return _static_in(module, parts[known:], role)
    return False


def _static_relative(reference: Reference, parts: list[str]) -> bool:
    scopes: list[ast.ClassDef] = []  # innermost first
    names = _module_names(reference.module)
    for name in reference.classes:
        node = names.get(name)
        if not isinstance(node, ast.ClassDef):
            break
        scopes.insert(0, node)
        names = _class_names(node, reference.module)
    for scope in scopes:
        if _static_member(scope, parts, reference.role, reference.module):
            return True
    if _static_in(reference.module, parts, reference.role):
        return True
    if parts[0] not in _module_names(reference.module):
        if hasattr(builtins, parts[0]):
            _follow(getattr(builtins, parts[0]), parts[1:], reference.role)
            return True
        if len(parts) > 1 and _is_other_library(parts[0]):
            raise Skip(f"{parts[0]} is another library")
    return False


# -- resolving in the imported modules ---------------------------------------------------


def _declared_attribute(cls: type, name: str) -> bool:
    """Whether instances of ``cls`` have an attribute ``name`` that the class itself lacks:
    an annotation, a dataclass field, a slot or a ``self.name = ...`` in its source."""
    for klass in inspect.getmro(cls):
        if name in vars(klass).get("__annotations__", {}):
            return True
        if name in getattr(klass, "__dataclass_fields__", {}):
            return True
        slots = vars(klass).get("__slots__", ())
        if name in ([slots] if isinstance(slots, str) else slots):
            return True
        if not klass.__module__.startswith(PACKAGES):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
                and node.attr == name
            ):
                return True
    return False


def _attribute(owner: Any, name: str, role: str, last: bool) -> Any:
    try:
        return getattr(owner, name)
    except AttributeError:
        pass
    attribute = last and role in ("attr", "data", "obj") and isinstance(owner, type)
    if attribute and _declared_attribute(owner, name):
        return None
    described = getattr(owner, "__qualname__", None) or getattr(owner, "__name__", owner)
    raise Unresolved(f"{described} has no attribute {name!r}")


def _follow(owner: Any, names: list[str], role: str) -> Any:
    for i, name in enumerate(names):
        if isinstance(owner, types.ModuleType) and not owner.__name__.startswith(PACKAGES):
            raise Skip(f"{owner.__name__} is another library")
        owner = _attribute(owner, name, role, last=i == len(names) - 1)
    return owner


def _resolve_absolute(target: str, role: str) -> None:
    parts = target.split(".")
    module, known = _import(parts[0]), 1
    # the longest importable prefix: go down the packages while the next name is a module
    while known < len(parts) and hasattr(module, "__path__"):
        name = ".".join(parts[: known + 1])
        if name.startswith("linattn_numba.gpu") and not _cuda_imports():
            raise Skip("numba.cuda cannot be imported")
        if not _is_module(name):
            break
        module, known = _import(name), known + 1
    _follow(module, parts[known:], role)


def _resolve_relative(reference: Reference, target: str) -> None:
    first, *rest = target.split(".")
    module = _import(reference.module)
    scopes: list[Any] = []  # innermost first
    owner: Any = module
    for name in reference.classes:
        owner = getattr(owner, name, None)
        if not isinstance(owner, type):
            break
        scopes.insert(0, owner)
    for scope in scopes:
        try:
            found = _attribute(scope, first, reference.role, last=not rest)
        except Unresolved:
            continue
        _follow(found, rest, reference.role)
        return
    for namespace in (vars(module), vars(builtins)):
        if first in namespace:
            _follow(namespace[first], rest, reference.role)
            return
    if rest and _is_other_library(first):
        raise Skip(f"{first} is another library")
    where = ".".join((reference.module, *reference.classes))
    raise Unresolved(f"{first!r} is not a name in {where}")


def resolve(reference: Reference) -> None:
    """Return if the reference resolves; raise :class:`Skip` or :class:`Unresolved`."""
    target = target_of(reference.text)
    if target is None:
        raise Skip("not a link")
    if target.split(".")[0] in PACKAGES:
        if not _static_absolute(target, reference.role):
            _resolve_absolute(target, reference.role)
    elif reference.role == "mod":  # a module's name is never relative
        raise Skip(f"{target} is another library")
    elif not _static_relative(reference, target.split(".")):
        if reference.path.startswith("linattn_numba/gpu/") and not _cuda_imports():
            raise Skip("numba.cuda cannot be imported")
        _resolve_relative(reference, target)


def unresolved(references: list[Reference]) -> list[str]:
    """``path:line: role target (why)`` for each reference that names nothing."""
    failures = []
    for reference in references:
        try:
            resolve(reference)
        except Skip:
            pass
        except Unresolved as error:
            failures.append(f"{reference} ({error})")
    return failures


# -- the tests ---------------------------------------------------------------------------


REFERENCES = all_references()


def test_references_are_found() -> None:
    assert len(REFERENCES) > 100
    assert any(r.text.lstrip("~").startswith("linattn.") for r in REFERENCES)
    assert any("." not in r.text for r in REFERENCES)


def test_docstring_references_resolve() -> None:
    failures = unresolved(REFERENCES)
    assert not failures, f"{len(failures)} unresolved references:\n" + "\n".join(failures)


@pytest.mark.parametrize(
    ("text", "target"),
    [
        ("linattn.causal", "linattn.causal"),
        ("~linattn.causal.favor_causal", "linattn.causal.favor_causal"),
        ("the plan <linattn._plan.EXECUTORS>", "linattn._plan.EXECUTORS"),
        ("merge()", "merge"),
        ("!merge", None),
    ],
)
def test_target_of(text: str, target: str | None) -> None:
    assert target_of(text) == target


def test_a_missing_target_is_reported() -> None:
    source = textwrap.dedent(
        '''
        """Module: :func:`linattn.does_not_exist`, :func:`linear_attention`, :mod:`numpy`."""


        class NoSuchClass:
            """:meth:`no_such_method` and :func:`~linattn.nowhere.at_all`."""

            def f(self):
                """:func:`no_such_helper`, :class:`torch.nn.Module`, :exc:`ValueError`.

                And :data:`linattn.KINDS`, :class:`the plan <linattn.AttentionPlan>`."""
        '''
    )
    references = references_in(source, "linattn/__init__.py", "linattn")
    assert [(r.line, r.role, r.classes) for r in references] == [
        (2, "func", ()),
        (2, "func", ()),
        (2, "mod", ()),
        (6, "meth", ("NoSuchClass",)),
        (6, "func", ("NoSuchClass",)),
        (9, "func", ("NoSuchClass",)),
        (9, "class", ("NoSuchClass",)),
        (9, "exc", ("NoSuchClass",)),
        (11, "data", ("NoSuchClass",)),
        (11, "class", ("NoSuchClass",)),
    ]
    failures = unresolved(references)
    assert [failure.split(" (")[0] for failure in failures] == [
        "linattn/__init__.py:2: :func:`linattn.does_not_exist`",
        "linattn/__init__.py:6: :meth:`no_such_method`",
        "linattn/__init__.py:6: :func:`~linattn.nowhere.at_all`",
        "linattn/__init__.py:9: :func:`no_such_helper`",
    ]
