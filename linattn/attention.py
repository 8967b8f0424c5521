"""The front door: exact softmax attention, linear attention, and one-line FAVOR+.

Arrays go in and come out in the caller's namespace and on the caller's device.
:func:`linear_attention` normalises its arguments into one call
(:func:`linattn._call.normalise_call`) and hands it to the plan (:mod:`linattn._plan`),
which chooses the executor that checks and runs it before anything is computed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, overload

import numpy as np

from linattn import _dispatch, _plan
from linattn._call import drop_masked_keys, grouped_inputs, normalise_call
from linattn._checks import check_attention_inputs, check_scale
from linattn._dispatch import Backend
from linattn._xp import (
    Array,
    array_device,
    compute_dtype,
    constant,
    from_host,
    fused_softmax_attention,
    namespace_of,
)
from linattn.features import FeatureMap, Kind
from linattn.state import LinearAttentionState

__all__ = ["favor_attention", "linear_attention", "softmax_attention", "with_exact_heads"]

DEFAULT_CHUNK_SIZE = _dispatch.DEFAULT_CHUNK_SIZE


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
    q, k, v, key_mask, ungroup = grouped_inputs(q, k, v, key_mask)
    if ungroup is not None:
        return ungroup(softmax_attention(q, k, v, causal=causal, key_mask=key_mask, scale=scale))
    info = check_attention_inputs(q, k, v, key_mask=key_mask, causal=causal, head_dim=None)
    xp = info.xp
    scale = check_scale(scale, q.shape[-1])
    work = compute_dtype(xp, info.dtype)
    q, k, v = (xp.astype(a, work) for a in (q, k, v))
    k, v = drop_masked_keys(xp, k, v, key_mask)
    visible = None
    if causal:
        n = info.query_length
        visible = from_host(
            xp, np.tril(np.ones((n, n), dtype=bool)), dtype=xp.bool, device=info.device
        )
    if key_mask is not None:
        keys = key_mask[..., None, :]
        visible = keys if visible is None else xp.logical_and(visible, keys)
    fused = fused_softmax_attention(xp, q, k, v, visible, scale)
    if fused is not None:
        return xp.astype(fused, info.dtype, copy=False)
    logits = xp.matmul(q, xp.matrix_transpose(k)) * scale
    if visible is not None:
        logits = xp.where(visible, logits, constant(xp, -math.inf, logits))
    row_max = xp.max(logits, axis=-1, keepdims=True)
    row_max = xp.where(xp.isfinite(row_max), row_max, constant(xp, 0.0, row_max))
    weights = xp.exp(logits - row_max)
    den = xp.sum(weights, axis=-1, keepdims=True)
    den = xp.where(den == 0, constant(xp, 1.0, den), den)
    return xp.astype(xp.matmul(weights / den, v), info.dtype, copy=False)


def with_exact_heads(
    out: Array,
    q: Array,
    k: Array,
    v: Array,
    heads: Sequence[int],
    /,
    *,
    causal: bool = False,
    key_mask: Array | None = None,
    scale: float | None = None,
) -> Array:
    """``out`` with the query heads ``heads`` replaced by exact softmax attention.

    A converted model's *exact heads* (``exact_heads=`` of its conversion; DuoAttention's
    retrieval heads) attend to every key exactly while the other heads run the fitted
    hybrid: call :func:`linear_attention` for all heads, then this.  Only the listed
    heads are computed (:func:`softmax_attention`; query head ``h`` reads key head ``h //
    (H / H_kv)``); a query that sees no key gets zeros, as the hybrid gives it.

    Parameters
    ----------
    out : array, shape ``(..., H, L_q, d_v)``
        The attention output of every head (e.g. :func:`linear_attention`'s).
    q, k, v : arrays
        The call's inputs: ``(..., H, L_q, d)``, ``(..., H_kv, L_k, d)`` and ``(...,
        H_kv, L_k, d_v)``, ``H_kv`` dividing ``H``.
    heads : sequence of int
        Query heads, each in ``[0, H)``, no repeats; empty returns ``out`` itself.
    causal, key_mask, scale
        As for :func:`softmax_attention` (``key_mask`` ``(..., L_k)`` or with a key-head
        axis ``(..., H_kv, L_k)``).

    Returns
    -------
    array
        ``out``'s shape, dtype and namespace.

    Examples
    --------
    >>> import numpy as np
    >>> import linattn as la
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.normal(size=(1, 2, 6, 4)) for _ in range(3))
    >>> w = np.stack([np.eye(4)] * 2)
    >>> out = la.linear_attention(q, k, v, la.FeatureMap.fitted(w, tied=True), window=2)
    >>> out = la.with_exact_heads(out, q, k, v, [1])
    >>> bool(np.allclose(out[:, 1], la.softmax_attention(q, k, v)[:, 1]))
    True
    """
    for name, x in (("out", out), ("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", 0) < 3:
            raise ValueError(
                f"{name} must have a head axis, (..., heads, length, features); got shape "
                f"{tuple(getattr(x, 'shape', ()))}"
            )
    count, kv_count = q.shape[-3], k.shape[-3]
    if kv_count == 0 or count % kv_count:
        raise ValueError(f"k's heads ({kv_count}) must divide q's ({count})")
    if tuple(out.shape[-3:]) != (count, q.shape[-2], v.shape[-1]):
        raise ValueError(
            f"out must have shape (..., {count}, {q.shape[-2]}, {v.shape[-1]}) to match q and "
            f"v; got {tuple(out.shape)}"
        )
    try:
        chosen = list(heads)
    except TypeError:
        raise TypeError(
            f"heads must be a sequence of query heads (integers); got {heads!r}"
        ) from None
    if any(isinstance(h, bool) or not isinstance(h, int | np.integer) for h in chosen) or any(
        not 0 <= h < count for h in chosen
    ):
        raise ValueError(f"heads must be query heads, integers in [0, {count}); got {chosen}")
    if len(set(chosen)) != len(chosen):
        raise ValueError(f"heads must not repeat a head; got {chosen}")
    if not chosen:
        return out
    xp = namespace_of({"out": out, "q": q, "k": k, "v": v})
    device = array_device(q)
    order = sorted(int(h) for h in chosen)
    index = xp.asarray(order, device=device)
    kv_index = xp.asarray([h // (count // kv_count) for h in order], device=device)
    if key_mask is not None and key_mask.ndim == k.ndim - 1 and key_mask.shape[-2] != 1:
        key_mask = xp.take(key_mask, kv_index, axis=key_mask.ndim - 2)
    exact = softmax_attention(
        xp.take(q, index, axis=q.ndim - 3),
        xp.take(k, kv_index, axis=k.ndim - 3),
        xp.take(v, kv_index, axis=v.ndim - 3),
        causal=causal,
        key_mask=key_mask,
        scale=scale,
    )
    exact = xp.astype(exact, out.dtype)
    parts, start = [], 0
    for position, head in enumerate(order):  # out's heads before, this exact head
        parts += [out[..., start:head, :, :], exact[..., position : position + 1, :, :]]
        start = head + 1
    parts.append(out[..., start:, :, :])
    return xp.concat(parts, axis=-3)


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
    return_state: bool,
    chunk_size: int | None = ...,
    backend: Backend | None = ...,
    window: int | None = ...,
    sink_keys: int = ...,
    exact_key_mask: Array | None = ...,
    scale: float | None = ...,
) -> Array | tuple[Array, LinearAttentionState]: ...
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
    call = normalise_call(
        q, k, v, feature_map, causal=causal, key_mask=key_mask, state=state,
        return_state=return_state, chunk_size=chunk_size, backend=backend, window=window,
        sink_keys=sink_keys, exact_key_mask=exact_key_mask, scale=scale,
    )  # fmt: skip
    return _plan.execute(call)


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
