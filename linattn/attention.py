"""The front door: exact softmax attention, linear attention, and one-line FAVOR+.

Arrays go in and come out in the caller's namespace and on the caller's device.
Inputs are checked once, here, before anything is computed.
"""

from __future__ import annotations

import math
from typing import Any, Literal, NamedTuple, overload

import array_api_compat
import numpy as np

from linattn import _decode, _dispatch, hybrid
from linattn import causal as causal_path
from linattn._checks import (
    check_attention_inputs,
    check_scale,
    check_state_options,
    check_statistics_for_causal,
)
from linattn._dispatch import Backend
from linattn._gqa import group_mask, grouped
from linattn._xp import Array, Namespace, compute_dtype, constant, dtype_name, from_host
from linattn.calibration import Statistics, per_call_statistics
from linattn.features import FeatureMap, Kind
from linattn.state import LinearAttentionState, empty_state

__all__ = ["favor_attention", "linear_attention", "softmax_attention"]

DEFAULT_CHUNK_SIZE = _dispatch.DEFAULT_CHUNK_SIZE

#: The fingerprint of states made without a feature map (exact sliding-window attention).
EXACT_FINGERPRINT = "exact"


def softmax_attention(
    q: Array,
    k: Array,
    v: Array,
    /,
    *,
    causal: bool = False,
    key_mask: Array | None = None,
    scale: float | None = None,
) -> Array:
    """Exact softmax attention ``softmax(s q k^T) v``, computed stably (the reference).

    Parameters
    ----------
    q : array, shape ``(..., L_q, d)``
    k : array, shape ``(..., L_k, d)``
    v : array, shape ``(..., L_k, d_v)``
        Leading dimensions broadcast.  Half-precision inputs are computed in float32.
    causal : bool, default False
        Query ``i`` attends to keys ``j <= i`` (needs ``L_q == L_k``).
    key_mask : boolean array, shape ``(..., L_k)``, optional
        True for keys that take part.  A query that sees no key gets zeros.
    scale : float, optional
        Logit scale ``s``; default ``1 / sqrt(d)``.

    Returns
    -------
    array, shape ``(..., L_q, d_v)``
        In the inputs' namespace, device and (promoted) dtype.

    Examples
    --------
    >>> import numpy as np
    >>> import linattn as la
    >>> q = k = v = np.eye(3)
    >>> la.softmax_attention(q, k, v, causal=True)[0]
    array([1., 0., 0.])
    """
    q, k, v, key_mask, ungroup = _grouped(q, k, v, key_mask)
    if ungroup is not None:
        return ungroup(softmax_attention(q, k, v, causal=causal, key_mask=key_mask, scale=scale))
    info = check_attention_inputs(q, k, v, key_mask=key_mask, causal=causal, head_dim=None)
    xp = info.xp
    scale = check_scale(scale, q.shape[-1])
    work = compute_dtype(xp, info.dtype)
    q, k, v = (xp.astype(a, work) for a in (q, k, v))
    k, v = drop_masked_keys(xp, k, v, key_mask)
    logits = xp.matmul(q, xp.matrix_transpose(k)) * scale
    visible = None
    if causal:
        n = info.query_length
        visible = from_host(
            xp, np.tril(np.ones((n, n), dtype=bool)), dtype=xp.bool, device=info.device
        )
    if key_mask is not None:
        keys = key_mask[..., None, :]
        visible = keys if visible is None else xp.logical_and(visible, keys)
    if visible is not None:
        logits = xp.where(visible, logits, constant(xp, -math.inf, logits))
    row_max = xp.max(logits, axis=-1, keepdims=True)
    row_max = xp.where(xp.isfinite(row_max), row_max, constant(xp, 0.0, row_max))
    weights = xp.exp(logits - row_max)
    den = xp.sum(weights, axis=-1, keepdims=True)
    den = xp.where(den == 0, constant(xp, 1.0, den), den)
    return xp.astype(xp.matmul(weights / den, v), info.dtype, copy=False)


@overload
def linear_attention(
    q: Array,
    k: Array,
    v: Array,
    /,
    feature_map: FeatureMap | None,
    *,
    causal: bool = ...,
    key_mask: Array | None = ...,
    state: LinearAttentionState | None = ...,
    return_state: Literal[False] = ...,
    chunk_size: int | None = ...,
    backend: Backend | None = ...,
    window: int | None = ...,
    sink_keys: int = ...,
    exact_key_mask: Array | None = ...,
    scale: float | None = ...,
) -> Array: ...
@overload
def linear_attention(
    q: Array,
    k: Array,
    v: Array,
    /,
    feature_map: FeatureMap | None,
    *,
    causal: bool = ...,
    key_mask: Array | None = ...,
    state: LinearAttentionState | None = ...,
    return_state: Literal[True],
    chunk_size: int | None = ...,
    backend: Backend | None = ...,
    window: int | None = ...,
    sink_keys: int = ...,
    exact_key_mask: Array | None = ...,
    scale: float | None = ...,
) -> tuple[Array, LinearAttentionState]: ...
def linear_attention(
    q: Array,
    k: Array,
    v: Array,
    /,
    feature_map: FeatureMap | None,
    *,
    causal: bool = False,
    key_mask: Array | None = None,
    state: LinearAttentionState | None = None,
    return_state: bool = False,
    chunk_size: int | None = None,
    backend: Backend | None = None,
    window: int | None = None,
    sink_keys: int = 0,
    exact_key_mask: Array | None = None,
    scale: float | None = None,
) -> Array | tuple[Array, LinearAttentionState]:
    """Linear attention ``phi(Q) (phi(K)^T [V | 1])``, normalised, in O(L) time and memory.

    With a random feature map this estimates softmax attention without bias in each
    kernel value; all stabilisation happens on log-features, so nothing overflows and
    no epsilon biases the result.  Causal attention runs chunk by chunk with a
    per-feature running maximum that never looks at future tokens: earlier outputs
    do not change, bit for bit, when later tokens do.

    Parameters
    ----------
    q : array, shape ``(..., L_q, d)``
    k : array, shape ``(..., L_k, d)``
    v : array, shape ``(..., L_k, d_v)``
        Leading dimensions (batch, heads) broadcast.  float32 and float64; float16 and
        bfloat16 inputs are computed with float32 state and returned in their dtype.
    feature_map : FeatureMap or None
        The features; ``feature_map.head_dim`` must equal ``d``.  ``None`` with a
        ``window`` or ``sink_keys`` is exact sparse attention (sliding window plus sinks):
        far keys are dropped instead of estimated.
    causal : bool, default False
        Query ``i`` attends to keys ``j <= i`` (needs ``L_q == L_k``).
    key_mask : boolean array, shape ``(L_k,)`` or ``k.ndim - 1`` axes, optional
        True for keys that take part.  Masking acts on key *features*, so padded keys
        drop out of numerator and denominator alike.  A query that sees no key gets zeros.
        Its leading axes broadcast with the batch axes of ``k``: a ``(B, L)`` padding
        mask of ``(B, H, L, d)`` keys is given as ``key_mask[:, None, :]`` (any other
        rank raises).  In self-attention (``L_q == L_k``) it also marks the queries
        that enter an uncalibrated map's statistics.
    state : LinearAttentionState, optional
        Continue a causal sequence from a state returned by an earlier call.
    return_state : bool, default False
        Also return the state after the last token (causal only).
    chunk_size : int, optional
        Tokens per chunk of the causal algorithm; results do not depend on it beyond
        rounding.  By default the path's own: 32 on the Numba CPU kernels' forward
        passes, 64 elsewhere and whenever torch will differentiate the call
        (``linattn._dispatch.chunk_size_for``; ``docs/performance.md``).
    backend : {"auto", "numba", "array_api"}, optional
        Who runs causal attention; default ``$LINATTN_BACKEND`` or ``"auto"`` (the
        compiled kernel where it can serve the arrays).
    window : int, optional
        Exact attention, weight ``exp(s q.k)``, to the keys within ``window`` positions
        (causal ``t - w < j <= t``; bidirectional ``|t - j| < w``); the feature map
        estimates only the keys beyond (``linattn.hybrid``).  Needs ``L_q == L_k``
        or a causal state.
    sink_keys : int, default 0
        The first ``sink_keys`` positions are attended exactly by every query (causal:
        those ``<= t``); a masked sink is dropped, not replaced.
    exact_key_mask : boolean array, optional
        Bidirectional only: further keys every query attends exactly (a BERT model's
        ``[CLS]`` and ``[SEP]``), shaped like ``key_mask``.
    scale : float, optional
        Logit scale of the exact parts when ``feature_map`` is None (default
        ``1 / sqrt(d)``); with a feature map it is the map's and may only repeat it.

    Returns
    -------
    array, shape ``(..., L_q, d_v)``, or ``(array, LinearAttentionState)``
        In the inputs' namespace, device and dtype.

    Examples
    --------
    >>> import numpy as np
    >>> import linattn as la
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (0.3 * rng.normal(size=(2, 128, 32)) for _ in range(3))
    >>> fm = la.FeatureMap(32, 256, kind="hyperbolic", seed=0)
    >>> out = la.linear_attention(q, k, v, fm, causal=True)
    >>> exact = la.softmax_attention(q, k, v, causal=True)
    >>> print(f"mean squared error {np.mean((out - exact) ** 2):.0e}")
    mean squared error 6e-06
    """
    q, k, v, key_mask, ungroup = _grouped(q, k, v, key_mask)
    if ungroup is not None:  # grouped-query attention: broadcasting, no copies
        if exact_key_mask is not None and exact_key_mask.ndim >= 2:
            exact_key_mask = group_mask(
                exact_key_mask, int(q.shape[-3]) * int(q.shape[-4]), int(k.shape[-4])
            )
        result: Any = linear_attention(  # type: ignore[call-overload,misc]
            q,
            k,
            v,
            feature_map,
            causal=causal,
            key_mask=key_mask,
            state=state,
            return_state=return_state,
            chunk_size=chunk_size,
            backend=backend,
            window=window,
            sink_keys=sink_keys,
            exact_key_mask=exact_key_mask,
            scale=scale,
        )
        return (ungroup(result[0]), result[1]) if return_state else ungroup(result)
    hybrid_asked = window is not None or sink_keys != 0 or exact_key_mask is not None
    if state is not None and not hybrid_asked:
        # A decoding step (a few tokens after a state): cheap exact checks and one kernel
        # call; None where it does not apply, and the general path below runs (and
        # raises any error, so errors read the same).
        fast = _decode.decode(
            q,
            k,
            v,
            feature_map,
            causal=causal,
            key_mask=key_mask,
            state=state,
            return_state=return_state,
            chunk_size=chunk_size,
            backend=backend,
        )
        if fast is not None:
            return fast
    if feature_map is None and not hybrid_asked:
        raise TypeError(
            "feature_map must be a linattn.FeatureMap (None only with window or sink_keys: "
            "exact sparse attention); got None"
        )
    if feature_map is not None and not isinstance(feature_map, FeatureMap):
        raise TypeError(
            f"feature_map must be a linattn.FeatureMap; got {type(feature_map).__name__}"
        )
    plan = _dispatch.causal_plan(q, feature_map, backend=backend)
    if hybrid_asked or (state is not None and getattr(state, "window", None) is not None):
        return _exact_parts_attention(
            q,
            k,
            v,
            feature_map,
            causal=causal,
            key_mask=key_mask,
            state=state,
            return_state=return_state,
            chunk_size=chunk_size,
            plan=plan,
            window=window,
            sink_keys=sink_keys,
            exact_key_mask=exact_key_mask,
            scale=scale,
        )
    assert feature_map is not None  # None without exact parts raised above
    if scale is not None and scale != feature_map.scale:
        raise ValueError(
            f"scale is the feature map's ({feature_map.scale}) when one is given; got {scale}"
        )
    if plan.path == "dask-scan":
        # The sequence-parallel graph: it grows with q's sequence chunks, not L / chunk_size;
        # it runs the checks below itself, after wrapping a NumPy state in Dask.
        from linattn.distributed import dask_linear_attention

        return dask_linear_attention(
            q,
            k,
            v,
            feature_map,
            causal=causal,
            key_mask=key_mask,
            state=state,
            return_state=return_state,
            chunk_size=chunk_size,
            backend=backend,
        )
    extra = {} if state is None else _state_arrays(state)
    info = check_attention_inputs(
        q, k, v, key_mask=key_mask, causal=causal, head_dim=feature_map.head_dim, extra=extra
    )
    chunk_size = _dispatch.chunk_size_for(plan, chunk_size, q, k, v)
    check_state_options(causal, state, return_state)
    xp = info.xp
    work = compute_dtype(xp, info.dtype)
    q, k, v = (xp.astype(x, work, copy=False) for x in (q, k, v))  # one compute dtype
    k, v = drop_masked_keys(xp, k, v, key_mask)
    batch = info.batch_shape
    if state is not None:
        hybrid.check_exact_parts(
            None, 0, None, xp=xp, causal=causal, state=state, query_length=1, key_length=1, k=k
        )
        batch = _check_state(state, feature_map, info, work)
    m = feature_map.num_features

    statistics = call_statistics(xp, feature_map, q, k, key_mask, causal=causal)
    lk = info.key_length
    if state is None:
        like = xp.zeros((0,), dtype=work, device=info.device)
        kv, log_shift = empty_state(xp, batch, m, info.value_dim, like)
    else:
        kv = xp.broadcast_to(state.kv, (*batch, m, info.value_dim + 1))
        log_shift = xp.broadcast_to(state.log_shift, (*batch, m))

    if causal and plan.fused:
        # One compiled pass, features included: no L x m array.
        normalised, kv, log_shift = _dispatch.fused_causal(
            q, k, v, feature_map, key_mask, kv, log_shift, chunk_size=chunk_size
        )
    elif not causal and _dispatch.bidirectional_fused(q, feature_map, statistics, backend=backend):
        # Two compiled passes (keys into the state, then queries), features included.
        normalised = _dispatch.fused_bidirectional(q, k, v, feature_map, key_mask)
    else:
        operands = attention_operands(
            q, k, v, feature_map, info, batch, key_mask, work, statistics
        )
        outputs_aug, kv, log_shift = attend(
            xp, operands, kv, log_shift, causal=causal, chunk_size=chunk_size, plan=plan
        )
        normalised = causal_path.normalise(xp, outputs_aug)
    out = xp.astype(normalised, info.dtype, copy=False)  # no second output-sized copy
    if not return_state:
        return out
    previous = 0 if state is None else state.num_tokens
    return out, LinearAttentionState(
        kv=kv, log_shift=log_shift, feature_map=feature_map.fingerprint, num_tokens=previous + lk
    )


def _exact_parts_attention(
    q: Array,
    k: Array,
    v: Array,
    feature_map: FeatureMap | None,
    *,
    return_state: bool,
    **options: Any,
) -> Array | tuple[Array, LinearAttentionState]:
    """:func:`linear_attention` with exact parts (``linattn.hybrid``)."""
    call = exact_parts_call(q, k, v, feature_map, return_state=return_state, **options)
    xp, info = call.info.xp, call.info
    out, far_state = hybrid.hybrid_outputs(xp, call.parts)
    out = xp.astype(out, info.dtype, copy=False)
    if not return_state:
        return out
    fields = {**call.fields, **far_state}
    if fields["kv"] is None:  # no feature map: an empty random-feature state
        like = xp.zeros((0,), dtype=compute_dtype(xp, info.dtype), device=info.device)
        fields["kv"], fields["log_shift"] = empty_state(xp, call.batch, 0, info.value_dim, like)
    state = options["state"]
    previous = 0 if state is None else state.num_tokens
    return out, LinearAttentionState(
        feature_map=EXACT_FINGERPRINT if feature_map is None else feature_map.fingerprint,
        num_tokens=previous + info.key_length,
        window=call.exact.window,
        sink_keys=call.exact.sink_keys,
        **fields,
    )


class ExactPartsCall(NamedTuple):
    """A checked call with exact parts: its inputs, parts and new state caches."""

    info: Any
    exact: hybrid.ExactParts
    parts: list[hybrid.Part]
    fields: dict[str, Any]
    batch: tuple[int, ...]
    keep: Array


def exact_parts_call(
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
) -> ExactPartsCall:
    """Check a call with exact parts and build its parts (shared with the VJP)."""
    extra = dict(extra or {})
    if state is not None:
        extra.update(_state_arrays(state))
    if exact_key_mask is not None:
        extra["exact_key_mask"] = exact_key_mask
    head_dim = None if feature_map is None else feature_map.head_dim
    info = check_attention_inputs(
        q, k, v, key_mask=key_mask, causal=causal, head_dim=head_dim, extra=extra
    )
    chunk_size = _dispatch.chunk_size_for(plan, chunk_size, q, k, v)
    check_state_options(causal, state, return_state)
    xp = info.xp
    exact = hybrid.check_exact_parts(
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
    elif scale is not None and scale != feature_map.scale:
        raise ValueError(
            f"scale is the feature map's ({feature_map.scale}) when one is given; got {scale}"
        )
    else:
        scale = feature_map.scale
    work = compute_dtype(xp, info.dtype)
    q, k, v = (xp.astype(x, work, copy=False) for x in (q, k, v))
    k, v = drop_masked_keys(xp, k, v, key_mask)
    batch = info.batch_shape
    if state is not None:
        batch = _check_state(state, feature_map, info, work)
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
    if plan.path == "dask-scan":  # the portable parts run on Dask arrays as they are
        plan = _dispatch.causal_plan(q, feature_map, backend="array_api")
    fields: dict[str, Any] = {}
    if causal:
        found, fields = hybrid.causal_parts(
            xp,
            q,
            k,
            v,
            keep,
            exact,
            feature_map,
            state,
            scale=scale,
            statistics=statistics,
            chunk_size=chunk_size,
            plan=plan,
        )
    else:
        found = hybrid.bidirectional_parts(
            xp,
            q,
            k,
            v,
            keep,
            exact,
            feature_map,
            scale=scale,
            statistics=statistics,
            chunk_size=chunk_size,
            plan=plan,
        )
    return ExactPartsCall(info, exact, found, fields, batch, keep)


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
        oprf=feature_map.oprf_a is None and feature_map._spec.oprf,
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


def attend(
    xp: Any,
    operands: tuple[Array, Array | None, Array, Array | None, Array],
    kv: Array,
    log_shift: Array,
    *,
    causal: bool,
    chunk_size: int,
    plan: _dispatch.Plan,
) -> tuple[Array, Array, Array]:
    """Unnormalised ``[numerator | denominator]`` and the state after the keys.

    Causal attention runs on the plan's path (:mod:`linattn._dispatch`); bidirectional
    attention is one pass in the array API.
    """
    log_phi_q, sign_q, log_phi_k, sign_k, values_aug = operands
    if causal:
        return _dispatch.causal(
            xp,
            log_phi_q,
            sign_q,
            log_phi_k,
            sign_k,
            values_aug,
            kv,
            log_shift,
            chunk_size=chunk_size,
            plan=plan,
        )
    outputs_aug = causal_path.bidirectional(
        xp, log_phi_q, sign_q, log_phi_k, sign_k, values_aug, kv, log_shift
    )
    return outputs_aug, kv, log_shift


def favor_attention(
    q: Array,
    k: Array,
    v: Array,
    /,
    *,
    num_features: int = 256,
    kind: Kind | None = None,
    orthogonal: bool = True,
    rebalance: bool | None = None,
    causal: bool = False,
    key_mask: Array | None = None,
    scale: float | None = None,
    seed: int = 0,
    chunk_size: int | None = None,
    backend: Backend | None = None,
    window: int | None = None,
    sink_keys: int = 0,
    exact_key_mask: Array | None = None,
) -> Array:
    """Random-feature softmax attention in one line: draw a feature map from ``seed``, apply it.

    Parameters
    ----------
    q, k, v : arrays
        As for :func:`linear_attention`.
    num_features : int, default 256
        Number of random features ``m``.
    kind : str, optional
        Feature kind, see :class:`FeatureMap`.  By default the estimator with the lowest
        error at equal feature count in the estimator comparison (docs: "Choosing an
        estimator"): bidirectional attention uses ``"hyperbolic_oprf"`` (FAVOR++ with
        antithetic pairs) with statistics from the call's own queries and keys; causal
        attention uses ``"hyperbolic"``, the best estimator that needs no statistics
        (statistics over the sequence would let later tokens change earlier outputs).
    orthogonal : bool, default True
        Orthogonal random features.
    rebalance : bool, optional
        SADERF rebalancing; by default on for bidirectional and off for causal attention,
        for the same reason.
    causal, key_mask, chunk_size, backend, window, sink_keys, exact_key_mask
        As for :func:`linear_attention`: with a window or sinks, the random features
        estimate only the far keys.
    scale : float, optional
        Softmax scale; default ``1 / sqrt(d)``.
    seed : int, default 0
        Seed of the projection; the same seed gives the same output on every backend.

    Examples
    --------
    >>> import numpy as np
    >>> import linattn as la
    >>> x = np.random.default_rng(0).normal(size=(4, 64, 16)).astype(np.float32)
    >>> la.favor_attention(x, x, x, causal=True).shape
    (4, 64, 16)
    """
    # The inputs' own checks first: a zero-width head is q's fault, not head_dim's.
    head_dim = check_attention_inputs(
        q, k, v, key_mask=key_mask, causal=causal, head_dim=None
    ).query_head_dim
    if kind is None:
        kind = "hyperbolic" if causal else "hyperbolic_oprf"
    if rebalance is None:
        rebalance = not causal
    feature_map = FeatureMap(
        head_dim,
        num_features,
        kind=kind,
        orthogonal=orthogonal,
        rebalance=rebalance,
        scale=scale,
        seed=seed,
    )
    return linear_attention(
        q,
        k,
        v,
        feature_map,
        causal=causal,
        key_mask=key_mask,
        chunk_size=chunk_size,
        backend=backend,
        window=window,
        sink_keys=sink_keys,
        exact_key_mask=exact_key_mask,
    )


def _grouped(
    q: Array, k: Array, v: Array, key_mask: Array | None
) -> tuple[Array, Array, Array, Array | None, Any]:
    """Grouped-query inputs (fewer key/value heads, :mod:`linattn._gqa`) as broadcasting ones.

    Only where the heads differ and the inputs are well formed: anything else passes
    through to the checks, which name what is wrong (a mask of another rank included,
    before its axes could be read as heads).
    """
    arrays = (q, k, v)
    if (
        all(array_api_compat.is_array_api_obj(x) and x.ndim >= 3 for x in arrays)
        and q.ndim == k.ndim == v.ndim
        and q.shape[-3] != k.shape[-3]
        and 1 not in (q.shape[-3], k.shape[-3])  # one head (or grouped already) broadcasts
        and q.shape[-3] % k.shape[-3] == 0  # else the batch check names the shapes
        and (key_mask is None or getattr(key_mask, "ndim", None) in (1, k.ndim - 1))
    ):
        return grouped(q, k, v, key_mask)
    return q, k, v, key_mask, None


def _state_arrays(state: object) -> dict[str, Array]:
    if not isinstance(state, LinearAttentionState):
        raise TypeError(
            f"state must be a LinearAttentionState from linear_attention(..., "
            f"return_state=True); got {type(state).__name__}"
        )
    return {"state.kv": state.kv, "state.log_shift": state.log_shift}


def _check_state(
    state: LinearAttentionState, feature_map: FeatureMap | None, info: Any, work: Any
) -> tuple[int, ...]:
    """Check a state against the feature map and inputs; return the new batch shape."""
    from linattn._checks import broadcast_shapes

    fingerprint = EXACT_FINGERPRINT if feature_map is None else feature_map.fingerprint
    if state.feature_map != fingerprint:
        raise ValueError(
            "state was made by another feature map: expected one with fingerprint "
            f"{fingerprint} (this call's feature_map), got {state.feature_map}"
        )
    _check_num_tokens(state.num_tokens)
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


def _check_num_tokens(count: Any) -> None:
    """A non-negative integer, or a 0-d integer array (a JAX pytree leaf).

    Its value is checked only where it is known: under tracing it is not.
    """
    if array_api_compat.is_array_api_obj(count):
        xp = array_api_compat.array_namespace(count)
        if count.ndim == 0 and xp.isdtype(count.dtype, "integral"):
            if not _is_traced(count) and int(count) < 0:
                raise TypeError(
                    f"state.num_tokens must be a non-negative integer; got {int(count)}"
                )
            return
    elif not isinstance(count, bool) and isinstance(count, int | np.integer) and count >= 0:
        return
    raise TypeError(f"state.num_tokens must be a non-negative integer; got {count!r}")


def _is_traced(x: object) -> bool:
    """True for a JAX tracer (a value known only when the traced function runs)."""
    if not array_api_compat.is_jax_array(x):
        return False
    import jax

    return isinstance(x, jax.core.Tracer)
