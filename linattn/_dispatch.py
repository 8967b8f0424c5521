"""The one place that decides who runs causal attention: a compiled kernel or the array API.

``backend="auto"`` (or the ``LINATTN_BACKEND`` environment variable) picks the Numba
kernel when one can serve the arrays and the array-API path otherwise;
``"numba"`` insists on the kernel, ``"array_api"`` on the portable path.
``linattn_numba`` is imported lazily, here and nowhere else, so ``linattn`` imports
without numba installed.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

from linattn import causal as causal_path
from linattn._xp import Array, Namespace

if TYPE_CHECKING:
    from linattn.features import FeatureMap

__all__ = [
    "BACKENDS",
    "Backend",
    "causal",
    "causal_backward_kernel",
    "fused_causal",
    "kernel_status",
    "resolve_backend",
]

#: Who may run causal attention: the argument ``backend=`` of every front-door function.
Backend = Literal["auto", "numba", "array_api"]
BACKENDS: tuple[Backend, ...] = ("auto", "numba", "array_api")
ENVIRONMENT_VARIABLE = "LINATTN_BACKEND"

CausalResult = tuple[Array, Array, Array]


def resolve_backend(backend: object) -> Backend:
    """The backend asked for: the argument, else ``$LINATTN_BACKEND``, else ``"auto"``."""
    chosen = backend if backend is not None else os.environ.get(ENVIRONMENT_VARIABLE, "auto")
    if chosen not in BACKENDS:
        source = "backend" if backend is not None else f"${ENVIRONMENT_VARIABLE}"
        raise ValueError(f"{source} must be one of {BACKENDS}; got {chosen!r}")
    return chosen


def kernel_status() -> dict[str, str]:
    """Which compiled kernels can run here, and why not where one cannot."""
    status = {}
    try:
        import linattn_numba

        status["numba-cpu"] = linattn_numba.cpu_status()
        status["numba-cuda"] = linattn_numba.cuda_status()
    except ImportError as error:
        status["numba-cpu"] = status["numba-cuda"] = f"unavailable: {error}"
    return status


def kernel_for(x: Array) -> tuple[Callable[..., CausalResult] | None, str]:
    """The kernel entry point that serves arrays like ``x``, or ``None`` and the reason."""
    try:
        import linattn_numba
    except ImportError as error:
        return None, f"linattn_numba cannot be imported ({error}); install linattn[numba]"
    return linattn_numba.causal_kernel_for(x)


def causal(
    xp: Namespace,
    log_phi_q: Array,
    sign_q: Array | None,
    log_phi_k: Array,
    sign_k: Array | None,
    values_aug: Array,
    kv: Array,
    log_shift: Array,
    *,
    chunk_size: int,
    backend: Backend | None,
) -> CausalResult:
    """Chunked causal attention by the chosen backend; same results either way."""
    chosen = resolve_backend(backend)
    if chosen != "array_api":
        kernel, reason = kernel_for(log_phi_q)
        if kernel is not None and sign_q is not None:
            kernel, reason = None, "the kernels take positive features only"
        if kernel is not None:
            return kernel(log_phi_q, log_phi_k, values_aug, kv, log_shift, chunk_size)
        if chosen == "numba":
            raise ValueError(
                f"backend='numba' cannot serve these arrays "
                f"({type(log_phi_q).__module__}.{type(log_phi_q).__name__}): {reason}"
            )
    return causal_path.causal(
        xp, log_phi_q, sign_q, log_phi_k, sign_k, values_aug, kv, log_shift, chunk_size
    )


def causal_backward_kernel(
    x: Array, *, signed: bool, backend: Backend | None
) -> Callable[..., tuple[Array, Array, Array, Array]] | None:
    """The compiled causal backward for arrays like ``x``, or ``None`` for the array API.

    Only NumPy arrays with positive features have one (torch users get the kernel's
    gradients through autograd); ``backend="numba"`` on anything else raises.
    """
    chosen = resolve_backend(backend)
    if chosen == "array_api":
        return None
    kernel, reason = None, "the compiled backward serves NumPy arrays only"
    if type(x).__module__.split(".")[0] == "numpy":
        try:
            from linattn_numba import cpu

            kernel, reason = cpu.causal_backward_kernel("numpy"), "available"
        except ImportError as error:
            reason = f"linattn_numba cannot be imported ({error}); install linattn[numba]"
    if kernel is not None and signed:
        kernel, reason = None, "the kernels take positive features only"
    if kernel is None and chosen == "numba":
        raise ValueError(
            f"backend='numba' cannot serve these arrays "
            f"({type(x).__module__}.{type(x).__name__}): {reason}"
        )
    return kernel


def fused_causal(
    q: Array,
    k: Array,
    v: Array,
    feature_map: FeatureMap,
    key_mask: Array | None,
    kv: Array,
    log_shift: Array,
    *,
    chunk_size: int,
    backend: Backend | None,
) -> CausalResult | None:
    """Features, causal attention and normalisation in one compiled pass, or ``None``.

    Serves NumPy arrays with ``"positive"`` or ``"hyperbolic"`` features when the CPU
    kernels import; returns ``(outputs, kv, log_shift)`` with outputs normalised, in
    the compute dtype.  It never holds an ``L x m`` feature array (the path for long
    sequences).  ``None`` means: compute features and call :func:`causal`.
    """
    if resolve_backend(backend) == "array_api" or not feature_map._spec.fused:
        return None
    if feature_map.rebalance_scales is not None or feature_map.projection is None:
        return None  # rebalanced queries and keys differ: the fused pass does not take them
    if type(q).__module__.split(".")[0] != "numpy":
        return None
    try:
        from linattn_numba import cpu
    except ImportError:
        return None
    return cpu.favor_causal(
        q,
        k,
        v,
        feature_map.projection,
        hyperbolic=feature_map.kind == "hyperbolic",
        scale=feature_map.scale,
        key_mask=key_mask,
        kv=kv,
        log_shift=log_shift,
        chunk_size=chunk_size,
    )
