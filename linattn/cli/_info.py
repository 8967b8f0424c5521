"""``linattn info``: versions, array backends, compiled kernels, and why one cannot run.

Works with the base install (NumPy and array-api-compat): no rich, matplotlib or
numba needed, and each missing piece comes with the extra that installs it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
from pathlib import Path

import linattn as la
from linattn import _dispatch, _warm
from linattn.cli import _backends
from linattn.cli._backends import ARRAY_LIBRARIES, BackendUnavailable
from linattn.cli._commands import causal_path
from linattn.cli._console import Console
from linattn.cli._machine import import_optional, machine_info, package_version
from linattn.cli._plans import call_plans
from linattn.cli._report import compact_table, json_text, key_value_table

__all__ = ["info"]

PACKAGES = (
    "linattn",
    "numpy",
    "array-api-compat",
    "numba",
    "numba-cuda",
    "threadpoolctl",
    "torch",
    "jax",
    "jaxlib",
    "cupy",
    "dask",
    "distributed",
    "array-api-strict",
    "rich",
    "matplotlib",
    "psutil",
)

#: The extra that brings each optional package (pyproject's optional-dependencies).
EXTRAS = {
    "numba": "numba",
    "numba-cuda": "cuda",
    "threadpoolctl": "numba",
    "dask": "dask",
    "distributed": "dask",
    "array-api-strict": "test",
    "rich": "cli",
    "matplotlib": "cli",
    "psutil": "cli",
}


def _cupy_version() -> str | None:
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name == "cupy" or name.startswith("cupy-cuda"):
            return f"{dist.version} ({name})"
    return None


def _version(name: str) -> str:
    found = _cupy_version() if name == "cupy" else package_version(name)
    if found is not None:
        return found
    extra = EXTRAS.get(name)
    return f"not installed (pip install linattn[{extra}])" if extra else "not installed"


def _backend_report() -> list[dict[str, str]]:
    """For each array library: installed?, devices, and who runs causal attention."""
    rows = []
    for name in ARRAY_LIBRARIES:
        row = {"backend": name}
        try:
            library = _backends.load_library(name, "float32")
        except BackendUnavailable as error:
            row.update(available="no", device="", causal=str(error))
        except Exception as error:  # a broken install must not break `info`
            row.update(available="no", device="", causal=f"{type(error).__name__}: {error}")
        else:
            row.update(
                available="yes", device=library.device, causal=_hinted(causal_path(library))
            )
        rows.append(row)
    return rows


def _plan_report() -> dict[str, str]:
    """For each typical call on NumPy arrays: the plan in words (``linattn.plan_attention``)."""
    library = _backends.load_library("numpy", "float32")
    return {name: str(plan) for name, plan in call_plans(library).items()}


def _hinted(status: str) -> str:
    """A kernel status, with the extra to install when numba itself is missing."""
    if import_optional("numba") is not None or "linattn[numba]" in status:
        return status
    return f"{status}; install linattn[numba]"


def _kernel_report() -> dict[str, str]:
    kernels = _dispatch.kernel_status()
    if import_optional("numba") is None:
        kernels["numba-cpu"] = "unavailable: numba is not installed; install linattn[numba]"
        kernels["numba-cuda"] = "unavailable: numba is not installed; install linattn[cuda]"
        return kernels
    return kernels


def _numba_threads() -> str:
    numba = import_optional("numba")
    if numba is None:
        return "numba not installed"
    return str(numba.config.NUMBA_NUM_THREADS)


def _compile_mode() -> str:
    """Where kernels that are not compiled yet compile (:mod:`linattn._warm`)."""
    try:
        mode = _warm.mode()
    except ValueError as error:
        return str(error)
    if mode == "background":
        return "background (NumPy calls run portable while their kernels compile apart)"
    return "foreground (the first call of a kernel compiles it)"


def info(args: argparse.Namespace) -> int:
    """``linattn info``: print what is installed and what can run here."""
    versions = {name: _version(name) for name in PACKAGES}
    versions["linattn"] = f"{la.__version__} ({Path(la.__file__).parent})"
    backends = _backend_report()
    kernels = _kernel_report()
    settings = {
        "$LINATTN_BACKEND": os.environ.get(_dispatch.ENVIRONMENT_VARIABLE, "(unset: auto)"),
        "numba threads": _numba_threads(),
        "$LINATTN_COMPILE": _compile_mode(),
    }
    machine = machine_info()
    plans = _plan_report()
    payload = {
        "versions": versions,
        "backends": backends,
        "kernels": kernels,
        "plans": plans,
        "settings": settings,
        "machine": machine,
    }
    if args.format == "json":
        print(json_text(payload), end="")
        return 0
    console = Console()
    console.print(key_value_table("Packages", versions))
    table = compact_table("Array backends")
    for column in ("backend", "available", "device", "causal linear attention runs on"):
        table.add_column(column)
    for row in backends:
        table.add_row(row["backend"], row["available"], row["device"], row["causal"])
    console.print(table)
    console.print(key_value_table("Compiled kernels", kernels))
    console.print(key_value_table("Plans (NumPy float32: executor, reason, not chosen)", plans))
    console.print(key_value_table("Settings", settings))
    console.print(key_value_table("Machine", machine))
    return 0
