"""Backends for the cross-backend suite, chosen by ``$LINATTN_TEST_BACKENDS``.

References are computed once in NumPy float64; each backend then gets the same
inputs through :meth:`Backend.asarray` and its results are checked with
:func:`assert_close`, which also checks namespace, device, dtype and shape.

``LINATTN_TEST_BACKENDS`` is a comma-separated list of names from ``BACKENDS``
(default: every backend whose library is installed).

A test marked ``sweep`` is a parametrized grid: by default only the fewest cells that
cover every value of each swept parameter run (per value of the others, such as the
backend); the other cells are marked ``exhaustive`` and run only with
``LINATTN_TEST_EXHAUSTIVE=1`` (the ``exhaustive`` nox session, ``-m exhaustive``).
"""

from __future__ import annotations

import os

# Kernels compile in the call, never in the background (linattn._warm): the tests assert
# or time which path runs a call, which must not depend on what a cache holds.
os.environ["LINATTN_COMPILE"] = "foreground"

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import array_api_compat
import numpy as np
import pytest

from linattn import _libraries as libraries

#: Set to 1 to run every cell of the sweeps (see the module's docstring).
EXHAUSTIVE_VARIABLE = "LINATTN_TEST_EXHAUSTIVE"


@dataclass
class Backend:
    """One array library (and device) the suite runs on."""

    name: str
    module: str
    make: Callable[[np.ndarray], Any]
    device: Any = None
    marks: list[Any] = field(default_factory=list)

    @property
    def xp(self) -> Any:
        return array_api_compat.array_namespace(self.asarray(np.zeros(1)))

    def asarray(self, x: np.ndarray | Any, dtype: str | None = None) -> Any:
        """The backend's copy of a NumPy array, optionally cast to ``dtype`` (a name)."""
        x = np.asarray(x)
        if dtype is not None and dtype not in ("bfloat16",):
            x = x.astype(dtype)
        out = self.make(x)
        if dtype == "bfloat16":
            xp = array_api_compat.array_namespace(out)
            out = xp.astype(out, xp.bfloat16)
        return out

    def to_numpy(self, x: Any) -> np.ndarray:
        from linattn._xp import to_host

        if hasattr(x, "dtype") and "bfloat16" in str(x.dtype):
            xp = array_api_compat.array_namespace(x)
            x = xp.astype(x, xp.float32)
        return np.asarray(to_host(x), dtype=np.float64)


def _readonly(x: np.ndarray) -> np.ndarray:
    y = libraries.from_host("numpy", x)
    y.setflags(write=False)
    return y


def _adapter(name: str) -> Callable[[np.ndarray], Any]:
    return functools.partial(libraries.from_host, name)


BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in [
        Backend("numpy", "numpy", _adapter("numpy")),
        Backend("numpy_readonly", "numpy", _readonly),
        Backend("array_api_strict", "array_api_strict", _adapter("array_api_strict")),
        Backend("torch", "torch", _adapter("torch")),
        Backend("jax", "jax", _adapter("jax")),
        Backend("dask", "dask", _adapter("dask")),
        Backend("cupy", "cupy", _adapter("cupy")),
    ]
}


def _installed(module: str) -> bool:
    return libraries.installed(module)


def _cupy_usable() -> bool:
    return libraries.unusable_reason("cupy") is None


def selected_backends() -> list[str]:
    raw = os.environ.get("LINATTN_TEST_BACKENDS", "")
    if raw.strip():
        names = [n.strip() for n in raw.split(",") if n.strip()]
        unknown = [n for n in names if n not in BACKENDS]
        if unknown:
            raise pytest.UsageError(
                f"LINATTN_TEST_BACKENDS names unknown backends {unknown}; "
                f"known: {sorted(BACKENDS)}"
            )
        return names
    return [n for n, b in BACKENDS.items() if _installed(b.module) and n != "cupy"] + (
        ["cupy"] if _cupy_usable() else []
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "needs(backend): run only when that backend is selected (default: tests that do not "
        "take the backend fixture run with the numpy backend only)",
    )
    config.addinivalue_line(
        "markers",
        "sweep(*names): a grid over the parameters ``names`` (default: every parameter but "
        "the backend); cells beyond those that cover each value are marked exhaustive",
    )
    if _installed("jax"):
        import jax

        jax.config.update("jax_enable_x64", True)
        jax.config.update("jax_platforms", "cpu")


def pytest_report_header(config: pytest.Config) -> str:
    return f"linattn backends: {', '.join(selected_backends())}"


@pytest.fixture(params=selected_backends())
def backend(request: pytest.FixtureRequest) -> Backend:
    """Every selected backend in turn."""
    b = BACKENDS[request.param]
    if b.name == "cupy" and not _cupy_usable():
        pytest.skip("cupy needs a CUDA GPU")
    pytest.importorskip(b.module)
    return b


def assert_close(
    backend: Backend,
    actual: Any,
    expected: np.ndarray,
    *,
    rtol: float,
    atol: float = 0.0,
    dtype: str | None = None,
) -> None:
    """``actual`` has the backend's type, device and ``dtype``, and is close to ``expected``."""
    like = backend.asarray(np.zeros(1), dtype=dtype)
    assert type(actual) is type(like), f"expected {type(like)}, got {type(actual)}"
    assert array_api_compat.device(actual) == array_api_compat.device(like)
    if dtype is not None:
        assert actual.dtype == like.dtype, f"dtype {actual.dtype} != {like.dtype}"
    assert tuple(actual.shape) == tuple(expected.shape)
    np.testing.assert_allclose(backend.to_numpy(actual), expected, rtol=rtol, atol=atol)


def exhaustive() -> bool:
    """Whether every cell of the sweeps runs (``LINATTN_TEST_EXHAUSTIVE=1``)."""
    return os.environ.get(EXHAUSTIVE_VARIABLE, "").strip().lower() in ("1", "true", "yes", "on")


def _mark_sweeps(items: list[pytest.Item]) -> None:
    """Mark ``exhaustive`` the cells of each ``sweep`` that the default run leaves out.

    Per test and per value of the parameters not swept, the cells kept are chosen greedily,
    each bringing the most values not yet covered (on ties, the values kept least often so
    far, then the first in collection order), until every value of every swept parameter
    is covered: every dtype, kind, chunk or case still runs by default, in fewer
    combinations.
    """
    groups: dict[tuple[str, str], list[tuple[pytest.Item, set[tuple[str, str]]]]] = {}
    for item in items:
        marker = item.get_closest_marker("sweep")
        callspec = getattr(item, "callspec", None)
        if marker is None or callspec is None:
            continue
        names = marker.args or tuple(name for name in callspec.params if name != "backend")
        unknown = set(names) - set(callspec.params)
        if unknown:
            raise pytest.UsageError(f"{item.nodeid}: sweep names unknown parameters {unknown}")
        swept = {(name, repr(callspec.params[name])) for name in names}
        rest = repr(sorted((k, repr(v)) for k, v in callspec.params.items() if k not in names))
        groups.setdefault((item.nodeid.split("[")[0], rest), []).append((item, swept))
    for cells in groups.values():
        uncovered = set().union(*(values for _, values in cells))
        kept: dict[tuple[str, str], int] = dict.fromkeys(uncovered, 0)
        left = list(cells)
        while uncovered:
            best = max(
                left,
                key=lambda cell: (len(cell[1] & uncovered), -sum(kept[v] for v in cell[1])),
            )
            uncovered -= best[1]
            for value in best[1]:
                kept[value] += 1
            left.remove(best)
        for item, _ in left:
            item.add_marker(pytest.mark.exhaustive)


@pytest.hookimpl(tryfirst=True)  # (before ``-m`` selects on the markers added here)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run backend-independent tests once, in the sessions that select NumPy.

    A test that takes the ``backend`` fixture runs on every selected backend; one marked
    ``needs(name)`` runs when ``name`` is selected; every other test runs when ``numpy``
    is selected, so the per-backend nox sessions do not repeat it.  Cells marked
    ``exhaustive`` run only with ``LINATTN_TEST_EXHAUSTIVE=1``.
    """
    _mark_sweeps(items)
    everything = exhaustive()
    selected = set(selected_backends())
    keep, drop = [], []
    for item in items:
        if not everything and item.get_closest_marker("exhaustive") is not None:
            drop.append(item)
            continue
        marker = item.get_closest_marker("needs")
        if marker is not None:
            wanted = marker.args[0]
        elif "backend" in getattr(item, "fixturenames", ()):
            wanted = None
        else:
            wanted = "numpy"
        (keep if wanted is None or wanted in selected else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def linear_attention_for(backend: Backend) -> Callable[..., Any]:
    """``la.linear_attention`` for a decoding loop: on JAX jitted (the state is a pytree,
    the map and the options static), so each shape compiles once as one program instead
    of op by op eagerly (several times faster on CPU); elsewhere the function itself."""
    import linattn as la

    if backend.name != "jax":
        return la.linear_attention
    import jax

    static = ("causal", "window", "sink_keys", "return_state", "chunk_size")
    return jax.jit(la.linear_attention, static_argnames=static)
