"""The attention-transfer loss and its gradient.

The dense hybrid of one batch (:func:`forward`: dense ``L x L``, calibration texts are
short), its squared error against the exact softmax output over real query rows
(:func:`squared_error`, normalised by :func:`squared_norm`), the host cotangents of every
parameter (:func:`gradients`), one batch's mean loss and gradient over its pieces
(:func:`batch_loss_grad`), and the per-head errors a caller measures
(:func:`attention_errors`).  The math is in ``docs/algorithm.md`` (section "Fitted
feature maps").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from linattn import fitted
from linattn._checks import check_scale
from linattn._xp import Array, Namespace, constant, to_host
from linattn.features import FeatureMap
from linattn.fitted import FittedParameters
from linattn.transfer.batches import LayerBatch, Parts, prepare
from linattn.transfer.threads import Run

__all__ = [
    "attention_errors",
    "batch_loss_grad",
    "forward",
    "gradients",
    "squared_error",
    "squared_norm",
]


def forward(p: FittedParameters, parts: Parts) -> tuple[Array, dict[str, Any]]:
    """The hybrid's output ``(B, H_kv, G, L, d_v)`` and what the backward pass needs.

    Weights relative to each row's largest near weight, shifted down by ``t >= 0`` where
    the far part's bound ``a_i + max_j b_j + log m`` (``s <= m``) lies above it: no
    logarithm or exponential over the ``L x L`` products (the near weights are cached).
    A row whose weights all underflow (the bound far above the true far weights) is
    recomputed in log space.
    """
    xp = parts.xp
    p = fitted.grouped(p, int(parts.q.shape[2]))
    lq = fitted.log_features(xp, p, parts.q, "query")
    lk = fitted.log_features(xp, p, parts.k, "key")
    a = xp.max(lq, axis=-1, keepdims=True)
    b = xp.max(lk, axis=-1, keepdims=True)
    eq, ek = xp.exp(lq - a), xp.exp(lk - b)
    s = xp.matmul(eq, xp.matrix_transpose(ek))
    b_top = xp.max(b, axis=-2, keepdims=True)
    bound = a - parts.near_top + b_top + math.log(lq.shape[-1])
    shift = xp.maximum(bound, xp.zeros_like(bound))
    row = xp.exp(a - parts.near_top + b_top - shift)
    column = xp.matrix_transpose(xp.exp(b - b_top))
    weights = parts.near_weights * xp.exp(-shift) + s * (column * parts.far_weights) * row
    total = xp.sum(weights, axis=-1, keepdims=True)
    if bool(xp.any((total <= 0) & (parts.rows > 0))):
        weights = _log_space_weights(xp, parts, s, a, b)
        total = xp.sum(weights, axis=-1, keepdims=True)
    probs = weights / xp.where(total > 0, total, xp.ones_like(total))
    out = xp.matmul(probs, parts.v)
    return out, {"eq": eq, "ek": ek, "s": s, "probs": probs}


def _log_space_weights(xp: Namespace, parts: Parts, s: Array, a: Array, b: Array) -> Array:
    """The same weights up to a row factor, with each row's true largest weight as 1."""
    tiny = constant(xp, float(xp.finfo(s.dtype).tiny), s)
    neg = constant(xp, -math.inf, s)
    near = parts.near_weights > 0
    log_near = xp.log(xp.where(near, parts.near_weights, xp.ones_like(s))) + parts.near_top
    log_far = a + xp.matrix_transpose(b) + xp.log(xp.maximum(s, tiny))
    log_w = xp.where(near, log_near, xp.where(parts.far, log_far, neg))
    top = xp.max(log_w, axis=-1, keepdims=True)
    top = xp.where(xp.isfinite(top), top, xp.zeros_like(top))
    return xp.where(near | parts.far, xp.exp(log_w - top), xp.zeros_like(s))


def squared_error(parts: Parts, out: Array) -> Array:
    """Per-head sums of squared errors over real rows, ``(H_kv, G)`` on the host."""
    xp = parts.xp
    err = xp.sum(xp.sum((out - parts.target) ** 2 * parts.rows, axis=-1), axis=-1)
    return np.asarray(to_host(xp.sum(err, axis=0)), dtype=np.float64)


def squared_norm(parts: Parts) -> np.ndarray:
    """Per-head squared norms of the exact output over real rows, ``(H_kv, G)`` on the host."""
    xp = parts.xp
    norm = xp.sum(xp.sum(parts.target**2 * parts.rows, axis=-1), axis=-1)
    return np.asarray(to_host(xp.sum(norm, axis=0)), dtype=np.float64)


def gradients(
    p: FittedParameters, parts: Parts, out: Array, saved: dict[str, Any], d_out: Array
) -> dict[str, np.ndarray]:
    """Host cotangents of every parameter (``far_weight`` as ``d log g``)."""
    xp = parts.xp
    probs, far, s = saved["probs"], parts.far, saved["s"]
    d_probs = xp.matmul(d_out, xp.matrix_transpose(parts.v))
    row = xp.sum(d_out * out, axis=-1, keepdims=True)
    d_log_w = probs * (d_probs - row)
    tiny = constant(xp, float(xp.finfo(s.dtype).tiny), s)
    h = xp.where(far, d_log_w / xp.maximum(s, tiny), xp.zeros_like(s))
    d_lq = saved["eq"] * xp.matmul(h, saved["ek"])
    d_lk = saved["ek"] * xp.matmul(xp.matrix_transpose(h), saved["eq"])
    if parts.grouped:
        d_lk = xp.sum(d_lk, axis=2, keepdims=True)
    pg = fitted.grouped(p, int(parts.q.shape[2]))
    grads = fitted.parameter_vjp(xp, pg, parts.q, d_lq, "query")
    key = fitted.parameter_vjp(xp, pg, parts.k, d_lk, "key")
    grads = {name: value.reshape(getattr(p, name).shape) for name, value in grads.items()}
    key = {name: value.reshape(getattr(p, name).shape) for name, value in key.items()}
    d_log_g = key.pop("far_weight") * p.far_weight  # d/d(log g) = g d/dg
    if p.tied:
        grads["query_weight"] = grads["query_weight"] + key["key_weight"]
        grads["query_bias"] = grads["query_bias"] + key["key_bias"]
    else:
        grads.update(key)
    grads["log_far_weight"] = d_log_g
    return grads


def batch_loss_grad(
    p: FittedParameters, pieces: Sequence[Parts], run: Run = map
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The mean squared error over one batch's real rows, per head, and its gradient;
    the batch in ``pieces`` (:meth:`Parts.pieces`), mapped by ``run``, summed in order."""
    count = sum(float(to_host(x.xp.sum(x.rows))) for x in pieces) * int(pieces[0].v.shape[-1])

    def piece(parts: Parts) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        out, saved = forward(p, parts)
        d_out = 2.0 * (out - parts.target) * parts.rows / count
        return squared_error(parts, out) / count, gradients(p, parts, out, saved, d_out)

    results = list(run(piece, pieces))
    grads = {name: sum(r[1][name] for r in results) for name in results[0][1]}
    return sum(r[0] for r in results), grads


def attention_errors(
    feature_map: FeatureMap | None,
    batches: Sequence[LayerBatch],
    *,
    window: int | None,
    sink_keys: int = 0,
    causal: bool = False,
    scale: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Per-head squared errors of the hybrid against exact attention, and the exact
    output's squared norms, summed over ``batches`` (real query rows): ``(H,)`` each.

    ``feature_map=None`` measures the exact parts alone (window + sinks).  The relative
    error of head ``h`` is ``sqrt(err[h] / norm[h])``.

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.normal(size=(1, 2, 6, 4)) for _ in range(3))
    >>> batch = LayerBatch(q, k, v, np.ones((1, 6), dtype=bool))
    >>> err, norm = attention_errors(None, [batch], window=6)  # the window holds every key
    >>> bool(np.all(err < 1e-20)), norm.shape
    (True, (2,))
    """
    err_total: np.ndarray | None = None
    norm_total: np.ndarray | None = None
    for batch in batches:
        head_dim = int(batch.q.shape[-1])
        parts = prepare(batch, window, sink_keys, causal, check_scale(scale, head_dim))
        p = _exact_parts_parameters(parts, feature_map)
        out, _ = forward(p, parts)
        err = squared_error(parts, out).reshape(-1)
        norm = squared_norm(parts).reshape(-1)
        err_total = err if err_total is None else err_total + err
        norm_total = norm if norm_total is None else norm_total + norm
    if err_total is None or norm_total is None:
        raise ValueError("batches must hold at least one LayerBatch; got none")
    return err_total, norm_total


def _exact_parts_parameters(parts: Parts, feature_map: FeatureMap | None) -> FittedParameters:
    """The map's parameters, or any map's with ``g = 0`` (the exact parts alone)."""
    if feature_map is not None:
        if feature_map.parameters is None:
            raise ValueError(
                f"feature_map must be a fitted (hedgehog) map; got kind={feature_map.kind!r}"
            )
        return feature_map.parameters
    d = int(parts.q.shape[-1])
    return fitted.check_parameters(np.eye(d), far_weight=0.0, tied=True)
