"""A fitted map's call with its parameters as arrays: the checks, the one decision
between the dense form and the library's path, and the dense form itself.

:func:`linattn.torch.fitted_attention` and :func:`linattn.jax.fitted_attention` take a
fitted map's parameters as the framework's arrays, differentiable.  Two ways compute it:

- the library's path: :func:`linattn.linear_attention` forward (compiled kernels where
  they serve) and :func:`linattn.linear_attention_vjp` with ``parameters=True`` backward,
  on host copies (``O(L)`` memory, the fastest from about 300 tokens on);
- :func:`dense_hybrid`: the same hybrid as ``L x L`` weights per head in the caller's
  array library, differentiated by the framework itself (no host round trip: on the
  caller's device, traceable by ``jax.jit`` and ``torch.compile``; faster up to a few
  hundred tokens, where the library's parameter cotangents run the array-API adjoint:
  ``benchmarks/refine_attention_speed.py``).

:func:`use_dense` is the one place that chooses.  Both compute ``(N_near + g N_far) /
(D_near + g D_far)`` with the fitted map of :mod:`linattn.fitted` (a test holds them
equal, gradients included).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from typing import Any, Literal

import numpy as np

from linattn._gqa import grouped
from linattn._plan import plan_attention
from linattn._xp import (
    Array,
    array_device,
    constant,
    is_array,
    namespace_of,
    softmax,
    untraced,
)
from linattn.features import FeatureMap
from linattn.fitted import check_values
from linattn.hybrid import dense
from linattn.hybrid.dense import hybrid_from_features, near_and_far
from linattn.hybrid.dense import why_not as dense_why_not

__all__ = [
    "DENSE_MAX_LENGTH",
    "check_call",
    "check_dense_call",
    "dense_hybrid",
    "use_dense",
]

#: The longest self-attention the dense form computes when the caller leaves the choice
#: (``dense=None``): :data:`linattn.hybrid.dense.MAX_LENGTH`'s ``"parameters"`` entry,
#: where it is measured.
DENSE_MAX_LENGTH = dense.MAX_LENGTH["parameters"]


def use_dense(dense: object, backend: object, q: Any, k: Any) -> bool:
    """Whether a fitted call runs :func:`dense_hybrid` (else the library's path).

    ``dense=None`` chooses the dense form for self-attention of at most
    :data:`DENSE_MAX_LENGTH` tokens when no ``backend`` is named (the limit of
    :func:`linattn.hybrid.dense.why_not`, which decides for the plan too); ``True`` / ``False``
    force it (``True`` takes no ``backend``: the caller's framework computes it).
    """
    if dense is not None and not isinstance(dense, bool):
        raise TypeError(f"dense must be None, True or False; got {dense!r}")
    if dense and backend is not None:
        raise ValueError(
            f"dense=True computes in the caller's array library: backend must be None; got "
            f"backend={backend!r}"
        )
    if dense is not None:
        return dense
    lengths = (q.shape[-2], k.shape[-2])
    return backend is None and dense_why_not(False, "parameters", *lengths) is None


def check_call(q: Any, k: Any, v: Any, feature_map: FeatureMap, options: dict[str, Any]) -> None:
    """The argument errors of a fitted call, before anything runs: the front door's
    (shapes, masks, options; :func:`linattn.plan_attention`) and the map's heads against
    the inputs' (on one token: cheap; again on all of them for the message)."""
    plan_attention(q, k, v, feature_map, **options)
    roles: tuple[tuple[Any, Literal["query", "key"]], ...] = ((q, "query"), (k, "key"))
    for x, role in roles:
        try:
            feature_map.log_features(x[..., :1, :], role=role)
        except ValueError:
            feature_map.log_features(x, role=role)  # the error, naming the inputs' shape
            raise


#: Structures :func:`check_dense_call` has checked (bounded: cleared when full).
_CHECKED: dict[Hashable, None] = {}
_CHECKED_MAX = 256


def check_dense_call(
    q: Any, k: Any, v: Any, parameters: Mapping[str, Any], tied: bool, scale: float | None,
    options: dict[str, Any],
) -> None:  # fmt: skip
    """:func:`check_call` for the dense form, which needs no host copy of the map:
    the structure (every shape, dtype, device and option) is checked once, on a stand-in
    map of zeros of the parameters' shapes, and remembered; the values are checked on
    every call in the parameters' own array library (:func:`linattn.fitted.check_values`).

    ``parameters`` maps :data:`linattn.jax.PARAMETERS` names to arrays, numbers or None.
    """
    present = {name: x for name, x in parameters.items() if x is not None}
    key = _structure(q, k, v, present, tied, scale, options)
    if key is None or key not in _CHECKED:
        untraced(_check_structure, q, k, v, present, tied, scale, options, key)
    for name, x in present.items():
        if is_array(x):
            check_values(namespace_of({name: x}), name, x)
        else:
            check_values(np, name, np.asarray(x, dtype=np.float64))


def _check_structure(
    q: Any, k: Any, v: Any, parameters: Mapping[str, Any], tied: bool, scale: float | None,
    options: dict[str, Any], key: Hashable | None,
) -> None:  # fmt: skip
    """:func:`check_call` on a stand-in map of zeros of the parameters' shapes; the
    structure remembered under ``key`` once it passes."""
    stand_ins = {
        name: namespace_of({name: x}).zeros_like(x) if is_array(x) else np.zeros(np.shape(x))
        for name, x in parameters.items()
    }
    stand_in = FeatureMap.fitted(
        stand_ins.pop("query_weight", None), **stand_ins, tied=tied, scale=scale
    )
    check_call(q, k, v, stand_in, options)
    if key is not None:
        if len(_CHECKED) >= _CHECKED_MAX:
            _CHECKED.clear()
        _CHECKED[key] = None


def _structure(
    q: Any, k: Any, v: Any, parameters: Mapping[str, Any], tied: bool, scale: float | None,
    options: dict[str, Any],
) -> Hashable | None:  # fmt: skip
    """What :func:`check_call`'s verdict depends on, hashable; None where an argument is
    neither an array nor a hashable value (then the call is checked in full)."""

    def signature(x: Any, value: bool) -> Hashable:
        if is_array(x):
            return (type(x), tuple(x.shape), str(x.dtype), str(array_device(x)))
        if not value:  # a parameter given as a number or list: its values are checked apart
            return (type(x), np.shape(x))
        hash(x)
        return (type(x), x)

    try:
        return (
            tuple(signature(x, True) for x in (q, k, v)),
            tuple(sorted((name, signature(x, False)) for name, x in parameters.items())),
            tied, scale,
            tuple(sorted((name, signature(x, True)) for name, x in options.items())),
        )  # fmt: skip
    except (TypeError, ValueError):  # unhashable, or a ragged list
        return None


def dense_hybrid(
    q: Array,
    k: Array,
    v: Array,
    query_weight: Array,
    query_bias: Array | None = None,
    *,
    key_weight: Array | None = None,
    key_bias: Array | None = None,
    far_weight: Array | float | None = None,
    tied: bool = False,
    causal: bool = False,
    key_mask: Array | None = None,
    window: int | None = None,
    sink_keys: int = 0,
    exact_key_mask: Array | None = None,
    scale: float | None = None,
) -> Array:
    """The fitted hybrid of a self-attention call, dense and differentiable in everything
    by the caller's framework (arguments checked by :func:`check_call` first).

    ``out_i = softmax_j(s q_i.k_j on near keys; log(g phi(q_i).phi(k_j)) on far ones)
    v_j``, computed as the near and far parts merged
    (:func:`linattn.hybrid.dense.hybrid_from_features`): near keys are the window, the
    sinks and the exact keys, far keys every other real (and, causal, past) key; a head
    with ``g = 0`` keeps its near keys alone (and ``g`` gets no gradient there; without a
    window, sinks or exact keys ``g`` cancels, as in the library); a query that sees no
    key outputs zeros.  A head whose ``g`` is negative or NaN outputs NaN (its callers
    refuse such values first where they can read them; under ``jax.jit`` they cannot).
    Parameters are cast to ``q``'s dtype (their gradients come back in their own).

    Parameters
    ----------
    q, k, v, query_weight, query_bias, key_weight, key_bias, far_weight, tied, causal,
    key_mask, window, sink_keys, exact_key_mask, scale
        As for :func:`linattn.torch.fitted_attention`; ``L_q == L_k``.

    Returns
    -------
    array, shape ``(..., H, L, d_v)``
        In ``q``'s dtype and namespace.

    Examples
    --------
    >>> import numpy as np
    >>> import linattn as la
    >>> from linattn._fitted_call import dense_hybrid
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.normal(size=(1, 2, 6, 4)) for _ in range(3))
    >>> w = rng.normal(size=(2, 4, 2))
    >>> fm = la.FeatureMap.fitted(w, tied=True, far_weight=0.5)
    >>> out = dense_hybrid(q, k, v, w, tied=True, far_weight=0.5, window=2, sink_keys=1)
    >>> bool(np.allclose(out, la.linear_attention(q, k, v, fm, window=2, sink_keys=1)))
    True
    """
    xp = namespace_of({"q": q, "k": k, "v": v})
    dtype, length, device = q.dtype, q.shape[-2], array_device(q)
    gq, gk, gv, g_mask, ungroup = grouped(q, k, v, key_mask)
    exact = None if exact_key_mask is None else grouped(q, k, v, exact_key_mask)[3]
    grouping = gq.ndim > q.ndim  # q (..., H_kv, G, L, d), k and v (..., H_kv, 1, L, .)
    if g_mask is not None:  # padding is inert: a padded key's NaN or inf reaches no row
        real = g_mask[..., None]
        gk = xp.where(real, gk, xp.zeros_like(gk))
        gv = xp.where(real, gv, xp.zeros_like(gv))

    def cast(x: Any) -> Any:
        if x is None:
            return None
        return xp.astype(x if is_array(x) else xp.asarray(x, device=device), dtype)

    def phi(x: Array, weight: Array, bias: Array | None, group: int) -> Array:
        if grouping and weight.ndim == 3:  # per head, (H', d, m/2): (H' / group, group, ...)
            weight = xp.reshape(weight, (weight.shape[0] // group, group, *weight.shape[1:]))
            if bias is not None and bias.ndim == 2:
                bias = xp.reshape(bias, (bias.shape[0] // group, group, bias.shape[-1]))
        u = xp.matmul(x, weight)
        if bias is not None:
            u = u + bias[..., None, :]
        return softmax(xp, xp.concat([u, -u], axis=-1))

    wq, bq = cast(query_weight), cast(query_bias)
    wk, bk = (wq, bq) if tied else (cast(key_weight), cast(key_bias))
    phi_q = phi(gq, wq, bq, gq.shape[-3] if grouping else 1)
    phi_k = phi(gk, wk, bk, 1)
    g = cast(1.0 if far_weight is None else far_weight)
    if g.ndim:  # one per key head: against (..., H_kv, [G,] L)
        g = xp.reshape(g, (g.shape[0],) + (1,) * (2 if grouping else 1))
    # A negative or NaN g (values only a traced call cannot check first): NaN outputs.
    valid = g >= 0
    if window is not None or sink_keys > 0 or exact_key_mask is not None:
        # g = 0: no far keys (and no gradient for g)
        positive = xp.where(g > 0, g, xp.ones_like(g))
        log_g = xp.where(g > 0, xp.log(positive), constant(xp, -math.inf, g))
    else:  # without exact parts g cancels: the map is all there is (g's gradient is 0)
        log_g = xp.where(xp.isfinite(g), g * 0, xp.zeros_like(g))
    near, far = near_and_far(
        xp, length, device, causal=causal, window=window, sink_keys=sink_keys,
        real=None if g_mask is None else g_mask[..., None, :],
        exact=None if exact is None else exact[..., None, :],
    )  # fmt: skip
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = hybrid_from_features(xp, gq, gk, gv, phi_q, phi_k, log_g, near, far, scale)
    if valid.ndim:
        valid = valid[..., None]  # against (..., L, d_v)
    return ungroup(xp.where(valid, out, constant(xp, math.nan, out)))
