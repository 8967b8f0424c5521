"""Attention transfer: fit a layer's feature maps and far weights to its exact attention.

LoLCATs' attention transfer (Zhang et al., ICLR 2025) with Hedgehog maps (Zhang et al.,
ICLR 2024), every model weight frozen: for one attention layer, given its queries,
keys and values on calibration inputs, fit per head a query map, a key map
(:mod:`linattn.fitted`) and the far weight ``g`` so that the hybrid

    out_i = (sum_near exp(s q_i.k_j) v_j + g sum_far phi(q_i).phi(k_j) v_j) / (same with 1)

matches the layer's exact softmax output: the mean squared error over real query rows.
The near keys are those of :func:`linattn.linear_attention`'s ``window``,
``sink_keys`` and ``exact_key_mask``; far keys are every other real key (and, causal,
not a future one).

The fit runs on whatever arrays the activations are (NumPy with no framework, torch,
JAX, CuPy), with the library's own gradients (dense ``L x L`` per batch: calibration
texts are short) and an Adam step on host parameters, deterministic for a seed.
Three disjoint splits: ``fit`` (the gradient steps), ``validation`` (early stopping per
head, and ``g = 0`` for a head whose fit does not beat the exact parts alone there),
and a test split the caller keeps for every reported figure.

The math is in ``docs/algorithm.md`` (section "Fitted feature maps"); the procedure and
the figures that chose it in ``docs/estimators.md`` ("Converting a pretrained model").
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from linattn import fitted
from linattn._checks import check_scale
from linattn._gqa import grouped
from linattn._xp import (
    Array,
    Namespace,
    array_device,
    constant,
    is_numpy_namespace,
    namespace_of,
    to_host,
)
from linattn.features import FeatureMap
from linattn.fitted import FittedParameters
from linattn.hybrid.dense import near_and_far

__all__ = [
    "EXACT_HEADS_ENTRY",
    "FORMAT",
    "PIECES",
    "SINK_KEYS",
    "LayerBatch",
    "LayerFit",
    "attention_errors",
    "exact_heads_of",
    "fit_layer",
    "load_maps",
    "save_maps",
]

#: The ``format`` entry of a fitted-maps file's metadata.
FORMAT = "linattn-fitted-maps/1"
#: The options entry of a fitted-maps file that lists each layer's exact heads (query
#: heads attending to every key exactly: :func:`linattn.with_exact_heads`).
EXACT_HEADS_ENTRY = "exact_heads_per_layer"

#: A key head keeps its far part only where the fit lowers its relative validation
#: error (``||out - exact|| / ||exact||``) below window + sinks' by more than this: where
#: there is nothing to gain (no far keys) both are rounding (1e-16 in float64, 1e-7 in
#: float32), which must not decide; a fit that helps lowers it by 1e-2 or more.
MIN_GAIN = 1e-5

#: Each calibration batch is split along its rows into this many pieces, which the fit
#: computes on as many threads where the arrays are NumPy's (its products and
#: elementwise work release the GIL; BLAS itself keeps one thread during the fit).
#: Fixed, not the machine's core count: a seed gives the same fit, to the last bit, on
#: any machine.
PIECES = 2

#: The first keys of every row that a conversion attends exactly by default (its
#: ``sink_keys``), StreamingLLM's four attention sinks (Xiao et al. 2024).  Measured on
#: all-MiniLM-L6-v2 (``docs/estimators.md``, "Sink keys"): beside a window of 16 the
#: fitted hybrid's test cosine rises with them, more than a window widened by as many
#: keys gives it; each costs one exact key per row.
SINK_KEYS = 4


class LayerBatch(NamedTuple):
    """One calibration batch of one attention layer.

    Attributes
    ----------
    q : array, shape ``(B, H, L, d)``
    k : array, shape ``(B, H_kv, L, d)``
    v : array, shape ``(B, H_kv, L, d_v)``
    key_mask : boolean array, shape ``(B, L)``
        True for real tokens (keys, and the query rows the loss counts).
    exact_key_mask : boolean array, shape ``(B, L)``, optional
        Keys every query attends to exactly (e.g. ``[SEP]``), as
        :func:`linattn.linear_attention`'s ``exact_key_mask``.
    """

    q: Array
    k: Array
    v: Array
    key_mask: Array
    exact_key_mask: Array | None = None


@dataclass
class LayerFit:
    """What :func:`fit_layer` found.

    Attributes
    ----------
    feature_map : FeatureMap
        The fitted map (``kind="hedgehog"``, per-head parameters, far weights; ``g = 0``
        for the heads in ``exact_only``).
    validation_error : numpy.ndarray, shape ``(H,)``
        Relative error ``||out - exact|| / ||exact||`` per head on the validation split,
        of the kept parameters.
    exact_parts_error : numpy.ndarray, shape ``(H,)``
        The same for the exact parts alone (window + sinks, ``g = 0``).
    exact_squared_norm : numpy.ndarray, shape ``(H,)``
        ``||exact||**2`` per head on the validation split, the weights that combine the
        heads' errors into the layer's (:meth:`error_shares`).
    exact_only : numpy.ndarray of bool, shape ``(H_kv,)``
        Key heads set to ``g = 0`` (their fit did not beat the exact parts).
    steps : int
        Gradient steps taken (early stopping may end before ``steps``).
    seconds : float
        Wall time of the fit.
    history : list of (int, float)
        ``(step, relative validation error of all heads)`` at each evaluation.
    """

    feature_map: FeatureMap
    validation_error: np.ndarray
    exact_parts_error: np.ndarray
    exact_squared_norm: np.ndarray
    exact_only: np.ndarray
    steps: int
    seconds: float
    history: list[tuple[int, float]] = field(default_factory=list)

    def error_shares(self) -> np.ndarray:
        """Each head's share of the layer's fitted squared error on the validation
        split, ``(H,)``, summing to 1 (0 everywhere for a layer without error).

        A head with a large share is one the map cannot follow, typically one that looks
        a single key up (``docs/estimators.md``, "Where the error stays").

        Examples
        --------
        >>> import numpy as np
        >>> from linattn import FeatureMap
        >>> fit = LayerFit(FeatureMap.fitted(np.eye(2), tied=True), np.array([0.1, 0.3]),
        ...     np.ones(2), np.array([4.0, 1.0]), np.zeros(2, bool), 0, 0.0)
        >>> fit.error_shares().round(3)
        array([0.308, 0.692])
        """
        squared = self.validation_error**2 * self.exact_squared_norm
        total = squared.sum()
        return squared / total if total > 0 else np.zeros_like(squared)

    def worst_heads(self, count: int) -> tuple[int, ...]:
        """The ``count`` heads with the largest :meth:`error_shares` (ties: the lower
        index), in increasing order: the heads to attend exactly (``exact_heads``).

        Raises
        ------
        ValueError
            ``count`` is not an integer from 0 to the number of heads.

        Examples
        --------
        >>> import numpy as np
        >>> from linattn import FeatureMap
        >>> fit = LayerFit(FeatureMap.fitted(np.eye(2), tied=True), np.array([0.1, 0.3, 0.2]),
        ...     np.ones(3), np.array([4.0, 1.0, 4.0]), np.zeros(3, bool), 0, 0.0)
        >>> fit.worst_heads(1), fit.worst_heads(2)
        ((2,), (1, 2))
        """
        shares = self.error_shares()
        given: object = count  # (what was given: the annotation says what to give)
        if isinstance(given, bool) or not isinstance(given, int) or not 0 <= given <= shares.size:
            raise ValueError(
                f"exact_heads must be an integer from 0 to the number of query heads "
                f"({shares.size}); got {given!r}"
            )
        return tuple(sorted(int(h) for h in np.argsort(-shares, kind="stable")[:given]))


# -- the dense hybrid of one batch, and its gradient ------------------------------------


@dataclass
class _Parts:
    """What one batch needs besides the parameters (grouped shapes, masks, target)."""

    xp: Namespace
    q: Array  # (B, H_kv, G, L, d)
    k: Array  # (B, H_kv, 1, L, d)
    v: Array  # (B, H_kv, 1, L, d_v)
    far: Array  # (B, 1, 1, L, L) bool: feature keys
    far_weights: Array  # the same as the dtype
    near_weights: Array  # (B, H_kv, G, L, L): exp(s q.k - near_top) on exact keys, else 0
    near_top: Array  # (B, H_kv, G, L, 1): each row's largest s q.k on exact keys (0: none)
    rows: Array  # (B, 1, 1, L, 1) real query rows, as the dtype
    scale: float
    target: Array  # (B, H_kv, G, L, d_v): exact softmax output
    grouped: bool

    def pieces(self, count: int = PIECES) -> list[_Parts]:
        """This batch as up to ``count`` batches of consecutive rows (none empty)."""
        size = int(self.q.shape[0])
        bounds = [size * i // count for i in range(count + 1)]
        names = ("q", "k", "v", "far", "far_weights", "near_weights", "near_top", "rows")
        return [
            replace(self, **{name: getattr(self, name)[a:b, ...] for name in (*names, "target")})
            for a, b in itertools.pairwise(bounds)
            if b > a
        ]


def _prepare(
    batch: LayerBatch, window: int | None, sink_keys: int, causal: bool, scale: float
) -> _Parts:
    q, k, v, key_mask, exact = batch
    xp = namespace_of({"q": q, "k": k, "v": v, "key_mask": key_mask})
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            "q, k and v must have shape (B, H, L, d), (B, H_kv, L, d) and (B, H_kv, L, d_v); "
            f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    length = q.shape[-2]
    if tuple(key_mask.shape) != (q.shape[0], length) or key_mask.dtype != xp.bool:
        raise ValueError(
            f"key_mask must be a boolean (B, L) = {(q.shape[0], length)} array; got "
            f"{key_mask.dtype} {tuple(key_mask.shape)}"
        )
    if not bool(xp.any(key_mask)):
        raise ValueError("key_mask must mark real tokens: a calibration batch has none")
    if causal and exact is not None:
        raise ValueError(
            "exact_key_mask is for bidirectional attention (a causal query's exact keys are "
            "its window and the sinks); got it in a causal fit"
        )
    gq, gk, gv, _, _ = grouped(q, k, v)
    if gq.ndim == 4:  # no grouping: add the unit group axis
        gq, gk, gv = gq[:, :, None], gk[:, :, None], gv[:, :, None]
    near, far = near_and_far(
        xp, length, array_device(q), causal=causal, window=window, sink_keys=sink_keys,
        real=key_mask[:, None, None, None, :],
        exact=None if exact is None else exact[:, None, None, None, :],
    )  # fmt: skip
    log_exact = xp.matmul(gq, xp.matrix_transpose(gk)) * scale
    allowed = near | far
    top = xp.max(
        xp.where(allowed, log_exact, constant(xp, -math.inf, log_exact)), axis=-1, keepdims=True
    )
    top = xp.where(xp.isfinite(top), top, xp.zeros_like(top))
    neg = constant(xp, -math.inf, log_exact)
    # exp of the masked logits (-inf off the mask): no overflow where nothing is kept
    weights = xp.exp(xp.where(allowed, log_exact - top, neg))
    total = xp.sum(weights, axis=-1, keepdims=True)
    target = xp.matmul(weights, gv) / xp.where(total > 0, total, xp.ones_like(total))
    rows = xp.astype(key_mask, q.dtype)[:, None, None, :, None]
    near_top = xp.max(xp.where(near, log_exact, neg), axis=-1, keepdims=True)
    near_top = xp.where(xp.isfinite(near_top), near_top, xp.zeros_like(near_top))
    near_weights = xp.exp(xp.where(near, log_exact - near_top, neg))
    return _Parts(
        xp, gq, gk, gv, far, xp.astype(far, q.dtype), near_weights, near_top, rows, scale,
        target, gq.shape[2] > 1,
    )  # fmt: skip


def _forward(p: FittedParameters, parts: _Parts) -> tuple[Array, dict[str, Any]]:
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


def _log_space_weights(xp: Namespace, parts: _Parts, s: Array, a: Array, b: Array) -> Array:
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


def _squared_error(parts: _Parts, out: Array) -> Array:
    """Per-head sums of squared errors over real rows, ``(H_kv, G)`` on the host."""
    xp = parts.xp
    err = xp.sum(xp.sum((out - parts.target) ** 2 * parts.rows, axis=-1), axis=-1)
    return np.asarray(to_host(xp.sum(err, axis=0)), dtype=np.float64)


def _gradients(
    p: FittedParameters, parts: _Parts, out: Array, saved: dict[str, Any], d_out: Array
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


def _batch_loss_grad(
    p: FittedParameters, pieces: Sequence[_Parts], run: _Run = map
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The mean squared error over one batch's real rows, per head, and its gradient;
    the batch in ``pieces`` (:meth:`_Parts.pieces`), mapped by ``run``, summed in order."""
    count = sum(float(to_host(x.xp.sum(x.rows))) for x in pieces) * int(pieces[0].v.shape[-1])

    def piece(parts: _Parts) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        out, saved = _forward(p, parts)
        d_out = 2.0 * (out - parts.target) * parts.rows / count
        return _squared_error(parts, out) / count, _gradients(p, parts, out, saved, d_out)

    results = list(run(piece, pieces))
    grads = {name: sum(r[1][name] for r in results) for name in results[0][1]}
    return sum(r[0] for r in results), grads


#: How the fit maps a function over pieces of batches: ``map``, or a thread pool's.
_Run = Callable[[Callable[[Any], Any], Iterable[Any]], Iterator[Any]]


def _cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (not on every platform)
        return os.cpu_count() or 1


@contextlib.contextmanager
def _pieces_run(xp: Namespace) -> Iterator[_Run]:
    """A thread pool's ``map`` for NumPy arrays on a machine with more than one core;
    ``map`` otherwise (other libraries keep their own threads)."""
    workers = min(PIECES, _cores()) if is_numpy_namespace(xp) else 1
    if workers < 2:
        yield map
        return
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="linattn-fit") as pool:
        yield pool.map


# -- Adam on host parameters ------------------------------------------------------------


@dataclass
class _Adam:
    rate: float
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    step: int = 0
    moments: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    def update(
        self, values: dict[str, np.ndarray], grads: dict[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        self.step += 1
        out = {}
        for name, value in values.items():
            g = grads[name]
            m, v = self.moments.get(name, (np.zeros_like(value), np.zeros_like(value)))
            m = self.beta1 * m + (1 - self.beta1) * g
            v = self.beta2 * v + (1 - self.beta2) * g * g
            self.moments[name] = (m, v)
            m_hat = m / (1 - self.beta1**self.step)
            v_hat = v / (1 - self.beta2**self.step)
            out[name] = value - self.rate * m_hat / (np.sqrt(v_hat) + self.eps)
        return out


def _values(p: FittedParameters) -> dict[str, np.ndarray]:
    names = ["query_weight", "query_bias"] + ([] if p.tied else ["key_weight", "key_bias"])
    values = {name: np.array(getattr(p, name)) for name in names}
    values["log_far_weight"] = np.array(fitted.log_far_weight(p))
    return values


def _parameters(values: dict[str, np.ndarray], tied: bool) -> FittedParameters:
    return fitted.check_parameters(
        values["query_weight"],
        values["query_bias"],
        None if tied else values["key_weight"],
        None if tied else values["key_bias"],
        np.exp(values["log_far_weight"]),
        tied=tied,
    )


# -- the fit ---------------------------------------------------------------------------


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
        parts = _prepare(batch, window, sink_keys, causal, check_scale(scale, head_dim))
        p = _exact_parts_parameters(parts, feature_map)
        out, _ = _forward(p, parts)
        err = _squared_error(parts, out).reshape(-1)
        xp = parts.xp
        norm = np.asarray(
            to_host(
                xp.sum(xp.sum(xp.sum(parts.target**2 * parts.rows, axis=-1), axis=-1), axis=0)
            ),
            dtype=np.float64,
        ).reshape(-1)
        err_total = err if err_total is None else err_total + err
        norm_total = norm if norm_total is None else norm_total + norm
    if err_total is None or norm_total is None:
        raise ValueError("batches must hold at least one LayerBatch; got none")
    return err_total, norm_total


def _exact_parts_parameters(parts: _Parts, feature_map: FeatureMap | None) -> FittedParameters:
    """The map's parameters, or any map's with ``g = 0`` (the exact parts alone)."""
    if feature_map is not None:
        if feature_map.parameters is None:
            raise ValueError(
                f"feature_map must be a fitted (hedgehog) map; got kind={feature_map.kind!r}"
            )
        return feature_map.parameters
    d = int(parts.q.shape[-1])
    return fitted.check_parameters(np.eye(d), far_weight=0.0, tied=True)


def fit_layer(
    fit: Sequence[LayerBatch],
    validation: Sequence[LayerBatch],
    *,
    num_features: int = 64,
    window: int | None,
    sink_keys: int = 0,
    causal: bool = False,
    scale: float | None = None,
    tied: bool = False,
    steps: int = 300,
    learning_rate: float = 1e-2,
    evaluate_every: int = 25,
    patience: int = 3,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> LayerFit:
    """Fit one layer's per-head maps and far weights to its exact attention.

    Parameters
    ----------
    fit, validation : sequence of LayerBatch
        Calibration batches of this layer, from disjoint texts: ``fit`` takes the Adam
        steps (one batch per step, in a seeded order), ``validation`` chooses, per head,
        the parameters kept (early stopping) and ``g = 0`` where the fit does not beat
        the exact parts alone.
    num_features : int, default 64
        ``m``, features per head (``W`` is ``d x m/2``).
    window, sink_keys, causal, scale
        The exact parts and softmax scale, as :func:`linattn.linear_attention` will
        be called with them (``scale`` default ``1 / sqrt(d)``).
    tied : bool, default False
        One map for queries and keys.
    steps, learning_rate, evaluate_every, patience
        Adam steps at most, its rate, steps between validation passes, and passes
        without a better head before stopping.
    seed : int, default 0
        The start's noise and the batch order: the fit is deterministic for a seed.
    progress : callable, optional
        Called with a one-line status after each validation pass (the default prints
        it on stderr when stderr is a terminal).

    Returns
    -------
    LayerFit

    Notes
    -----
    BLAS runs one thread during the fit (its many ``L x L`` products only contend with
    more); NumPy batches are computed in :data:`PIECES` pieces of rows on as many threads
    instead, which keeps a second core busy.  Other array libraries keep their own
    threads.

    Examples
    --------
    >>> import numpy as np
    >>> import linattn as la
    >>> from linattn.transfer import LayerBatch, fit_layer
    >>> rng = np.random.default_rng(0)
    >>> def batch():
    ...     q, k, v = (rng.normal(size=(2, 2, 16, 4)) for _ in range(3))
    ...     return LayerBatch(q, k, v, np.ones((2, 16), dtype=bool))
    >>> result = fit_layer([batch()], [batch()], num_features=8, window=2, steps=20,
    ...                    evaluate_every=10, progress=lambda line: None)
    >>> result.feature_map.kind, result.feature_map.parameters.query_weight.shape
    ('hedgehog', (2, 4, 4))
    """
    if not fit or not validation:
        raise ValueError("fit and validation must each hold at least one LayerBatch")
    with _one_blas_thread(), _pieces_run(namespace_of({"q": fit[0].q})) as run:
        return _fit_layer(
            fit, validation, num_features=num_features, window=window, sink_keys=sink_keys,
            causal=causal, scale=scale, tied=tied, steps=steps, learning_rate=learning_rate,
            evaluate_every=evaluate_every, patience=patience, seed=seed, progress=progress,
            run=run,
        )  # fmt: skip


def _fit_layer(
    fit: Sequence[LayerBatch],
    validation: Sequence[LayerBatch],
    *,
    num_features: int,
    window: int | None,
    sink_keys: int,
    causal: bool,
    scale: float | None,
    tied: bool,
    steps: int,
    learning_rate: float,
    evaluate_every: int,
    patience: int,
    seed: int,
    progress: Callable[[str], None] | None,
    run: _Run,
) -> LayerFit:
    start = time.perf_counter()
    first = fit[0]
    heads, key_heads, head_dim = (
        int(first.q.shape[1]),
        int(first.k.shape[1]),
        int(first.q.shape[-1]),
    )
    scale = check_scale(scale, head_dim)
    if tied and heads != key_heads:
        raise ValueError(
            f"tied=True needs as many key heads as query heads; got {key_heads} and {heads}"
        )
    report = progress if progress is not None else _terminal_progress
    fit_parts = [_prepare(b, window, sink_keys, causal, scale).pieces() for b in fit]
    val_parts = [
        piece
        for b in validation
        for piece in _prepare(b, window, sink_keys, causal, scale).pieces()
    ]
    p = fitted.initial_parameters(
        head_dim, num_features, heads=heads, key_heads=key_heads, tied=tied, seed=seed
    )
    p = _start_far_weight(p, fit_parts[0])
    values = _values(p)

    def val_errors(params: FittedParameters) -> np.ndarray:
        errors = run(lambda parts: _squared_error(parts, _forward(params, parts)[0]), val_parts)
        return np.asarray(sum(errors)).reshape(key_heads, -1)

    norms = np.sum([_squared_norm(parts) for parts in val_parts], axis=0).reshape(key_heads, -1)
    base = val_errors(fitted.check_parameters(np.eye(head_dim), far_weight=0.0, tied=True))
    best_err = val_errors(p)
    best = {name: value.copy() for name, value in values.items()}
    adam = _Adam(learning_rate)
    order = np.random.default_rng(seed).permutation
    queue: list[int] = []
    history = [(0, float(np.sqrt(best_err.sum() / norms.sum())))]
    since, step = 0, 0
    for step in range(1, steps + 1):
        if not queue:
            queue = list(order(len(fit_parts)))
        _, grads = _batch_loss_grad(p, fit_parts[queue.pop()], run)
        values = adam.update(values, grads)
        p = _parameters(values, tied)
        if step % evaluate_every and step != steps:
            continue
        err = val_errors(p)
        history.append((step, float(np.sqrt(err.sum() / norms.sum()))))
        report(
            f"step {step}/{steps}: validation error {history[-1][1]:.4f} "
            f"(window + sinks {np.sqrt(base.sum() / norms.sum()):.4f})"
        )
        better = err.sum(axis=1) < best_err.sum(axis=1)  # per key head (its groups share it)
        if not better.any():
            since += 1
            if since >= patience:
                break
            continue
        since = 0
        best_err = np.where(better[:, None], err, best_err)
        for name, value in values.items():
            _take_heads(best[name], value, better, heads, key_heads, name, tied)
    head_norms = norms.sum(axis=1)
    gain = np.sqrt(base.sum(axis=1) / head_norms) - np.sqrt(best_err.sum(axis=1) / head_norms)
    exact_only = ~(gain > MIN_GAIN)
    if window is None and not sink_keys and all(b.exact_key_mask is None for b in validation):
        exact_only[:] = False  # no exact part: g cancels, the map is all there is
    best["log_far_weight"] = np.where(exact_only, -np.inf, best["log_far_weight"])
    kept = _parameters(best, tied)
    fm = FeatureMap.fitted(
        kept.query_weight,
        kept.query_bias,
        key_weight=None if tied else kept.key_weight,
        key_bias=None if tied else kept.key_bias,
        far_weight=kept.far_weight,
        tied=tied,
        scale=scale,
    )
    final = np.where(exact_only[:, None], base, best_err)
    return LayerFit(
        feature_map=fm,
        validation_error=np.sqrt(final / norms).reshape(-1),
        exact_parts_error=np.sqrt(base / norms).reshape(-1),
        exact_squared_norm=norms.reshape(-1),
        exact_only=exact_only,
        steps=step,
        seconds=time.perf_counter() - start,
        history=history,
    )


def _take_heads(
    best: np.ndarray,
    value: np.ndarray,
    better: np.ndarray,
    heads: int,
    key_heads: int,
    name: str,
    tied: bool,
) -> None:
    """Copy the improved key heads' slices of ``value`` into ``best`` (in place)."""
    if value.ndim == 0:
        return
    if name.startswith("key") or name == "log_far_weight":
        best[better] = value[better]
        return
    group = heads // key_heads  # query parameters: every query head of an improved key head
    chosen = np.repeat(better, group)
    best[chosen] = value[chosen]


def _squared_norm(parts: _Parts) -> np.ndarray:
    xp = parts.xp
    norm = xp.sum(xp.sum(parts.target**2 * parts.rows, axis=-1), axis=-1)
    return np.asarray(to_host(xp.sum(norm, axis=0)), dtype=np.float64)


def _start_far_weight(p: FittedParameters, pieces: Sequence[_Parts]) -> FittedParameters:
    """``g``'s start per key head: the median over real rows of one batch (its
    ``pieces``) of the exact far mass over the initial map's far mass (both relative to
    the row's near mass)."""
    ratios = [_log_far_mass_ratio(p, parts) for parts in pieces]
    log_ratio = np.concatenate([r[0] for r in ratios])  # (B, H_kv, G, L)
    rows = np.concatenate([r[1] for r in ratios])  # (B, L)
    g = np.ones(p.far_weight.shape)
    for h in range(log_ratio.shape[1]):
        values = log_ratio[:, h]
        ok = np.broadcast_to(rows[:, None, :], values.shape) & np.isfinite(values)
        if ok.any():
            value = float(np.exp(np.median(values[ok])))
            if g.ndim:
                g[h] = value
            else:
                g = np.asarray(value)
    return fitted.check_parameters(
        p.query_weight,
        p.query_bias,
        None if p.tied else p.key_weight,
        None if p.tied else p.key_bias,
        g,
        tied=p.tied,
    )


def _log_far_mass_ratio(p: FittedParameters, parts: _Parts) -> tuple[np.ndarray, np.ndarray]:
    """``log`` of the exact far mass over the map's, both relative to the near mass, per
    row (``(B, H_kv, G, L)``, NaN where undefined), and which rows are real (``(B, L)``)."""
    xp = parts.xp
    _, saved = _forward(p, parts)
    probs = saved["probs"]
    mapped_far = xp.sum(probs * parts.far_weights, axis=-1)
    mapped_near = xp.sum(xp.where(parts.near_weights > 0, probs, xp.zeros_like(probs)), axis=-1)
    log_exact = xp.matmul(parts.q, xp.matrix_transpose(parts.k)) * parts.scale - parts.near_top
    neg = constant(xp, -math.inf, log_exact)
    log_far = xp.where(parts.far, log_exact, neg)
    top = xp.max(log_far, axis=-1, keepdims=True)
    top = xp.where(xp.isfinite(top), top, xp.zeros_like(top))
    masses = [
        xp.sum(xp.exp(log_far - top), axis=-1),
        xp.sum(parts.near_weights, axis=-1),
        mapped_far,
        mapped_near,
    ]
    far, near, m_far, m_near = (np.asarray(to_host(x), dtype=np.float64) for x in masses)
    usable = (far > 0) & (near > 0) & (m_far > 0) & (m_near > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        log_ratio = np.log(far) + np.asarray(to_host(top[..., 0]), dtype=np.float64)
        log_ratio = log_ratio - np.log(near) - np.log(m_far) + np.log(m_near)
    log_ratio = np.where(usable, log_ratio, np.nan)
    return log_ratio, np.asarray(to_host(parts.rows[..., 0]))[:, 0, 0] > 0


def _one_blas_thread() -> Any:
    """One BLAS thread: the fit's many small ``L x L`` products only contend with more
    (measured: 12-20x faster than OpenBLAS on 2 threads for ``(8, 12, 256, 64)`` stacks)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return contextlib.nullcontext()
    return threadpool_limits(limits=1, user_api="blas")


def _terminal_progress(line: str) -> None:
    if sys.stderr.isatty():
        print(f"\r{line}", end="", file=sys.stderr, flush=True)


# -- saving and loading -------------------------------------------------------------------


def save_maps(
    path: str | Path,
    maps: Sequence[FeatureMap | None],
    *,
    model_fingerprint: str,
    options: dict[str, Any] | None = None,
) -> Path:
    """Write one model's fitted maps (one per layer, None for none) to a safetensors file.

    The metadata holds ``FORMAT``, the linattn version, ``model_fingerprint`` (the
    caller's digest of the model's weights and configuration), each map's softmax scale
    and ``options`` (JSON: how the maps were fitted and are to be called).  Needs the
    ``safetensors`` package.

    Examples
    --------
    >>> import tempfile, pathlib
    >>> import linattn as la
    >>> fm = la.FeatureMap(4, 8, kind="hedgehog")
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "maps.safetensors"
    >>> _ = save_maps(path, [fm, None], model_fingerprint="abc", options={"window": 4})
    >>> layers, options = load_maps(path, model_fingerprint="abc")
    >>> layers[0][0].fingerprint == fm.fingerprint, layers[1], options
    (True, (None, None), {'window': 4})
    """
    from safetensors.numpy import save_file

    import linattn

    tensors: dict[str, np.ndarray] = {}
    for layer, fm in enumerate(maps):
        if fm is None:
            continue
        if fm.parameters is None:
            raise ValueError(f"maps[{layer}] must be a fitted map; got kind={fm.kind!r}")
        for name, array in fm.parameters.arrays().items():
            tensors[f"layer.{layer}.{name}"] = np.ascontiguousarray(array)
    metadata = {
        "format": FORMAT,
        "linattn_version": linattn.__version__,
        "model_fingerprint": str(model_fingerprint),
        "num_layers": str(len(maps)),
        "options": json.dumps(options or {}, sort_keys=True),
        "scales": json.dumps([None if m is None else m.scale for m in maps]),
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=metadata)
    return path


def exact_heads_of(options: Mapping[str, Any], num_layers: int) -> list[tuple[int, ...]]:
    """Each layer's exact heads from a fitted-maps file's options (:func:`load_maps`),
    ``()`` for every layer where the file lists none.

    Examples
    --------
    >>> exact_heads_of({"exact_heads_per_layer": [[2], []]}, 2)
    [(2,), ()]
    >>> exact_heads_of({}, 2)
    [(), ()]
    """
    listed = options.get(EXACT_HEADS_ENTRY) or [[]] * num_layers
    if len(listed) != num_layers:
        raise ValueError(
            f"options[{EXACT_HEADS_ENTRY!r}] must list {num_layers} layers; got {len(listed)}"
        )
    return [tuple(int(h) for h in heads) for heads in listed]


def load_maps(
    path: str | Path, *, model_fingerprint: str | None
) -> tuple[list[tuple[FeatureMap | None, np.ndarray | None]], dict[str, Any]]:
    """A model's fitted maps as ``[(feature_map, far_weight) per layer]``, and the options.

    Each map goes to :func:`linattn.linear_attention` as it is (its far weight is
    ``feature_map.parameters.far_weight``, returned for reading).  No refit.  A model
    converted with exact heads lists them per layer in the options
    (:func:`exact_heads_of`): pass each layer's to :func:`linattn.with_exact_heads` after
    ``linear_attention``.

    Raises
    ------
    ValueError
        The file is not a fitted-maps file, was fitted for another model (its
        ``model_fingerprint`` differs; ``None`` skips this check) or written by another
        linattn version.
    """
    from safetensors import safe_open

    import linattn

    path = Path(path)
    try:
        with safe_open(str(path), framework="numpy") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    except Exception as error:  # OSError, or safetensors' own error for a foreign file
        raise ValueError(f"path must be a linattn fitted-maps file; {path}: {error}") from None
    if metadata.get("format") != FORMAT:
        raise ValueError(f"path must be a linattn fitted-maps file ({FORMAT}); {path} is not")
    found = metadata.get("model_fingerprint")
    if model_fingerprint is not None and found != model_fingerprint:
        raise ValueError(
            f"{path} was fitted for another model (fingerprint {found}); this model's is "
            f"{model_fingerprint}"
        )
    if metadata.get("linattn_version") != linattn.__version__:
        raise ValueError(
            f"{path} was written by linattn {metadata.get('linattn_version')}; this is "
            f"{linattn.__version__}: refit the maps"
        )
    scales = json.loads(metadata["scales"])
    layers: list[tuple[FeatureMap | None, np.ndarray | None]] = []
    for layer in range(int(metadata["num_layers"])):
        prefix = f"layer.{layer}."
        if f"{prefix}query_weight" not in tensors:
            layers.append((None, None))
            continue
        tied = f"{prefix}key_weight" not in tensors
        key_weight = tensors[f"{prefix}{'query' if tied else 'key'}_weight"]
        far_weight = tensors[f"{prefix}far_weight"]
        if key_weight.ndim == 2:  # one far weight (safetensors keeps 0-d arrays as (1,))
            far_weight = far_weight.reshape(())
        fm = FeatureMap.fitted(
            tensors[f"{prefix}query_weight"],
            tensors[f"{prefix}query_bias"],
            key_weight=None if tied else tensors[f"{prefix}key_weight"],
            key_bias=None if tied else tensors[f"{prefix}key_bias"],
            far_weight=far_weight,
            tied=tied,
            scale=scales[layer],
        )
        assert fm.parameters is not None
        layers.append((fm, fm.parameters.far_weight))
    return layers, json.loads(metadata["options"])
