"""What every pass of the kernels' bridge shares: the backends, whether numba is
installed, which array library an array belongs to, and the fused maps' operands."""

from __future__ import annotations

import contextlib
import importlib.util
import os
from pathlib import Path
from typing import Any, Literal

from linattn._xp import Array
from linattn.features import FeatureMap

__all__ = [
    "BACKENDS",
    "ENVIRONMENT_VARIABLE",
    "NUMBA_INSTALLED",
    "Backend",
    "broadcast_batch",
    "cache_directory",
    "empty_shift",
    "fitted_kernel_arrays",
    "fused_map",
    "fused_map_arrays",
    "installed",
    "kernel_sources",
    "library_of",
    "numpy_kernels_why_not",
    "resolve_backend",
    "single_threaded_blas",
    "torch_projection",
    "zeros_state",
]


#: Who may run causal attention: the argument ``backend=`` of every front-door function.
Backend = Literal["auto", "numba", "array_api"]


BACKENDS: tuple[Backend, ...] = ("auto", "numba", "array_api")


ENVIRONMENT_VARIABLE = "LINATTN_BACKEND"


#: Found without importing it (importing numba is slow): where it is missing, no call tries
#: ``import linattn_numba``, which torch.compile would record as a graph break.
def installed(name: str) -> bool:
    """Whether ``name`` can be found; an import hook that refuses it counts as missing."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


NUMBA_INSTALLED = installed("numba")


def resolve_backend(backend: object) -> Backend:
    """The backend asked for: the argument, else ``$LINATTN_BACKEND``, else ``"auto"``."""
    chosen = backend if backend is not None else os.environ.get(ENVIRONMENT_VARIABLE, "auto")
    if chosen not in BACKENDS:
        source = "backend" if backend is not None else f"${ENVIRONMENT_VARIABLE}"
        raise ValueError(f"{source} must be one of {BACKENDS}; got {chosen!r}")
    return chosen


def library_of(x: Array) -> str:
    """The top-level module of ``x``'s type: ``"numpy"``, ``"torch"``, ``"cupy"``..."""
    return type(x).__module__.split(".")[0]


def numpy_kernels_why_not(backend: Backend) -> str | None:
    """Why the compiled kernels NumPy arrays get (the hybrid and window passes) cannot
    run a call whose resolved backend is ``backend``, or ``None``.

    Examples
    --------
    >>> numpy_kernels_why_not("array_api")
    "backend='array_api'"
    """
    if backend == "array_api":
        return "backend='array_api'"
    if not NUMBA_INSTALLED:  # a constant: no failing import inside a compiled region
        return "numba is not installed; install linattn[numba]"
    try:
        from linattn_numba.cpu import hybrid as _hybrid  # noqa: F401
    except ImportError as error:
        return f"linattn_numba cannot be imported ({error}); install linattn[numba]"
    return None


def cache_directory() -> Path | None:
    """The CPU kernels' compile cache directory (``None``: off, or no kernels)."""
    if numpy_kernels_why_not("auto") is not None:
        return None
    import linattn_numba

    return linattn_numba.cache_directory()


def single_threaded_blas() -> contextlib.AbstractContextManager[None]:
    """BLAS on one thread while the block runs (every BLAS the process has loaded,
    NumPy's included), as while a kernel runs: beside a compiling process a
    multi-threaded BLAS waits on its busy core (0.15 s became 5 s for the README's
    NumPy call on the array API, 2 cores, one busy)."""
    if cache_directory() is None:  # (no kernels: nothing compiles in the background)
        return contextlib.nullcontext()
    import linattn_numba

    return linattn_numba.single_threaded_blas()


def kernel_sources() -> list[Path]:
    """The source files of the CPU kernels (what their compiled code depends on)."""
    spec = importlib.util.find_spec("linattn_numba")
    if spec is None or spec.origin is None:
        return []
    return sorted(Path(spec.origin).parent.rglob("*.py"))


def fused_map(feature_map: FeatureMap | None) -> bool:
    """The fused CPU kernels compute this map's features: the kinds that say so,
    unrebalanced (also the test of the decoding path, :mod:`linattn._decode`, and of the
    fused bidirectional pass)."""
    return (
        feature_map is not None
        and feature_map.spec.fused
        and feature_map.rebalance_scales is None
        and feature_map.projection is not None
    )


def fused_map_arrays(feature_map: FeatureMap) -> tuple[Any, bool]:
    assert feature_map.projection is not None
    return feature_map.projection, feature_map.kind == "hyperbolic"


def broadcast_batch(q: Any, k: Any, v: Any, key_mask: Any, *more: Any) -> tuple[int, ...]:
    import numpy as np

    shapes = [q.shape[:-2], k.shape[:-2], v.shape[:-2], *more]
    shapes += [] if key_mask is None else [key_mask.shape[:-1]]
    return tuple(np.broadcast_shapes(*shapes))


def torch_projection(projection: Any, dtype: Any) -> Any:
    """The map's projection as a torch tensor of ``dtype``: a copy (the map's array is
    read-only), except while compiling, where Dynamo already holds it as a (fake) tensor
    and ``torch.tensor`` of a tensor warns."""
    import torch

    if torch.compiler.is_compiling():
        return torch.as_tensor(projection, dtype=dtype)
    return torch.tensor(projection, dtype=dtype)


def zeros_state(batch: tuple[int, ...], m: int, dv: int, dtype: Any) -> Any:
    import numpy as np

    return np.broadcast_to(np.zeros((), dtype), (*batch, m, dv + 1))  # (no memory)


def empty_shift(batch: tuple[int, ...], m: int, dtype: Any) -> Any:
    import numpy as np

    return np.broadcast_to(np.full((), -np.inf, dtype), (*batch, m))


def fitted_kernel_arrays(
    feature_map: FeatureMap, shape: tuple[int, ...], dtype: Any
) -> tuple[Any, dict[str, Any]]:
    """A fitted map as the fused passes take it, for NumPy inputs of ``shape`` ``(*batch,
    L, d)``: an empty ``(0, d)`` projection and the parameters broadcast to ``batch``
    (:func:`linattn.fitted.kernel_parameters`) in ``dtype``."""
    import numpy as np

    from linattn import fitted

    assert feature_map.parameters is not None
    arrays = fitted.kernel_parameters(feature_map.parameters, shape)
    params = {name: np.asarray(x, dtype=dtype) for name, x in arrays.items()}
    return np.zeros((0, shape[-1]), dtype), params
