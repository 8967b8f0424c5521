"""JAX: :func:`fitted_attention`, a fitted map whose parameters are JAX arrays,
differentiable in them with ``jax.grad`` and usable under ``jax.jit``.

A :class:`linattn.FeatureMap` holds its parameters on the host and is static data under
``jax.jit`` (see :mod:`linattn._jax`), so ``jax.grad`` cannot reach them.  Here the
parameters are arguments.  At training lengths (self-attention of at most
:data:`linattn._fitted_call.DENSE_MAX_LENGTH` tokens) the call is the dense form of the
hybrid in ``jax.numpy``, which JAX differentiates, jits and places itself.  Longer
inputs take the library's path: the forward pass is :func:`linattn.linear_attention`
on the host values (NumPy, the compiled CPU kernels where they serve), the backward
pass :func:`linattn.linear_attention_vjp` with ``parameters=True``, both through
``jax.pure_callback`` under a ``jax.custom_vjp``; those arrays travel to the host and
back.  Importing :mod:`linattn` never imports this module (or JAX).
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from linattn._fitted_call import check_call, dense_hybrid, use_dense
from linattn.attention import linear_attention
from linattn.features import FeatureMap
from linattn.vjp import linear_attention_vjp

__all__ = ["fitted_attention"]

#: The map's parameters, in :func:`_attention`'s argument order.
PARAMETERS = ("query_weight", "query_bias", "key_weight", "key_bias", "far_weight")
#: The masks, after the parameters.
MASKS = ("key_mask", "exact_key_mask")


def fitted_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    query_weight: jax.Array,
    query_bias: jax.Array | None = None,
    *,
    key_weight: jax.Array | None = None,
    key_bias: jax.Array | None = None,
    far_weight: jax.Array | float | None = None,
    tied: bool = False,
    causal: bool = False,
    key_mask: jax.Array | None = None,
    window: int | None = None,
    sink_keys: int = 0,
    exact_key_mask: jax.Array | None = None,
    scale: float | None = None,
    chunk_size: int | None = None,
    dense: bool | None = None,
) -> jax.Array:
    """:func:`linattn.linear_attention` with a fitted map whose parameters are JAX
    arrays, differentiable in them as in ``q``, ``k`` and ``v`` (``jax.grad``,
    ``jax.jit``).

    Self-attention of at most :data:`linattn._fitted_call.DENSE_MAX_LENGTH` tokens
    (training lengths) runs the dense form, the same hybrid as ``L x L`` weights per
    head in ``jax.numpy``, differentiated by JAX on the arrays' device (no callback);
    longer inputs the library's path on the host, below.  ``dense=`` forces either.

    The map is :meth:`linattn.FeatureMap.fitted` of the parameters' values, checked
    there and by the front door before anything runs (shapes, heads, options).  Under
    ``jax.jit`` a traced parameter's values are unknown until the call runs:
    ``far_weight >= 0`` is then checked inside the library path's callback (JAX's
    callback error), while the dense form gives a head with a negative (or NaN) ``g``
    NaN outputs, never a silently clipped answer.  ``far_weight`` must stay
    non-negative: parametrise it (``far_weight=jnp.exp(log_g)``); a head with ``g = 0``
    has chosen the exact parts and gets no gradient.  The masks get no gradient.

    Parameters
    ----------
    q, k, v : jax.Array
        As for :func:`linattn.linear_attention`.
    query_weight, query_bias, key_weight, key_bias, far_weight, tied, scale
        As for :meth:`linattn.FeatureMap.fitted` (``key_*`` absent when ``tied``).
    causal, key_mask, window, sink_keys, exact_key_mask, chunk_size
        As for :func:`linattn.linear_attention`.
    dense : bool, optional
        As for :func:`linattn.torch.fitted_attention`.

    Returns
    -------
    jax.Array
        The attention output, ``(..., L, d_v)``, ``q``'s dtype.

    Examples
    --------
    >>> import jax
    >>> import jax.numpy as jnp
    >>> from linattn.jax import fitted_attention
    >>> w = jnp.tile(jnp.eye(4), (2, 1, 1))  # 2 heads, d = 4, m = 8
    >>> q = k = v = jax.random.normal(jax.random.key(0), (1, 2, 6, 4))
    >>> def loss(w):
    ...     return fitted_attention(q, k, v, w, tied=True, window=2, sink_keys=1).sum()
    >>> jax.jit(jax.grad(loss))(w).shape
    (2, 4, 4)
    """
    static = (
        ("tied", tied), ("scale", scale), ("causal", causal), ("window", window),
        ("sink_keys", sink_keys), ("chunk_size", chunk_size),
    )  # fmt: skip
    given = (query_weight, query_bias, key_weight, key_bias, far_weight, key_mask, exact_key_mask)
    present = tuple(x is not None for x in given)
    arrays = tuple(jnp.asarray(x) for x in (q, k, v, *given) if x is not None)
    _check(static, present, arrays)
    if use_dense(dense, None, q, k):
        q, k, v, *rest = arrays  # as JAX arrays
        values = iter(rest)
        named = {
            name: next(values) if here else None
            for name, here in zip(PARAMETERS + MASKS, present, strict=True)
        }
        dense_out: jax.Array = dense_hybrid(
            q, k, v, named.pop("query_weight"), **named, tied=tied, causal=causal,
            window=window, sink_keys=sink_keys, scale=scale,
        )  # fmt: skip
        return dense_out
    out: jax.Array = _attention(static, present, *arrays)
    return out


def _check(
    static: tuple[tuple[str, Any], ...], present: tuple[bool, ...], arrays: tuple[Any, ...]
) -> None:
    """The argument errors, raised here rather than inside a callback (where JAX wraps
    them): the front door's checks on stand-ins of the inputs' shapes and dtypes, and
    the map's on the parameters' values where they are concrete (under ``jax.jit``, on
    zeros of their shapes: their values are checked when the call runs)."""
    stand_ins = []
    for index, x in enumerate(arrays):
        value = None
        if 3 <= index < 3 + sum(present[: len(PARAMETERS)]):  # a parameter
            with contextlib.suppress(
                jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError
            ):
                value = np.asarray(x)
        if value is None:  # inputs, masks and traced parameters: no data is read
            value = np.broadcast_to(np.zeros((), x.dtype), x.shape)  # no allocation
        stand_ins.append(value)
    (q, k, v), feature_map, options = _host_call(static, present, tuple(stand_ins))
    check_call(q, k, v, feature_map, options)


def _host_call(
    static: tuple[tuple[str, Any], ...], present: tuple[bool, ...], arrays: tuple[Any, ...]
) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], FeatureMap, dict[str, Any]]:
    """Host ``(q, k, v)``, the feature map and the call's options from the arguments."""
    q, k, v, *rest = (np.asarray(x) for x in arrays)
    given = iter(rest)
    named = {
        name: next(given) if here else None
        for name, here in zip(PARAMETERS + MASKS, present, strict=True)
    }
    options = dict(static)
    feature_map = FeatureMap.fitted(
        named["query_weight"], named["query_bias"], key_weight=named["key_weight"],
        key_bias=named["key_bias"], far_weight=named["far_weight"],
        tied=options.pop("tied"), scale=options.pop("scale"),
    )  # fmt: skip
    options.update({name: named[name] for name in MASKS})
    return (q, k, v), feature_map, options


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attention(
    static: tuple[tuple[str, Any], ...], present: tuple[bool, ...], *arrays: jax.Array
) -> jax.Array:
    q, v = arrays[0], arrays[2]
    shape = jax.ShapeDtypeStruct((*q.shape[:-1], v.shape[-1]), q.dtype)

    def forward(*host: Any) -> np.ndarray:
        (q, k, v), feature_map, options = _host_call(static, present, host)
        out = linear_attention(q, k, v, feature_map, **options)
        return np.asarray(out, dtype=shape.dtype)

    out: jax.Array = jax.pure_callback(forward, shape, *arrays, vmap_method="sequential")
    return out


def _attention_forward(
    static: tuple[tuple[str, Any], ...], present: tuple[bool, ...], *arrays: jax.Array
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    return _attention(static, present, *arrays), arrays


def _attention_backward(
    static: tuple[tuple[str, Any], ...],
    present: tuple[bool, ...],
    arrays: tuple[jax.Array, ...],
    grad: jax.Array,
) -> tuple[Any, ...]:
    given = (name for name, here in zip(PARAMETERS + MASKS, present, strict=True) if here)
    names = ("q", "k", "v", *given)
    # Float arguments get cotangents of their own shape and dtype; masks none.
    wanted = [(name, x) for name, x in zip(names, arrays, strict=True) if name not in MASKS]
    shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for _, x in wanted)

    def backward(g: Any, *host: Any) -> tuple[np.ndarray, ...]:
        (q, k, v), feature_map, options = _host_call(static, present, host)
        dq, dk, dv, d_parameters = linear_attention_vjp(
            q, k, v, feature_map, np.asarray(g), parameters=True, **options
        )
        found = {"q": dq, "k": dk, "v": dv, **d_parameters}
        return tuple(
            np.asarray(found[name], dtype=s.dtype).reshape(s.shape)
            if name in found
            else np.zeros(s.shape, s.dtype)  # tied: key_* absent (query_* carry both)
            for (name, _), s in zip(wanted, shapes, strict=True)
        )

    cotangents = iter(jax.pure_callback(backward, shapes, grad, *arrays, vmap_method="sequential"))
    return tuple(None if name in MASKS else next(cotangents) for name in names)


_attention.defvjp(_attention_forward, _attention_backward)
