"""The causal scan's path (one :class:`Plan`): compiled kernel, JAX scan, Dask graph or
the array API, decided per call from the arrays, the map and the call's resolved backend;
and attention on that path (:func:`attend`) with the compiled kernels' backward.

``backend="auto"`` (or the ``LINATTN_BACKEND`` environment variable) picks a compiled
Numba kernel when one can serve the arrays and the portable code otherwise;
``"numba"`` insists on the kernel, ``"array_api"`` on the portable code, which is the
batched chunk pass with the framework's own scan on JAX and the sequence-parallel
scan of :mod:`linattn.distributed` on Dask.  The plan names the path and says why;
:func:`linattn.plan_attention` shows it (its ``scan``), and so does ``linattn info``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from linattn import causal as causal_path
from linattn._checks import check_chunk_size
from linattn._dispatch.common import (
    ENVIRONMENT_VARIABLE,
    NUMBA_INSTALLED,
    Backend,
    fused_map,
    library_of,
    resolve_backend,
)
from linattn._xp import (
    Array,
    Namespace,
    array_namespace,
    float_dtype,
    is_array,
    is_dask_array,
    is_jax_array,
)
from linattn.features import FeatureMap

__all__ = [
    "CPU_FORWARD_CHUNK_SIZE",
    "DEFAULT_CHUNK_SIZE",
    "EAGER_CPU_TOKENS_PER_PASS",
    "PATHS",
    "CausalResult",
    "Operands",
    "Path",
    "Plan",
    "attend",
    "backward_follows",
    "causal_plan",
    "chunk_size_for",
    "fused_pass",
    "kernel_for",
    "kernel_status",
    "numpy_backward",
    "portable_plan",
    "scan_plan",
    "tokens_per_pass",
]


Path = Literal["numba-cpu", "numba-cuda", "jax-scan", "dask-scan", "array-api"]


#: The paths a plan can name (reported, not selectable).
PATHS: tuple[Path, ...] = ("numba-cpu", "numba-cuda", "jax-scan", "dask-scan", "array-api")


#: Tokens per pass of the batched chunk algorithm on eager CPU arrays (rounded up to one
#: chunk): one chunk per pass, each starting from the state the previous one ended
#: with, was the fastest measured (L = 16384, H = 8, m = 256, NumPy: 0.8 s for one
#: chunk, 1.2-1.4 s for 1024-16384 tokens, whose scans of chunk states cost more than
#: they save; ``benchmarks/test_causal_paths.py``).  GPUs and tracing frameworks take
#: one pass over the whole sequence.
EAGER_CPU_TOKENS_PER_PASS = 1


#: Tokens per chunk of the causal scan where a call leaves ``chunk_size`` to the path
#: (``chunk_size=None``): the portable scans, the CUDA kernels and every backward pass.
DEFAULT_CHUNK_SIZE = 64


#: ... and on the Numba CPU kernels' forward passes, whose intra-chunk products shrink
#: with the chunk while their state products do not: at L = 16384 (H = 8, d = 64,
#: m = 256, float32, two threads) chunk 32 took 0.86 x chunk 64's time for the fused
#: causal pass, 0.90 x for a bidirectional window and 0.93 x for a causal hybrid (L =
#: 1024-4096: 0.82-0.94; m = 64 at L = 1024: 1.03).  Their backward gains nothing (0.99
#: x at L = 16384, 1.04 x at 32768) and keeps twice the chunk states, so a call whose
#: torch inputs require gradients keeps :data:`DEFAULT_CHUNK_SIZE`.
CPU_FORWARD_CHUNK_SIZE = 32


CausalResult = tuple[Array, Array, Array]


@dataclass(frozen=True)
class Plan:
    """Who runs one causal attention call, and why.

    Attributes
    ----------
    path : str
        One of ``PATHS``: ``"numba-cpu"`` / ``"numba-cuda"`` (compiled kernels),
        ``"jax-scan"`` (batched chunks, ``jax.lax.scan``),
        ``"dask-scan"`` (:func:`linattn.distributed.dask_linear_attention`) or
        ``"array-api"`` (batched chunks, a log-depth scan in the array API).
    reason : str
        Why this path, in words (the backend asked for, what a kernel lacks).
    fused : bool
        The fused CPU pass computes features and attention in one go (no ``L x m``
        array): NumPy arrays and torch CPU tensors, positive or hyperbolic features, no
        rebalancing.
    tokens_per_pass : int or None
        The batched chunk pass runs over groups of about this many tokens (eager CPU
        arrays); ``None`` is one pass over the whole sequence.

    Examples
    --------
    >>> import numpy as np
    >>> import linattn as la
    >>> x, fm = np.zeros((4, 8)), la.FeatureMap(8, 16)
    >>> la.plan_attention(x, x, x, fm, causal=True, backend="array_api").scan.path
    'array-api'
    """

    path: Path
    reason: str
    fused: bool = False
    tokens_per_pass: int | None = None
    kernel: Callable[..., CausalResult] | None = None
    backward: Callable[..., Any] | None = None
    #: The backend the call asked for, resolved (:func:`resolve_backend`): every
    #: compiled part of the call (the window kernel, the one-pass hybrid passes) follows
    #: it, so the plan that names the path is the one that runs.
    backend: Backend = "auto"

    @property
    def compiled(self) -> bool:
        """True when a Numba kernel runs the causal scan."""
        return self.kernel is not None


def chunk_size_for(plan: Plan, chunk_size: object, *inputs: Array) -> int:
    """``chunk_size`` checked; ``None`` is the plan's own.

    That is :data:`CPU_FORWARD_CHUNK_SIZE` on the ``"numba-cpu"`` path unless a torch
    input requires gradients (with gradients enabled: a backward pass follows), else
    :data:`DEFAULT_CHUNK_SIZE`.

    Examples
    --------
    >>> import numpy as np
    >>> from linattn import _dispatch
    >>> plan = _dispatch.causal_plan(np.zeros((4, 8)), backend="array_api")
    >>> _dispatch.chunk_size_for(plan, None), _dispatch.chunk_size_for(plan, 16)
    (64, 16)
    """
    if chunk_size is not None:
        return check_chunk_size(chunk_size)
    if plan.path == "numba-cpu" and not backward_follows(inputs):
        return CPU_FORWARD_CHUNK_SIZE
    return DEFAULT_CHUNK_SIZE


def backward_follows(inputs: tuple[Array, ...]) -> bool:
    """Whether torch will differentiate through ``inputs`` (no other library records)."""
    if not any(getattr(x, "requires_grad", False) for x in inputs):
        return False
    import torch

    return bool(torch.is_grad_enabled())  # (Any where torch is not installed for mypy)


def causal_plan(
    x: Array, /, feature_map: FeatureMap | None = None, *, backend: Backend | None = None
) -> Plan:
    """The plan for causal attention on arrays like ``x`` (queries) with ``feature_map``.

    Parameters
    ----------
    x : array
        Queries (or any array of the same library and device).
    feature_map : FeatureMap, optional
        The map; decides whether the fused pass applies and whether the kernels can take
        its features (they take positive features only).
    backend : {"auto", "numba", "array_api"}, optional
        As for :func:`linattn.linear_attention`; ``"numba"`` raises where no kernel
        serves the arrays.

    Returns
    -------
    Plan

    Examples
    --------
    >>> import numpy as np
    >>> import linattn as la
    >>> plan = causal_plan(np.zeros((4, 8)), la.FeatureMap(8, 16))
    >>> plan.path in ("numba-cpu", "array-api"), isinstance(plan.reason, str)
    (True, True)
    >>> causal_plan(np.zeros((4, 8), dtype=np.int32))
    Traceback (most recent call last):
    ...
    TypeError: x must have a real floating dtype (float16, bfloat16, float32 or float64); got int32
    """
    if not is_array(x):
        raise TypeError(f"x must be an array (the queries); got {type(x).__name__}")
    float_dtype(array_namespace(x), "x", x)
    if feature_map is not None and not isinstance(feature_map, FeatureMap):
        raise TypeError(
            f"feature_map must be a linattn.FeatureMap or None; got {type(feature_map).__name__}"
        )
    return scan_plan(x, feature_map, backend=backend)


def scan_plan(
    x: Array, feature_map: FeatureMap | None = None, *, backend: Backend | None = None
) -> Plan:
    """:func:`causal_plan` without its argument checks, for calls whose executor checks
    them (and names what is wrong as the front door does)."""
    chosen = resolve_backend(backend)
    if not is_array(x):  # the executor's checks say what is wrong
        return Plan("array-api", f"{type(x).__name__} is not an array", backend=chosen)
    if is_dask_array(x):
        return Plan(
            "dask-scan",
            "Dask arrays: a scan of chunk states over the input's chunks",
            backend=chosen,
        )
    if chosen == "array_api":
        reason = "backend='array_api'" + (
            " ($LINATTN_BACKEND)" if backend is None and ENVIRONMENT_VARIABLE in os.environ else ""
        )
        return portable_plan(x, feature_map, reason, chosen)
    kernel, reason = kernel_for(x)
    if kernel is not None and feature_map is not None and not feature_map.is_positive:
        kernel, reason = None, "the kernels take positive features only"
    if kernel is None:
        if chosen == "numba":
            raise ValueError(
                f"backend='numba' cannot serve these arrays "
                f"({type(x).__module__}.{type(x).__name__}): {reason}"
            )
        return portable_plan(x, feature_map, reason, chosen)
    on_gpu = library_of(x) == "cupy" or getattr(getattr(x, "device", None), "type", "") == "cuda"
    return Plan(
        "numba-cuda" if on_gpu else "numba-cpu",
        f"the compiled {'CUDA' if on_gpu else 'CPU'} kernel serves {library_of(x)} arrays",
        fused=fused_pass(x, feature_map),
        kernel=kernel,
        backward=numpy_backward() if library_of(x) == "numpy" else None,
        backend=chosen,
    )


#: What attention computes from: ``(log_phi_q, sign_q, log_phi_k, sign_k, values_aug)``
#: (signs None for positive features).
Operands = tuple[Array, Array | None, Array, Array | None, Array]


def attend(
    xp: Namespace,
    operands: Operands,
    kv: Array,
    log_shift: Array,
    *,
    causal: bool,
    chunk_size: int,
    plan: Plan,
    return_log_scale: bool = False,
) -> tuple[Array, ...]:
    """Unnormalised ``[numerator | denominator]`` rows and the state after the keys,
    ``(rows, kv, log_shift)``; with ``return_log_scale`` also each row's log-scale (the
    rows' stabiliser, for merging partials).

    Causal attention runs on the plan's path (compiled kernel or the chunked pass of
    :func:`linattn.causal.causal`, same results either way); bidirectional attention is
    one pass in the array API (:func:`linattn.causal.bidirectional`; the state returned
    is the one given).
    """
    log_phi_q, sign_q, log_phi_k, sign_k, values_aug = operands
    if not causal:
        result = causal_path.bidirectional(
            xp, log_phi_q, sign_q, log_phi_k, sign_k, values_aug, kv, log_shift,
            return_log_scale=return_log_scale,
        )  # fmt: skip
        if return_log_scale:
            return result[0], kv, log_shift, result[1]
        return result, kv, log_shift
    if plan.kernel is not None:
        if return_log_scale:
            return plan.kernel(
                log_phi_q, log_phi_k, values_aug, kv, log_shift, chunk_size, return_log_scale=True
            )
        return plan.kernel(log_phi_q, log_phi_k, values_aug, kv, log_shift, chunk_size)
    return causal_path.causal(
        xp,
        log_phi_q,
        sign_q,
        log_phi_k,
        sign_k,
        values_aug,
        kv,
        log_shift,
        chunk_size,
        tokens_per_pass=plan.tokens_per_pass,
        return_log_scale=return_log_scale,
    )


def kernel_status() -> dict[str, str]:
    """Which compiled kernels can run here, and why not where one cannot; where the CPU
    kernels can, how they run (kernel threads, compile cache)."""
    status = {}
    try:
        import linattn_numba

        status["numba-cpu"] = linattn_numba.cpu_status()
        status["numba-cuda"] = linattn_numba.cuda_status()
    except ImportError as error:
        status["numba-cpu"] = status["numba-cuda"] = f"unavailable: {error}"
    else:
        if status["numba-cpu"] == "available":
            status["numba-cpu"] = f"available; {linattn_numba.cpu_runtime()}"
    return status


def portable_plan(x: Array, feature_map: FeatureMap | None, reason: str, backend: Backend) -> Plan:
    """The batched chunk pass: the framework's scan on JAX, groups of chunks on eager CPUs."""
    if is_jax_array(x):
        return Plan("jax-scan", f"{reason}; JAX arrays: jax.lax.scan", backend=backend)
    return Plan("array-api", reason, tokens_per_pass=tokens_per_pass(x), backend=backend)


def tokens_per_pass(x: Array) -> int | None:
    """Groups of tokens for eager CPU arrays; one pass on GPUs and while torch compiles."""
    library = library_of(x)
    if library == "torch":
        import torch

        if torch.compiler.is_compiling() or x.device.type != "cpu":
            return None
    elif library not in ("numpy", "array_api_strict"):
        return None
    return EAGER_CPU_TOKENS_PER_PASS


def fused_pass(x: Array, feature_map: FeatureMap | None) -> bool:
    """The fused CPU pass takes NumPy arrays, torch CPU tensors (differentiable through
    the fused backward, ``linattn::causal_fused_backward``) and the maps of
    :func:`fused_map`."""
    library = library_of(x)
    on_cpu = library == "numpy" or (library == "torch" and x.device.type == "cpu")
    return feature_map is not None and on_cpu and fused_map(feature_map)


def kernel_for(x: Array) -> tuple[Callable[..., CausalResult] | None, str]:
    """The kernel entry point that serves arrays like ``x``, or ``None`` and the reason."""
    if not NUMBA_INSTALLED:  # a constant: no failing import inside a compiled region
        return None, "numba is not installed; install linattn[numba]"
    try:
        import linattn_numba
    except ImportError as error:
        return None, f"linattn_numba cannot be imported ({error}); install linattn[numba]"
    return linattn_numba.causal_kernel_for(x)


def numpy_backward() -> Callable[..., Any] | None:
    from linattn_numba import libraries

    return libraries.cpu_causal_backward_kernel("numpy")
