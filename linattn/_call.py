"""One call of :func:`linattn.linear_attention`, normalised, and what every executor
shares to check and prepare it.

:func:`normalise_call` turns the front door's arguments into one :class:`Call` (grouped
queries as broadcasting views, the feature map and ``scale`` checked, the backend
resolved); :mod:`linattn._plan` chooses who runs it.  The shape, dtype, mask and state
checks run in the executors through :func:`check_attention_inputs` and
:func:`exact_parts_call`, before any work, so every path raises the same errors.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from linattn import _dispatch
from linattn._adjoints import sum_to
from linattn._checks import (
    broadcast_shapes,
    check_attention_inputs,
    check_chunk_size,
    check_map_scale,
    check_scale,
    check_state_options,
    check_statistics_for_causal,
)
from linattn._gqa import group_mask, grouped
from linattn._xp import (
    Array,
    Namespace,
    array_namespace,
    compute_dtype,
    constant,
    dtype_name,
    float_dtype,
    is_array,
    is_traced,
)
from linattn.calibration import Statistics, per_call_statistics
from linattn.features import FeatureMap
from linattn.hybrid import build, parts, paths
from linattn.state import LinearAttentionState

__all__ = [
    "EXACT_FINGERPRINT",
    "Call",
    "CheckedInputs",
    "ExactPartsCall",
    "attention_operands",
    "call_statistics",
    "check_exact_call",
    "check_num_tokens",
    "check_state",
    "drop_masked_keys",
    "exact_parts_call",
    "exact_parts_vjp",
    "grouped_inputs",
    "hybrid_options",
    "normalise_call",
    "state_arrays",
]

#: The fingerprint of states made without a feature map (exact sliding-window attention).
EXACT_FINGERPRINT = "exact"


class Call(NamedTuple):
    """One call of :func:`linattn.linear_attention`, its arguments normalised.

    Grouped queries are broadcasting views already (``ungroup`` restores the caller's
    head layout of the output); ``feature_map`` is a :class:`linattn.FeatureMap` or
    ``None`` with exact parts; ``backend`` is as given (``None``: ``$LINATTN_BACKEND``).
    """

    q: Array
    k: Array
    v: Array
    feature_map: FeatureMap | None
    causal: bool = False
    key_mask: Array | None = None
    state: LinearAttentionState | None = None
    return_state: bool = False
    chunk_size: int | None = None
    backend: Any = None
    window: int | None = None
    sink_keys: Any = 0
    exact_key_mask: Array | None = None
    scale: float | None = None
    ungroup: Callable[[Array], Array] | None = None

    @property
    def exact_parts(self) -> bool:
        """A window, sinks or exact keys asked for, or a state that carries them."""
        return (
            self.window is not None
            or self.sink_keys != 0
            or self.exact_key_mask is not None
            or (self.state is not None and getattr(self.state, "window", None) is not None)
        )

    def options(self) -> dict[str, Any]:
        """The keyword arguments of :func:`linattn.linear_attention` for this call."""
        return {
            "causal": self.causal,
            "key_mask": self.key_mask,
            "state": self.state,
            "return_state": self.return_state,
            "chunk_size": self.chunk_size,
            "backend": self.backend,
            "window": self.window,
            "sink_keys": self.sink_keys,
            "exact_key_mask": self.exact_key_mask,
            "scale": self.scale,
        }


def hybrid_options(**options: Any) -> dict[str, Any]:
    """The hybrid's options that were set (``window``, ``sink_keys``...), for layers that
    pass them on; ``window`` and ``sink_keys`` checked first, as every call checks them
    (a layer made with ``window=0`` dropped it and ran without a window)."""
    build.check_counts(options.get("window"), options.get("sink_keys", 0))
    return {name: value for name, value in options.items() if value not in (None, 0)}


def normalise_call(
    q: Array,
    k: Array,
    v: Array,
    feature_map: FeatureMap | None,
    *,
    causal: bool = False,
    key_mask: Array | None = None,
    state: LinearAttentionState | None = None,
    return_state: bool = False,
    chunk_size: int | None = None,
    backend: Any = None,
    window: int | None = None,
    sink_keys: Any = 0,
    exact_key_mask: Array | None = None,
    scale: float | None = None,
) -> Call:
    """The front door's arguments as one :class:`Call`; raises on what no path takes.

    Examples
    --------
    >>> import numpy as np
    >>> import linattn as la
    >>> x = np.zeros((2, 8, 4, 16))
    >>> call = normalise_call(x, x[:, :2], x[:, :2], la.FeatureMap(16, 32))
    >>> call.q.shape, call.k.shape, call.ungroup is not None
    ((2, 2, 4, 4, 16), (2, 2, 1, 4, 16), True)
    """
    q, k, v, key_mask, ungroup = grouped_inputs(q, k, v, key_mask)
    if ungroup is not None and exact_key_mask is not None and exact_key_mask.ndim >= 2:
        exact_key_mask = group_mask(
            exact_key_mask, int(q.shape[-3]) * int(q.shape[-4]), int(k.shape[-4])
        )
    if ungroup is not None and isinstance(feature_map, FeatureMap):
        feature_map = feature_map.grouped(int(q.shape[-3]), int(k.shape[-4]))
    call = Call(
        q, k, v, feature_map, causal, key_mask, state, return_state, chunk_size, backend,
        window, sink_keys, exact_key_mask, scale, ungroup,
    )  # fmt: skip
    if feature_map is None and not call.exact_parts:
        raise TypeError(
            "feature_map must be a linattn.FeatureMap (None only with window or sink_keys: "
            "exact sparse attention); got None"
        )
    if feature_map is not None and not isinstance(feature_map, FeatureMap):
        raise TypeError(
            f"feature_map must be a linattn.FeatureMap; got {type(feature_map).__name__}"
        )
    _dispatch.resolve_backend(backend)
    build.check_counts(window, sink_keys)  # (before any path: a custom operator's types)
    if feature_map is not None:
        check_map_scale(scale, feature_map.scale)
    return call


def check_call(call: Call) -> None:
    """The front door's argument errors, before any plan or work: the inputs' shapes,
    dtypes and masks, the state's options, ``window`` / ``sink_keys`` /
    ``exact_key_mask``, ``chunk_size`` and ``scale``.  :func:`linattn.plan_attention`
    runs it, and with it every entry point that plans before it runs (the fitted dense
    form), so that a call no path takes never reaches one (an empty sequence reached
    torch's fused attention kernel, which killed the interpreter).  The executors check
    the same as they run, with the same functions."""
    fm = call.feature_map
    info = check_attention_inputs(
        call.q, call.k, call.v, key_mask=call.key_mask, causal=call.causal,
        head_dim=None if fm is None else fm.head_dim,
    )  # fmt: skip
    check_state_options(call.causal, call.state, call.return_state)
    if call.state is not None:
        state_arrays(call.state)  # (a state, or the error naming it)
        check_state(call.state, fm, info, compute_dtype(info.xp, info.dtype))
    build.check_exact_parts(
        call.window, call.sink_keys, call.exact_key_mask, xp=info.xp, causal=call.causal,
        state=call.state, query_length=info.query_length, key_length=info.key_length,
        k=call.k,
    )  # fmt: skip
    if call.chunk_size is not None:
        check_chunk_size(call.chunk_size)
    if call.scale is not None:
        check_scale(call.scale, info.query_head_dim)


def grouped_inputs(
    q: Array, k: Array, v: Array, key_mask: Array | None
) -> tuple[Array, Array, Array, Array | None, Any]:
    """Grouped-query inputs (fewer key/value heads, :mod:`linattn._gqa`) as broadcasting ones.

    Only where the heads differ and the inputs are well formed: anything else passes
    through to the checks, which name what is wrong (a mask of another rank included,
    before its axes could be read as heads).
    """
    q_shape, k_shape = getattr(q, "shape", None), getattr(k, "shape", None)
    if not (  # (cheap tests first: most calls, decoding steps among them, stop here)
        isinstance(q_shape, tuple)
        and isinstance(k_shape, tuple)
        and len(q_shape) == len(k_shape) >= 3
        and q_shape[-3] != k_shape[-3]
    ):
        return q, k, v, key_mask, None
    if (
        all(is_array(x) for x in (q, k, v))
        and v.ndim == q.ndim
        and 1 not in (q.shape[-3], k.shape[-3])  # one head (or grouped already) broadcasts
        and q.shape[-3] % k.shape[-3] == 0  # else the batch check names the shapes
        and (key_mask is None or getattr(key_mask, "ndim", None) in (1, k.ndim - 1))
    ):
        return grouped(q, k, v, key_mask)
    return q, k, v, key_mask, None


def state_arrays(state: object) -> dict[str, Array]:
    if not isinstance(state, LinearAttentionState):
        raise TypeError(
            f"state must be a LinearAttentionState from linear_attention(..., "
            f"return_state=True); got {type(state).__name__}"
        )
    return {"state.kv": state.kv, "state.log_shift": state.log_shift}


def check_state(
    state: LinearAttentionState, feature_map: FeatureMap | None, info: Any, work: Any
) -> tuple[int, ...]:
    """Check a state against the feature map and inputs; return the new batch shape."""
    fingerprint = EXACT_FINGERPRINT if feature_map is None else feature_map.fingerprint
    if state.feature_map != fingerprint:
        raise ValueError(
            "state was made by another feature map: expected one with fingerprint "
            f"{fingerprint} (this call's feature_map), got {state.feature_map}"
        )
    check_num_tokens(state.num_tokens)
    m = 0 if feature_map is None else feature_map.num_features
    width = info.value_dim + 1
    if state.kv.ndim < 2 or tuple(state.kv.shape[-2:]) != (m, width):
        raise ValueError(
            f"state.kv must have shape (..., {m}, {width}) for {m} features and value "
            f"dimension {info.value_dim}; got shape {tuple(state.kv.shape)}"
        )
    if tuple(state.log_shift.shape) != tuple(state.kv.shape[:-1]):
        raise ValueError(
            f"state.log_shift must have shape {tuple(state.kv.shape[:-1])}; got "
            f"{tuple(state.log_shift.shape)}"
        )
    if state.kv.dtype != work or state.log_shift.dtype != work:
        raise TypeError(
            f"state must hold {dtype_name(work)} arrays for these inputs; got kv "
            f"{state.kv.dtype}, "
            f"log_shift {state.log_shift.dtype}"
        )
    return broadcast_shapes({"inputs": info.batch_shape, "state": tuple(state.kv.shape[:-2])})


def check_num_tokens(count: Any) -> None:
    """A non-negative integer, or a 0-d integer array (a JAX pytree leaf).

    Its value is checked only where it is known: under tracing it is not.
    """
    if is_array(count):
        xp = array_namespace(count)
        if count.ndim == 0 and xp.isdtype(count.dtype, "integral"):
            if not is_traced(count) and int(count) < 0:
                raise TypeError(
                    f"state.num_tokens must be a non-negative integer; got {int(count)}"
                )
            return
    elif not isinstance(count, bool) and isinstance(count, int | np.integer) and count >= 0:
        return
    raise TypeError(f"state.num_tokens must be a non-negative integer; got {count!r}")


class ExactPartsCall(NamedTuple):
    """A checked call with exact parts: its inputs, parts and new state caches."""

    info: Any
    exact: build.ExactParts
    parts: list[parts.Part]
    fields: dict[str, Any]
    batch: tuple[int, ...]
    keep: Array


class CheckedInputs(NamedTuple):
    """A call with exact parts, checked: its inputs in the working dtype, broadcast to
    the batch shape (masked keys zeroed), and its options' checked values."""

    info: Any
    exact: build.ExactParts
    q: Array
    k: Array
    v: Array
    keep: Array
    batch: tuple[int, ...]
    scale: float
    statistics: Statistics | None
    chunk_size: int


def check_exact_call(
    q: Array,
    k: Array,
    v: Array,
    feature_map: FeatureMap | None,
    *,
    causal: bool,
    key_mask: Array | None,
    state: LinearAttentionState | None,
    return_state: bool,
    chunk_size: int | None,
    plan: _dispatch.Plan,
    window: int | None,
    sink_keys: int,
    exact_key_mask: Array | None,
    scale: float | None,
    extra: dict[str, Array] | None = None,
) -> CheckedInputs:
    """Check a call with exact parts (every executor of one raises the same errors)."""
    extra = dict(extra or {})
    if state is not None:
        extra.update(state_arrays(state))
    if exact_key_mask is not None:
        extra["exact_key_mask"] = exact_key_mask
    head_dim = None if feature_map is None else feature_map.head_dim
    info = check_attention_inputs(
        q, k, v, key_mask=key_mask, causal=causal, head_dim=head_dim, extra=extra
    )
    chunk_size = _dispatch.chunk_size_for(plan, chunk_size, q, k, v)
    check_state_options(causal, state, return_state)
    xp = info.xp
    exact = build.check_exact_parts(
        window,
        sink_keys,
        exact_key_mask,
        xp=xp,
        causal=causal,
        state=state,
        query_length=info.query_length,
        key_length=info.key_length,
        k=k,
    )
    assert exact is not None
    if feature_map is None:
        scale = check_scale(scale, info.query_head_dim)
    else:
        scale = check_map_scale(scale, feature_map.scale)
    work = compute_dtype(xp, info.dtype)
    q, k, v = (xp.astype(x, work, copy=False) for x in (q, k, v))
    k, v = drop_masked_keys(xp, k, v, key_mask)
    batch = info.batch_shape
    if state is not None:
        batch = check_state(state, feature_map, info, work)
    statistics = None
    if feature_map is not None:
        statistics = call_statistics(xp, feature_map, q, k, key_mask, causal=causal)
    lq, lk = info.query_length, info.key_length
    q = xp.broadcast_to(q, (*batch, lq, info.query_head_dim))
    k = xp.broadcast_to(k, (*batch, lk, info.query_head_dim))
    v = xp.broadcast_to(v, (*batch, lk, info.value_dim))
    if key_mask is None:
        keep = xp.ones((*batch, lk), dtype=xp.bool, device=info.device)
    else:
        keep = xp.broadcast_to(key_mask, (*batch, lk))
    return CheckedInputs(info, exact, q, k, v, keep, batch, scale, statistics, chunk_size)


def exact_parts_call(
    q: Array, k: Array, v: Array, feature_map: FeatureMap | None, *, plan: _dispatch.Plan,
    **options: Any,
) -> ExactPartsCall:  # fmt: skip
    """Check a call with exact parts and build its parts (shared with the VJP);
    ``options`` are :func:`check_exact_call`'s."""
    c = check_exact_call(q, k, v, feature_map, plan=plan, **options)
    causal, state = options["causal"], options["state"]
    fields: dict[str, Any] = {}
    xp = c.info.xp
    # Without a state in or out, the window and sinks need not reach beyond the keys.
    exact = (
        c.exact
        if state is not None or options["return_state"]
        else c.exact.within(c.info.key_length)
    )
    if causal:
        found, fields = build.causal_parts(
            xp, c.q, c.k, c.v, c.keep, exact, feature_map, state, scale=c.scale,
            statistics=c.statistics, chunk_size=c.chunk_size, plan=plan,
        )  # fmt: skip
    else:
        found = build.bidirectional_parts(
            xp, c.q, c.k, c.v, c.keep, exact, feature_map, scale=c.scale,
            statistics=c.statistics, chunk_size=c.chunk_size, plan=plan,
        )  # fmt: skip
    return ExactPartsCall(c.info, c.exact, found, fields, c.batch, c.keep)


def attention_operands(
    q: Array,
    k: Array,
    v: Array,
    feature_map: FeatureMap,
    info: Any,
    batch: tuple[int, ...],
    key_mask: Array | None,
    work: Any,
    statistics: Statistics | None = None,
) -> tuple[Array, Array | None, Array, Array | None, Array]:
    """What the attention algorithms take, broadcast to ``batch``.

    ``(log phi(Q), sign, log phi(K), sign, [V | 1])``: masked keys get log-feature
    ``-inf`` (masks act on key features, never on raw keys or only on values).
    """
    xp = info.xp
    m = feature_map.num_features
    feature_map = feature_map.far_cancelled()  # (no exact parts here: a far weight cancels)
    log_phi_q, sign_q = feature_map.signed_log_features(q, role="query", statistics=statistics)
    log_phi_k, sign_k = feature_map.signed_log_features(k, role="key", statistics=statistics)
    if key_mask is not None:
        log_phi_k = xp.where(key_mask[..., None], log_phi_k, constant(xp, -math.inf, log_phi_k))
    values_aug = xp.astype(v, work)
    values_aug = xp.concat([values_aug, xp.ones_like(values_aug[..., :1])], axis=-1)

    def full(x: Array | None, length: int, width: int) -> Array | None:
        return None if x is None else xp.broadcast_to(x, (*batch, length, width))

    lq, lk = info.query_length, info.key_length
    return (
        full(log_phi_q, lq, m),
        full(sign_q, lq, m),
        full(log_phi_k, lk, m),
        full(sign_k, lk, m),
        full(values_aug, lk, info.value_dim + 1),
    )


def call_statistics(
    xp: Namespace,
    feature_map: FeatureMap,
    q: Array,
    k: Array,
    key_mask: Array | None,
    *,
    causal: bool,
) -> Statistics | None:
    """The statistics an uncalibrated map needs, from this call's queries and keys.

    Computed on the caller's device and held constant (``stop_gradient``), so they work
    under ``jax.jit`` and give the gradients of fixed statistics; never stored in the map.
    Causal attention refuses: statistics over the sequence would let later tokens change
    earlier outputs.  In self-attention (``L_q == L_k``) ``key_mask`` also leaves padded
    query rows out.
    """
    check_statistics_for_causal(feature_map.kind, feature_map.needs_calibration, causal)
    if not feature_map.needs_calibration:
        return None
    root = math.sqrt(feature_map.scale)
    # Self-attention: the key mask marks padded positions, so padded query rows too.
    query_mask = key_mask if q.shape[-2] == k.shape[-2] else None
    return per_call_statistics(
        xp,
        q * root,
        k * root,
        key_mask,
        rebalance=feature_map.rebalance_scales is None and feature_map.rebalance,
        oprf=feature_map.oprf_a is None and feature_map.spec.oprf,
        query_mask=query_mask,
    )


def drop_masked_keys(
    xp: Namespace, k: Array, v: Array, key_mask: Array | None
) -> tuple[Array, Array]:
    """Zeros for the keys and values of masked keys, before anything is computed.

    Padding may hold anything: a masked key's zero weight times a NaN or inf in its
    padding would still be NaN.  (The mask itself acts on key features: masked keys'
    log-features are ``-inf`` in :func:`attention_operands` and the kernels.)
    """
    if key_mask is None:
        return k, v
    keep = key_mask[..., None]
    return xp.where(keep, k, constant(xp, 0.0, k)), xp.where(keep, v, constant(xp, 0.0, v))


def exact_parts_vjp(
    q: Array,
    k: Array,
    v: Array,
    feature_map: FeatureMap | None,
    grad_output: Array,
    *,
    plan: _dispatch.Plan,
    parameters: dict[str, Any] | None = None,
    **options: Any,
) -> tuple[Array, Array, Array]:
    """``(dq, dk, dv)`` of a call with exact parts: each part's adjoint
    (:func:`linattn.hybrid.paths.parts_vjp`), the far keys on ``plan``'s scan; shaped and
    typed like ``q``, ``k`` and ``v``.  ``options`` are the call's (no state); a fitted
    map's parameter cotangents are added to ``parameters`` where given."""
    call = exact_parts_call(
        q,
        k,
        v,
        feature_map,
        state=None,
        return_state=False,
        plan=plan,
        extra={"grad_output": grad_output},
        **options,
    )
    info, xp = call.info, call.info.xp
    float_dtype(xp, "grad_output", grad_output)
    shape = (*call.batch, info.query_length, info.value_dim)
    if tuple(grad_output.shape) != shape:
        raise ValueError(
            f"grad_output must have the output's shape {shape}; got {tuple(grad_output.shape)}"
        )
    work = compute_dtype(xp, info.dtype)
    dq, dk, dv = paths.parts_vjp(
        xp, call.parts, xp.astype(grad_output, work, copy=False), parameters
    )
    keep = call.keep[..., None]  # masked keys were zeroed before anything was computed
    inputs = {"q": q, "k": k, "v": v}
    grads = {"q": dq, "k": dk, "v": dv}
    out = []
    for name in ("q", "k", "v"):
        g, x = grads[name], inputs[name]
        if g is None:
            g = xp.zeros((*call.batch, *x.shape[-2:]), dtype=work, device=info.device)
        elif name != "q":
            g = xp.where(keep, g, constant(xp, 0.0, g))
        out.append(sum_to(xp, g, tuple(x.shape), x.dtype))
    return out[0], out[1], out[2]
