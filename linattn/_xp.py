"""Array-namespace helpers: one place for namespace, device and dtype decisions.

Everything here works on any array-API namespace obtained through
``array_api_compat``; nothing imports an array library at import time.

The rest of ``linattn`` asks these helpers, never ``array_api_compat`` itself: its type
and namespace tests are wrapped in ``functools.lru_cache``, and ``torch.compile`` traces
through such a wrapper with a warning for each one it meets (about twenty per compiled
call).  The tests here answer torch tensors, and the questions asked of every array
(which library, which namespace), by plain type checks that Dynamo traces silently, and
leave every other library to ``array_api_compat``.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Collection, Mapping
from typing import Any, TypeVar

import array_api_compat
import numpy as np

Array = Any
Namespace = Any
_T = TypeVar("_T")

__all__ = [
    "Array",
    "Namespace",
    "array_device",
    "array_namespace",
    "compute_dtype",
    "constant",
    "device_of",
    "dtype_name",
    "float_dtype",
    "from_host",
    "fused_softmax_attention",
    "fused_softmax_lse",
    "is_array",
    "is_cupy_array",
    "is_dask_array",
    "is_dask_namespace",
    "is_jax_array",
    "is_jax_namespace",
    "is_numpy_namespace",
    "is_torch_array",
    "is_torch_namespace",
    "is_traced",
    "library_name",
    "namespace_of",
    "require",
    "safe_shift",
    "stop_gradient",
    "to_host",
    "untraced",
]


def _is_instance(x: object, module: str, name: str) -> bool:
    """``isinstance(x, module.name)`` without importing ``module`` (False if not imported)."""
    found = sys.modules.get(module)
    return found is not None and issubclass(type(x), getattr(found, name))


def is_torch_array(x: object) -> bool:
    """True for a torch tensor (and its subclasses: parameters, fake tensors)."""
    return _is_instance(x, "torch", "Tensor")


def is_dask_array(x: object) -> bool:
    """True for a Dask array."""
    return _is_instance(x, "dask.array", "Array")


def is_cupy_array(x: object) -> bool:
    """True for a CuPy array."""
    return _is_instance(x, "cupy", "ndarray")


def is_jax_array(x: object) -> bool:
    """True for a JAX array or tracer (``array_api_compat.is_jax_array``)."""
    return not is_torch_array(x) and array_api_compat.is_jax_array(x)


def is_array(x: object) -> bool:
    """True for an array of any array-API library (``array_api_compat.is_array_api_obj``)."""
    if x is None or type(x) in (bool, int, float, complex):
        return False
    if is_torch_array(x) or isinstance(x, (np.ndarray, np.generic)):  # (Dynamo: no X | Y)
        return not isinstance(x, np.matrix)
    return array_api_compat.is_array_api_obj(x)


def array_namespace(*arrays: Array) -> Namespace:
    """The array-API namespace of ``arrays`` (``array_api_compat.array_namespace``);
    ``TypeError`` if they come from different libraries."""
    if arrays and all(is_torch_array(a) for a in arrays):
        import array_api_compat.torch as torch_namespace

        return torch_namespace
    return array_api_compat.array_namespace(*arrays)


def array_device(x: Array) -> Any:
    """The device of ``x`` (``array_api_compat.device``: NumPy's is ``"cpu"``)."""
    if is_torch_array(x):
        return x.device
    return array_api_compat.device(x)


def _namespace_is(xp: Namespace, *names: str) -> bool:
    """True if ``xp`` is one of the modules ``names`` or array-api-compat's wrapper of one."""
    name: str = xp.__name__
    compat = array_api_compat.__name__ + "."
    return name in names or (name.startswith(compat) and name.removeprefix(compat) in names)


def is_numpy_namespace(xp: Namespace) -> bool:
    """True for NumPy or array-api-compat's NumPy namespace."""
    return _namespace_is(xp, "numpy")


def is_torch_namespace(xp: Namespace) -> bool:
    """True for torch or array-api-compat's torch namespace."""
    return _namespace_is(xp, "torch")


def is_dask_namespace(xp: Namespace) -> bool:
    """True for ``dask.array`` or array-api-compat's Dask namespace."""
    return _namespace_is(xp, "dask.array")


def is_jax_namespace(xp: Namespace) -> bool:
    """True for ``jax.numpy`` (JAX's array-API namespace)."""
    return xp.__name__ in ("jax.numpy", "jax.experimental.array_api")


def library_name(x: object) -> str:
    """A short, readable name for the library an array belongs to (for error messages)."""
    cls = type(x)
    return f"{cls.__module__.split('.')[0]}.{cls.__qualname__}"


def namespace_of(
    arrays: Mapping[str, Array | None], /, *, optional: Collection[str] = ()
) -> Namespace:
    """The one array namespace shared by the named arrays.

    ``None`` is accepted only for the names in ``optional`` (and then skipped).

    Raises
    ------
    TypeError
        If an argument is not an array (or ``None`` where an array is required), or the
        arrays come from different libraries.
    """
    present = {}
    for name, a in arrays.items():
        if a is None and name in optional:
            continue
        if a is None or not is_array(a):
            raise TypeError(
                f"{name} must be an array (NumPy, CuPy, PyTorch, JAX, Dask or an "
                f"array-API array); got {type(a).__name__}"
            )
        present[name] = a
    try:
        return array_namespace(*present.values())
    except TypeError:
        kinds = ", ".join(f"{name}: {library_name(a)}" for name, a in present.items())
        raise TypeError(f"all arrays must come from one array library; got {kinds}") from None


def device_of(**arrays: Array | None) -> Any:
    """The one device shared by the named arrays; ``ValueError`` naming them if they differ."""
    devices = {name: array_device(a) for name, a in arrays.items() if a is not None}
    # Arrays being traced (JAX under jit or grad) report no device: nothing to compare.
    known = {name: dev for name, dev in devices.items() if dev is not None}
    if not known:
        return next(iter(devices.values()))
    devices = known
    first_name, first = next(iter(devices.items()))
    for name, dev in devices.items():
        if dev != first:
            raise ValueError(
                f"all arrays must be on one device; {first_name} is on {first!r} "
                f"but {name} is on {dev!r}"
            )
    return first


def float_dtype(xp: Namespace, name: str, x: Array) -> Any:
    """``x.dtype`` if it is a real floating dtype, else a ``TypeError`` naming ``name``."""
    if not xp.isdtype(x.dtype, "real floating"):
        raise TypeError(
            f"{name} must have a real floating dtype (float16, bfloat16, float32 or "
            f"float64); got {x.dtype}"
        )
    return x.dtype


def compute_dtype(xp: Namespace, dtype: Any) -> Any:
    """The dtype the state and accumulations use: float64 stays, all else is float32.

    Every operand is cast to it before any work (mixed float32/float64 inputs compute
    in float64, as NumPy's promotion says); NumPy's byte-swapped ``>f8`` counts as
    float64.
    """
    wide = dtype == xp.float64 or (getattr(dtype, "kind", "") == "f" and dtype.itemsize == 8)
    return xp.float64 if wide else xp.float32


def dtype_name(dtype: Any) -> str:
    """``float32`` rather than ``<class 'numpy.float32'>`` for any library's dtype."""
    if isinstance(dtype, type):
        return np.dtype(dtype).name
    return str(dtype)


def constant(xp: Namespace, value: float, like: Array) -> Array:
    """A 0-d array holding ``value`` with the dtype and device of ``like``."""
    return xp.asarray(value, dtype=like.dtype, device=array_device(like))


def safe_shift(xp: Namespace, shift: Array) -> Array:
    """Replace infinite stabiliser entries (from empty or fully masked inputs) by 0.

    A stabiliser only has to make exponents non-positive; where it is ``-inf``
    every term it shifts is zero anyway, and 0 keeps ``x - shift`` free of NaN.
    """
    return xp.where(xp.isfinite(shift), shift, constant(xp, 0.0, shift))


def from_host(xp: Namespace, host: np.ndarray, *, dtype: Any, device: Any) -> Array:
    """Move a NumPy array (drawn on the host) into namespace ``xp`` on ``device``."""
    if is_numpy_namespace(xp):
        return xp.asarray(host, dtype=dtype)
    # Other libraries may share memory with a NumPy source (and warn on read-only
    # ones): hand them a private copy so nothing can write into the caller's data.
    host = np.array(host, copy=True)
    if is_dask_namespace(xp):
        # Dask's asarray has no device argument; its chunks live on the host.
        return xp.asarray(host, dtype=dtype)
    return xp.asarray(host, dtype=dtype, device=device)


def to_host(x: Array) -> np.ndarray:
    """A NumPy copy of any array (detached from autograd, moved to the host)."""
    if isinstance(x, np.ndarray):
        return x
    host: np.ndarray
    if is_torch_array(x):
        host = x.detach().cpu().numpy()
        return host
    if is_cupy_array(x):
        host = x.get()
        return host
    if is_dask_array(x):
        return np.asarray(x.compute())
    try:
        return np.asarray(x)
    except (RuntimeError, TypeError, ValueError):
        # Libraries that refuse an implicit host copy (array-api-strict off its
        # default device) still speak DLPack.
        return np.from_dlpack(x).copy()


def stop_gradient(xp: Namespace, x: Array) -> Array:
    """``x`` as a constant for automatic differentiation (JAX and torch; else ``x``)."""
    if is_jax_namespace(xp):
        import jax

        return jax.lax.stop_gradient(x)
    if is_torch_namespace(xp):
        return x.detach()
    return x


def softmax(xp: Namespace, x: Array) -> Array:
    """Softmax over the last axis: the library's fused one (torch, JAX; faster, and their
    backward passes are one kernel too), else the array API's operations."""
    if is_torch_namespace(xp):
        import torch

        return torch.softmax(x, dim=-1)
    if is_jax_namespace(xp):
        import jax

        return jax.nn.softmax(x, axis=-1)
    top = xp.max(x, axis=-1, keepdims=True)
    weights = xp.exp(x - top)
    return weights / xp.sum(weights, axis=-1, keepdims=True)


def log_softmax(xp: Namespace, x: Array) -> Array:
    """Log-softmax over the last axis: the library's fused one (torch, JAX), else the
    array API's operations."""
    if is_torch_namespace(xp):
        import torch

        return torch.log_softmax(x, dim=-1)
    if is_jax_namespace(xp):
        import jax

        return jax.nn.log_softmax(x, axis=-1)
    top = xp.max(x, axis=-1, keepdims=True)
    return x - (top + xp.log(xp.sum(xp.exp(x - top), axis=-1, keepdims=True)))


def fused_softmax_attention(
    xp: Namespace, q: Array, k: Array, v: Array, visible: Array | None, scale: float
) -> Array | None:
    """``softmax(scale q k^T) v`` over the ``visible`` keys (boolean, broadcasting
    against ``(..., L_q, L_k)``; None: all) by the library's fused kernel, torch's
    ``scaled_dot_product_attention`` (one call instead of a dozen array operations on
    ``L x L`` weights); None for other libraries.  A query that sees no key gets zeros."""
    if not is_torch_namespace(xp):
        return None
    import torch
    from torch.nn import functional

    if visible is None:
        out: Array = functional.scaled_dot_product_attention(q, k, v, scale=scale)
        return out
    seen = torch.any(visible, dim=-1, keepdim=True)
    out = functional.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=visible | ~seen,
        scale=scale,  # (such rows: any weights, zeroed)
    )
    return torch.where(seen, out, torch.zeros((), dtype=out.dtype, device=out.device))


def fused_softmax_lse(
    xp: Namespace, q: Array, k: Array, v: Array, visible: Array, scale: float
) -> tuple[Array, Array] | None:
    """``softmax(scale q k^T) v`` over the ``visible`` keys and the log-sum-exp of their
    logits (a query that sees no key: zeros and ``-inf``), by torch's fused CPU attention
    kernel, which returns both (``aten::_scaled_dot_product_flash_attention_for_cpu``).

    None where that kernel does not serve: not torch CPU tensors of four axes in float32
    or float64, all of one shape, or a gradient is asked (the kernel gives none for the
    log-sum-exp).
    ``visible`` is boolean, broadcasting against ``(B, H, L_q, L_k)``.
    """
    if not is_torch_namespace(xp) or q.device.type != "cpu" or q.ndim != 4:
        return None
    import torch

    if q.dtype not in (torch.float32, torch.float64) or not q.shape == k.shape == v.shape:
        return None
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        return None
    attention = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    bias = torch.where(visible, 0.0, -math.inf).to(q.dtype)
    out, lse = attention(q, k, v, 0.0, False, attn_mask=bias, scale=scale)
    seen = torch.any(visible, dim=-1)  # (the kernel gives such rows zeros and lse 0)
    return out, torch.where(seen, lse, -math.inf)


def is_traced(x: object) -> bool:
    """True for a JAX tracer (a value known only when the traced function runs)."""
    if not is_jax_array(x):
        return False
    import jax

    return isinstance(x, jax.core.Tracer)


def require(
    xp: Namespace, condition: Array, message: str, got: Callable[[], Array] | None = None
) -> None:
    """``ValueError(message)`` unless the 0-d boolean array ``condition`` is true, the
    values ``got()`` returns appended (``"; got [...]"``).

    Inside ``torch.compile``'s trace the value is unknown until the graph runs, and
    reading it would split the graph: the condition is asserted on its device instead
    (``torch._assert_async``: a ``RuntimeError`` with ``message`` when the graph runs).

    Examples
    --------
    >>> import numpy as np
    >>> g = np.array([0.5, -1.0])
    >>> require(np, np.all(g >= 0), "far_weight must be non-negative", lambda: g)
    Traceback (most recent call last):
    ...
    ValueError: far_weight must be non-negative; got [0.5, -1.0]
    """
    if is_torch_namespace(xp):
        import torch

        if torch.compiler.is_compiling():
            torch._assert_async(condition, message)
            return
    if not bool(condition):
        raise ValueError(message if got is None else f"{message}; got {to_host(got()).tolist()}")


def untraced(function: Callable[..., _T], /, *args: Any) -> _T:
    """``function(*args)``, run eagerly even inside ``torch.compile``'s trace: host work
    (drawing or reading a map, checking a call on stand-ins) that a trace cannot hold.
    Inside a trace this is a graph break; callers keep its result so that later calls
    (and later traces) skip it."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.compiler.is_compiling():
        return torch.compiler.disable(function)(*args)  # type: ignore[no-any-return]
    return function(*args)
