"""The kernels' bridge: the path of the causal scan (one :class:`Plan`), and the only
module that reaches ``linattn_numba``.

Which executor runs a call is :mod:`linattn._plan`'s decision; inside it, the causal
scan's path is decided here.

``backend="auto"`` (or the ``LINATTN_BACKEND`` environment variable) picks a compiled
Numba kernel when one can serve the arrays and the portable code otherwise;
``"numba"`` insists on the kernel, ``"array_api"`` on the portable code, which is the
batched chunk pass with the framework's own scan on JAX and the sequence-parallel
scan of :mod:`linattn.distributed` on Dask.  The plan names the path and says why;
:func:`linattn.causal_plan` shows it, and so does ``linattn info``.  ``linattn_numba``
is imported lazily, here and nowhere else, so ``linattn`` imports without numba.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from linattn import causal as causal_path
from linattn._checks import check_chunk_size
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
    "BACKENDS",
    "PATHS",
    "Backend",
    "Plan",
    "causal",
    "causal_plan",
    "kernel_for",
    "kernel_status",
    "resolve_backend",
    "scan_plan",
    "window_kernel_for",
]

#: Who may run causal attention: the argument ``backend=`` of every front-door function.
Backend = Literal["auto", "numba", "array_api"]
BACKENDS: tuple[Backend, ...] = ("auto", "numba", "array_api")
ENVIRONMENT_VARIABLE = "LINATTN_BACKEND"


#: Found without importing it (importing numba is slow): where it is missing, no call tries
#: ``import linattn_numba``, which torch.compile would record as a graph break.
def _installed(name: str) -> bool:
    """Whether ``name`` can be found; an import hook that refuses it counts as missing."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


NUMBA_INSTALLED = _installed("numba")

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
    >>> la.causal_plan(np.zeros((4, 8)), backend="array_api").path
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
    if plan.path == "numba-cpu" and not _backward_follows(inputs):
        return CPU_FORWARD_CHUNK_SIZE
    return DEFAULT_CHUNK_SIZE


def _backward_follows(inputs: tuple[Array, ...]) -> bool:
    """Whether torch will differentiate through ``inputs`` (no other library records)."""
    if not any(getattr(x, "requires_grad", False) for x in inputs):
        return False
    import torch

    return bool(torch.is_grad_enabled())  # (Any where torch is not installed for mypy)


def resolve_backend(backend: object) -> Backend:
    """The backend asked for: the argument, else ``$LINATTN_BACKEND``, else ``"auto"``."""
    chosen = backend if backend is not None else os.environ.get(ENVIRONMENT_VARIABLE, "auto")
    if chosen not in BACKENDS:
        source = "backend" if backend is not None else f"${ENVIRONMENT_VARIABLE}"
        raise ValueError(f"{source} must be one of {BACKENDS}; got {chosen!r}")
    return chosen


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
    >>> plan = la.causal_plan(np.zeros((4, 8)), la.FeatureMap(8, 16))
    >>> plan.path in ("numba-cpu", "array-api"), isinstance(plan.reason, str)
    (True, True)
    >>> la.causal_plan(np.zeros((4, 8), dtype=np.int32))
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
        return _portable(x, feature_map, reason, chosen)
    kernel, reason = kernel_for(x)
    if kernel is not None and feature_map is not None and not feature_map.is_positive:
        kernel, reason = None, "the kernels take positive features only"
    if kernel is None:
        if chosen == "numba":
            raise ValueError(
                f"backend='numba' cannot serve these arrays "
                f"({type(x).__module__}.{type(x).__name__}): {reason}"
            )
        return _portable(x, feature_map, reason, chosen)
    on_gpu = library_of(x) == "cupy" or getattr(getattr(x, "device", None), "type", "") == "cuda"
    return Plan(
        "numba-cuda" if on_gpu else "numba-cpu",
        f"the compiled {'CUDA' if on_gpu else 'CPU'} kernel serves {library_of(x)} arrays",
        fused=_fused(x, feature_map),
        kernel=kernel,
        backward=_numpy_backward() if library_of(x) == "numpy" else None,
        backend=chosen,
    )


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
    plan: Plan,
    return_log_scale: bool = False,
) -> tuple[Array, ...]:
    """Chunked causal attention on the plan's path; same results either way.

    With ``return_log_scale`` also each row's log-scale (:func:`linattn.causal.causal`).
    """
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
    kernels can, how they run (threading layer, compile cache)."""
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


def _portable(x: Array, feature_map: FeatureMap | None, reason: str, backend: Backend) -> Plan:
    """The batched chunk pass: the framework's scan on JAX, groups of chunks on eager CPUs."""
    if is_jax_array(x):
        return Plan("jax-scan", f"{reason}; JAX arrays: jax.lax.scan", backend=backend)
    return Plan("array-api", reason, tokens_per_pass=_tokens_per_pass(x), backend=backend)


def _tokens_per_pass(x: Array) -> int | None:
    """Groups of tokens for eager CPU arrays; one pass on GPUs and while torch compiles."""
    library = library_of(x)
    if library == "torch":
        import torch

        if torch.compiler.is_compiling() or x.device.type != "cpu":
            return None
    elif library not in ("numpy", "array_api_strict"):
        return None
    return EAGER_CPU_TOKENS_PER_PASS


def _fused(x: Array, feature_map: FeatureMap | None) -> bool:
    """The fused CPU pass takes NumPy arrays, torch CPU tensors (differentiable through
    the fused backward, ``linattn::causal_fused_backward``) and the maps of
    :func:`fused_map`."""
    library = library_of(x)
    on_cpu = library == "numpy" or (library == "torch" and x.device.type == "cpu")
    return feature_map is not None and on_cpu and fused_map(feature_map)


def fused_map(feature_map: FeatureMap | None) -> bool:
    """The fused CPU kernels compute this map's features: the kinds that say so,
    unrebalanced (also the test of the decoding path, :mod:`linattn._decode`, and of the
    fused bidirectional pass)."""
    return (
        feature_map is not None
        and feature_map._spec.fused
        and feature_map.rebalance_scales is None
        and feature_map.projection is not None
    )


def kernel_for(x: Array) -> tuple[Callable[..., CausalResult] | None, str]:
    """The kernel entry point that serves arrays like ``x``, or ``None`` and the reason."""
    if not NUMBA_INSTALLED:  # a constant: no failing import inside a compiled region
        return None, "numba is not installed; install linattn[numba]"
    try:
        import linattn_numba
    except ImportError as error:
        return None, f"linattn_numba cannot be imported ({error}); install linattn[numba]"
    return linattn_numba.causal_kernel_for(x)


def window_kernel_for(x: Array, backend: Backend) -> Any:
    """The compiled window part for arrays like ``x`` under the call's resolved
    ``backend``, or ``None`` (the portable code runs).

    NumPy arrays where ``linattn_numba`` imports and the call's backend is not
    ``"array_api"``: the module :mod:`linattn_numba.cpu.window`, whose ``banded_partial``
    and ``banded_partial_backward`` have the contract of ``linattn.hybrid.banded_partial``
    and of its adjoint.
    """
    if library_of(x) != "numpy" or numpy_kernels_why_not(backend) is not None:
        return None
    from linattn_numba.cpu import window as _window

    return _window


def hybrid_kernel_for(x: Array, backend: Backend) -> Any:
    """The compiled one-pass hybrid passes for arrays like ``x`` under the call's resolved
    ``backend``, or ``None``: the module :mod:`linattn_numba.cpu.hybrid` where
    :func:`window_kernel_for` gives the window kernel."""
    if window_kernel_for(x, backend) is None:
        return None
    from linattn_numba.cpu import hybrid as _hybrid

    return _hybrid


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


def decode_kernel() -> Callable[..., Any] | None:
    """The compiled decoding step (:func:`linattn_numba.cpu.decode.decode_step`), or
    ``None`` where numba is missing."""
    if not NUMBA_INSTALLED:
        return None
    try:
        from linattn_numba.cpu import decode as compiled
    except ImportError:
        return None
    return compiled.decode_step


def fused_global(
    q: Array,
    k: Array,
    v: Array,
    feature_map: FeatureMap,
    keep: Array,
    sinks: tuple[Array, Array, Array],
) -> Array:
    """Bidirectional attention with exact keys merged per query in the fused pass
    (:func:`linattn_numba.cpu.bidirectional.favor_bidirectional`); NumPy arrays."""
    from linattn_numba.cpu import bidirectional as _bidirectional

    projection, hyperbolic = fused_map_arrays(feature_map)
    out, _, _ = _bidirectional.favor_bidirectional(
        q, k, v, projection, hyperbolic=hyperbolic, scale=feature_map.scale, key_mask=keep,
        sinks=sinks,
    )  # fmt: skip
    return out


def _numpy_backward() -> Callable[..., Any] | None:
    from linattn_numba import libraries

    return libraries.cpu_causal_backward_kernel("numpy")


def library_of(x: Array) -> str:
    """The top-level module of ``x``'s type: ``"numpy"``, ``"torch"``, ``"cupy"``..."""
    return type(x).__module__.split(".")[0]


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
    return_log_normaliser: bool = False,
) -> tuple[Array, ...]:
    """Features, causal attention and normalisation in one compiled pass (``plan.fused``).

    Returns ``(outputs, kv, log_shift)`` with outputs normalised, in the compute dtype
    (and each output's log-normaliser when asked, for merging partials); it never holds
    an ``L x m`` feature array (the path for long sequences).  Torch CPU tensors run
    the same kernel through ``linattn::causal_fused_forward`` and differentiate through
    ``linattn::causal_fused_backward`` (outputs, final state and log-normaliser).  A
    fitted map's features are computed in the pass too, for NumPy arrays
    (:func:`fitted_kernel_arrays`; ``linattn._plan`` sends nothing else).
    """
    if feature_map.parameters is not None:
        from linattn_numba import cpu

        batch = _broadcast_batch(q, k, v, key_mask, kv.shape[:-2], log_shift.shape[:-1])
        empty, fitted = fitted_kernel_arrays(feature_map, (*batch, *q.shape[-2:]), q.dtype)
        return cpu.favor_causal(
            q, k, v, empty, hyperbolic=False, scale=feature_map.scale, key_mask=key_mask,
            kv=kv, log_shift=log_shift, chunk_size=chunk_size,
            return_log_normaliser=return_log_normaliser, fitted=fitted,
        )  # fmt: skip
    assert feature_map.projection is not None
    if library_of(q) == "torch":
        import torch

        from linattn_numba import torch_ops as _torch

        # float64, as NumPy's pass scales it
        projection = _torch_projection(feature_map.projection, torch.float64)
        hyperbolic = feature_map.kind == "hyperbolic"
        results = _torch.causal_fused(
            q, k, v, projection, key_mask, kv, log_shift, hyperbolic, feature_map.scale,
            chunk_size,
        )  # fmt: skip
        return results if return_log_normaliser else results[:3]
    from linattn_numba import cpu

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
        return_log_normaliser=return_log_normaliser,
    )


def fused_causal_vjp(
    q: Array,
    k: Array,
    v: Array,
    feature_map: FeatureMap,
    key_mask: Array | None,
    grad_output: Array,
    *,
    chunk_size: int,
) -> tuple[Array, Array, Array]:
    """``(dq, dk, dv)`` of causal attention (no incoming state) by the fused forward and
    backward passes (``plan.fused``; :mod:`linattn_numba.cpu.fused_causal`): no ``L x m``
    array; over the broadcast batch shape, in the compute dtype.  Torch CPU tensors are
    read as NumPy views and the results wrapped without copies.

    Examples
    --------
    >>> import numpy as np
    >>> import linattn as la
    >>> x, g = np.zeros((1, 4, 8)), np.ones((1, 4, 8))  # equal features: running means
    >>> dq, dk, dv = fused_causal_vjp(x, x, x, la.FeatureMap(8, 16), None, g, chunk_size=2)
    >>> dv[0, :, 0].round(4).tolist()  # value t reaches outputs s >= t, weight 1 / (s + 1)
    [2.0833, 1.0833, 0.5833, 0.25]
    """
    return _fused_causal_backward(
        q, k, v, feature_map, key_mask, None, grad_output, None, chunk_size=chunk_size
    )


def fused_causal_rows_vjp(
    q: Array,
    k: Array,
    v: Array,
    feature_map: FeatureMap,
    key_mask: Array | None,
    outputs: Array,
    grad_output: Array,
    grad_log_normaliser: Array,
    *,
    chunk_size: int,
) -> tuple[Array, Array, Array]:
    """``(dq, dk, dv)`` of the fused causal pass's normalised ``outputs`` and
    log-normaliser (from :func:`fused_causal`, no incoming state) for their cotangents:
    the fused backward alone (no forward), as the hybrid's far parts need it.

    Examples
    --------
    >>> import numpy as np
    >>> import linattn as la
    >>> x, g = np.zeros((1, 4, 8)), np.ones((1, 4, 8))
    >>> fm = la.FeatureMap(8, 16)
    >>> out, *_ = fused_causal(x, x, x, fm, None, np.zeros((1, 16, 9)),
    ...     np.full((1, 16), -np.inf), chunk_size=2)
    >>> dv = fused_causal_rows_vjp(x, x, x, fm, None, out, g, np.zeros((1, 4)), chunk_size=2)[2]
    >>> dv[0, :, 0].round(4).tolist()  # as fused_causal_vjp's
    [2.0833, 1.0833, 0.5833, 0.25]
    """
    return _fused_causal_backward(
        q, k, v, feature_map, key_mask, outputs, grad_output, grad_log_normaliser,
        chunk_size=chunk_size,
    )  # fmt: skip


def _fused_causal_backward(
    q: Array,
    k: Array,
    v: Array,
    feature_map: FeatureMap,
    key_mask: Array | None,
    outputs: Array | None,
    grad_output: Array,
    grad_log_normaliser: Array | None,
    *,
    chunk_size: int,
) -> tuple[Array, Array, Array]:
    """The fused backward from an empty state; ``outputs=None`` runs the forward first."""
    from linattn_numba.cpu import fused_causal, fused_causal_backward

    arrays: tuple[Any, ...] = (q, k, v, key_mask, outputs, grad_output, grad_log_normaliser)
    torch_in = library_of(q) == "torch"
    if torch_in:
        arrays = tuple(None if x is None else x.detach().numpy() for x in arrays)
    q, k, v, key_mask, outputs, grad_output, grad_log_normaliser = arrays
    projection, hyperbolic = fused_map_arrays(feature_map)
    batch = _broadcast_batch(q, k, v, key_mask)
    m, dv = feature_map.num_features, v.shape[-1]
    dtype = grad_output.dtype
    kv = _zeros_state(batch, m, dv, dtype)
    log_shift = _empty_shift(batch, m, dtype)
    options: dict[str, Any] = {"hyperbolic": hyperbolic, "scale": feature_map.scale}
    options.update(key_mask=key_mask, chunk_size=chunk_size)
    if outputs is None:
        outputs, _, _, _ = fused_causal.forward(q, k, v, projection, kv, log_shift, **options)
    grads: tuple[Any, ...] = fused_causal_backward.backward(
        q, k, v, projection, kv, log_shift, outputs, grad_output, **options,
        grad_log_normaliser=grad_log_normaliser,
    )  # fmt: skip
    if torch_in:
        import torch

        grads = tuple(torch.from_numpy(g) for g in grads)
    return grads[0], grads[1], grads[2]


def _broadcast_batch(q: Any, k: Any, v: Any, key_mask: Any, *more: Any) -> tuple[int, ...]:
    import numpy as np

    shapes = [q.shape[:-2], k.shape[:-2], v.shape[:-2], *more]
    shapes += [] if key_mask is None else [key_mask.shape[:-1]]
    return tuple(np.broadcast_shapes(*shapes))


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


def fitted_decode_operands(feature_map: FeatureMap, shape: tuple[int, ...], dtype: Any) -> Any:
    """A fitted map's ``(weights, biases)`` as the decoding kernel takes them for inputs of
    ``shape`` (``linattn_numba.cpu.calls.fitted_operands``); ``ValueError`` where its
    heads do not meet ``shape``."""
    from linattn_numba.cpu.calls import fitted_operands

    _, arrays = fitted_kernel_arrays(feature_map, shape, dtype)
    weights, biases, _ = fitted_operands(arrays, tuple(shape[:-2]), dtype)
    return weights, biases


def _zeros_state(batch: tuple[int, ...], m: int, dv: int, dtype: Any) -> Any:
    import numpy as np

    return np.broadcast_to(np.zeros((), dtype), (*batch, m, dv + 1))  # (no memory)


def _empty_shift(batch: tuple[int, ...], m: int, dtype: Any) -> Any:
    import numpy as np

    return np.broadcast_to(np.full((), -np.inf, dtype), (*batch, m))


# -- bidirectional attention ------------------------------------------------------------


def fused_bidirectional(
    q: Array, k: Array, v: Array, feature_map: FeatureMap, key_mask: Array | None
) -> Array:
    """Normalised bidirectional attention in the fused CPU pass (:func:`bidirectional_fused`):
    features, state and readout block by block, no ``L x m`` array; compute dtype.  A
    fitted map's features too, for NumPy arrays (``linattn._plan`` sends nothing else)."""
    if feature_map.parameters is not None:
        from linattn_numba.cpu import bidirectional as _bidirectional

        batch = _broadcast_batch(q, k, v, key_mask)
        empty, fitted = fitted_kernel_arrays(feature_map, (*batch, *q.shape[-2:]), q.dtype)
        out, _, _ = _bidirectional.favor_bidirectional(
            q, k, v, empty, hyperbolic=False, scale=feature_map.scale, key_mask=key_mask,
            fitted=fitted,
        )  # fmt: skip
        return out
    projection, hyperbolic = fused_map_arrays(feature_map)
    if library_of(q) == "torch":
        from linattn_numba import torch_ops as _torch

        projection = _torch_projection(projection, q.dtype)
        return _torch.bidirectional(q, k, v, projection, key_mask, hyperbolic, feature_map.scale)
    from linattn_numba.cpu import bidirectional as _bidirectional

    out, _, _ = _bidirectional.favor_bidirectional(
        q, k, v, projection, hyperbolic=hyperbolic, scale=feature_map.scale, key_mask=key_mask
    )
    return out


def fused_bidirectional_vjp(
    q: Array,
    k: Array,
    v: Array,
    feature_map: FeatureMap,
    key_mask: Array | None,
    grad_output: Array,
    *,
    chunk_size: int | None = None,
) -> tuple[Array, Array, Array]:
    """``(dq, dk, dv)`` of bidirectional attention by the fused forward and backward
    passes (:func:`bidirectional_fused`); over the broadcast batch shape, compute dtype.
    (``chunk_size`` is taken as every backward takes it, and unused: the passes go
    block by block.)"""
    from linattn_numba.cpu import bidirectional as _bidirectional

    arrays: tuple[Any, ...] = (q, k, v, key_mask, grad_output)
    torch_in = library_of(q) == "torch"
    if torch_in:  # (NumPy views of the CPU tensors; the results wrapped without copies)
        arrays = tuple(None if x is None else x.detach().numpy() for x in arrays)
    q, k, v, key_mask, grad_output = arrays
    projection, hyperbolic = fused_map_arrays(feature_map)
    options: dict[str, Any] = {"hyperbolic": hyperbolic, "scale": feature_map.scale}
    options["key_mask"] = key_mask
    out, kv, log_shift = _bidirectional.favor_bidirectional(q, k, v, projection, **options)
    grads: tuple[Any, ...] = _bidirectional.favor_bidirectional_backward(
        q, k, v, projection, kv, log_shift, out, grad_output, **options
    )
    if torch_in:
        import torch

        grads = tuple(torch.from_numpy(g) for g in grads)
    return grads[0], grads[1], grads[2]


def _torch_projection(projection: Any, dtype: Any) -> Any:
    """The map's projection as a torch tensor of ``dtype``: a copy (the map's array is
    read-only), except while compiling, where Dynamo already holds it as a (fake) tensor
    and ``torch.tensor`` of a tensor warns."""
    import torch

    if torch.compiler.is_compiling():
        return torch.as_tensor(projection, dtype=dtype)
    return torch.tensor(projection, dtype=dtype)


def fused_map_arrays(feature_map: FeatureMap) -> tuple[Any, bool]:
    assert feature_map.projection is not None
    return feature_map.projection, feature_map.kind == "hyperbolic"
