"""The layout's rules, read from the source: no private name crosses a module, and no
import cycle between modules (imports inside functions included).

The layers themselves are import-linter contracts (``pyproject.toml``, ``nox -s lint``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("linattn", "linattn_numba")


def _modules() -> dict[str, Path]:
    """Every module of both packages by dotted name (a package by its ``__init__``)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _absolute(module: str, node: ast.ImportFrom) -> str:
    """The module an ``ImportFrom`` names, relative imports resolved."""
    if not node.level:
        return node.module or ""
    is_package = MODULES[module].name == "__init__.py"
    base = module.split(".")[: len(module.split(".")) - node.level + is_package]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str) -> tuple[list[tuple[str, str, int]], dict[str, str]]:
    """``(from-imports as (module, name, line), {local name: imported module})``."""
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    names, aliases = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = _absolute(module, node)
            for alias in node.names:
                names.append((source, alias.name, node.lineno))
                if f"{source}.{alias.name}" in MODULES:
                    aliases[alias.asname or alias.name] = f"{source}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in MODULES and alias.asname:
                    aliases[alias.asname] = alias.name
                elif alias.name.split(".")[0] in MODULES:  # ``import a.b`` binds ``a``
                    aliases[alias.name.split(".")[0]] = alias.name.split(".")[0]
    return names, aliases


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_names_crossing(module: str) -> list[str]:
    """``from x import _name`` and ``x._name`` where ``x`` is another module of ours."""
    names, aliases = _imports(module)
    problems = [
        f"{module}:{line}: from {source} import {name}"
        for source, name, line in names
        if source in MODULES and source != module and _private(name)
        and f"{source}.{name}" not in MODULES  # a private module of its own package
    ]  # fmt: skip
    tree = ast.parse(MODULES[module].read_text())
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and _private(node.attr)
            and f"{aliases[node.value.id]}.{node.attr}" not in MODULES
        ):
            problems.append(f"{module}:{node.lineno}: {node.value.id}.{node.attr}")
    return problems


#: Private names of the standard library's own objects (named tuples) read anywhere.
STANDARD_PRIVATE = frozenset({"_replace", "_asdict", "_fields", "_make", "_field_defaults"})


def private_members() -> dict[str, set[str]]:
    """Module -> the private methods and attributes its classes define."""
    members: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            for item in ast.walk(node):
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    names.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(item.target.id)
                elif isinstance(item, ast.Attribute) and isinstance(item.ctx, ast.Store):
                    names.add(item.attr)
        members[module] = {name for name in names if _private(name)}
    return members


def private_members_crossing(module: str, members: dict[str, set[str]]) -> list[str]:
    """``obj._name`` where ``_name`` is a private member that only other modules' classes
    define (``self`` and ``cls`` aside): a sibling's object read from outside."""
    elsewhere = {n for m, names in members.items() if m != module for n in names}
    problems = []
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if (
            isinstance(node, ast.Attribute)
            and _private(node.attr)
            and node.attr in elsewhere
            and node.attr not in members[module] | STANDARD_PRIVATE
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
        ):
            problems.append(f"{module}:{node.lineno}: .{node.attr}")
    return problems


def test_no_private_member_of_another_modules_class_is_read() -> None:
    members = private_members()
    problems = [p for module in MODULES for p in private_members_crossing(module, members)]
    assert not problems, "private members read across modules:\n" + "\n".join(problems)


def test_no_private_name_crosses_a_module() -> None:
    problems = [p for module in MODULES for p in private_names_crossing(module)]
    assert not problems, "private names used across modules:\n" + "\n".join(problems)


def _graph() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports, anywhere in its body."""
    graph: dict[str, set[str]] = {}
    for module in MODULES:
        names, aliases = _imports(module)
        targets = {source for source, _, _ in names if source in MODULES}
        targets |= {f"{s}.{n}" for s, n, _ in names if f"{s}.{n}" in MODULES}
        targets |= set(aliases.values())
        tree = ast.parse(MODULES[module].read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names if alias.name in MODULES}
        # A package's __init__ importing its own submodules is not a cycle of siblings.
        graph[module] = {t for t in targets if t != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Cycles among modules, a package's own ``__init__`` left out (Tarjan's components)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def edges(module: str) -> set[str]:
        return {t for t in graph[module] if not t.startswith(module + ".")}

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in edges(module):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_no_import_cycles() -> None:
    graph = _graph()
    # Package __init__ modules re-export their children: edges into a package's
    # __init__ from its own children would be cycles of re-export only; none exist.
    assert cycles(graph) == []


def test_the_checks_can_fail() -> None:
    """The detectors find what they look for (on a made-up graph and a made-up source)."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]
    tree = ast.parse("from linattn import _dispatch\n_dispatch._library(1)\n")
    attribute = next(n for n in ast.walk(tree) if isinstance(n, ast.Attribute))
    assert _private(attribute.attr) and not _private("__version__")


@pytest.mark.parametrize("module", ["linattn.attention"])
def test_the_front_door_is_short(module: str) -> None:
    """``linear_attention`` normalises the call and hands it to the plan: at most 60
    lines of code after its docstring."""
    tree = ast.parse(MODULES[module].read_text())
    (function,) = [
        n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "linear_attention"
        and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value.value, str)
    ]  # fmt: skip
    code = ast.get_source_segment(MODULES[module].read_text(), function) or ""
    body_start = function.body[1].lineno - function.lineno
    lines = [
        line for line in code.splitlines()[body_start:]
        if line.strip() and not line.strip().startswith("#")
    ]  # fmt: skip
    assert 0 < len(lines) <= 60


def test_every_module_is_in_a_layer() -> None:
    """Every module of ``linattn`` and ``linattn_numba`` is named by a ``layers``
    contract of ``pyproject.toml``, or lies in a package that is (a package counts where
    its modules are named): none escapes the layers (the roots and ``__main__`` aside)."""
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    named: set[str] = set()
    for contract in contracts["contracts"]:
        if contract["type"] == "layers" and "containers" not in contract:
            for layer in contract["layers"]:
                named.update(part.strip() for part in layer.split("|"))

    def covered(module: str) -> bool:
        parts = module.split(".")
        ancestors = {".".join(parts[:n]) for n in range(2, len(parts) + 1)}
        is_package = MODULES[module].name == "__init__.py"
        return bool(ancestors & named) or (
            is_package and any(name.startswith(module + ".") for name in named)
        )

    missing = sorted(
        name
        for name in MODULES
        if name not in PACKAGES and not name.endswith("__main__") and not covered(name)
    )
    assert missing == [], f"modules in no layer of pyproject.toml: {missing}"
