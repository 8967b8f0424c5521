"""Calibration batches: one layer's activations (:class:`LayerBatch`), and what the loss
needs of each (:class:`Parts`, made by :func:`prepare`: grouped shapes, near and far
keys, the exact softmax target) in :data:`~linattn.transfer.threads.PIECES` pieces of
rows.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np

from linattn._gqa import grouped
from linattn._xp import Array, Namespace, array_device, constant, from_host, namespace_of
from linattn.hybrid.dense import near_and_far
from linattn.transfer.threads import PIECES

__all__ = ["LayerBatch", "Parts", "prepare", "sampled_rows"]


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
class Parts:
    """What one batch needs besides the parameters (grouped shapes, masks, target)."""

    xp: Namespace
    q: Array  # (B, H_kv, G, L_q, d): every query row, or the sampled ones
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

    def pieces(self, count: int = PIECES) -> list[Parts]:
        """This batch as up to ``count`` batches of consecutive rows (none empty)."""
        size = int(self.q.shape[0])
        bounds = [size * i // count for i in range(count + 1)]
        names = ("q", "k", "v", "far", "far_weights", "near_weights", "near_top", "rows")
        return [
            replace(self, **{name: getattr(self, name)[a:b, ...] for name in (*names, "target")})
            for a, b in itertools.pairwise(bounds)
            if b > a
        ]


def sampled_rows(length: int, count: int | None, seed: int) -> np.ndarray | None:
    """The query rows a fit takes of a batch of ``length`` tokens: all (None) where
    ``count`` is None or at least ``length``, else ``count`` distinct positions drawn
    with ``seed``, in order.  The loss of a long input needs each query row's exact
    output over every key, ``L`` weights per row and head: sampled rows keep that
    ``count x L`` instead of ``L x L``.

    Examples
    --------
    >>> sampled_rows(10, None, 0) is None, sampled_rows(10, 20, 0) is None
    (True, True)
    >>> rows = sampled_rows(1000, 4, 0)
    >>> rows.shape, bool(np.all(np.diff(rows) > 0))
    ((4,), True)
    """
    if count is None or count >= length:
        return None
    return np.sort(np.random.default_rng(seed).choice(length, size=count, replace=False))


def prepare(
    batch: LayerBatch,
    window: int | None,
    sink_keys: int,
    causal: bool,
    scale: float,
    rows: np.ndarray | None = None,
) -> Parts:
    """One batch's :class:`Parts`, its arguments checked (before any work); ``rows``:
    the query rows it keeps (positions, :func:`sampled_rows`; None: all)."""
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
    queries = None
    if rows is not None:
        queries = from_host(xp, np.asarray(rows), dtype=xp.int64, device=array_device(q))
        gq = xp.take(gq, queries, axis=3)
    near, far = near_and_far(
        xp, length, array_device(q), causal=causal, window=window, sink_keys=sink_keys,
        real=key_mask[:, None, None, None, :],
        exact=None if exact is None else exact[:, None, None, None, :], queries=queries,
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
    real_rows = key_mask if queries is None else xp.take(key_mask, queries, axis=1)
    row_weights = xp.astype(real_rows, q.dtype)[:, None, None, :, None]
    near_top = xp.max(xp.where(near, log_exact, neg), axis=-1, keepdims=True)
    near_top = xp.where(xp.isfinite(near_top), near_top, xp.zeros_like(near_top))
    near_weights = xp.exp(xp.where(near, log_exact - near_top, neg))
    return Parts(
        xp, gq, gk, gv, far, xp.astype(far, q.dtype), near_weights, near_top, row_weights,
        scale, target, gq.shape[2] > 1,
    )  # fmt: skip
