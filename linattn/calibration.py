"""Query/key statistics for the lower-variance estimators (``docs/algorithm.md``, section 14).

* OPRF / FAVOR++: the closed-form optimal ``A*`` from ``rho = E|x + y|^2 / d``.
* SADERF rebalancing: the diagonal ``Psi`` that balances per-coordinate query and
  key energy while keeping every ``x^T y``.

The formulas are written once, in the array API (:func:`statistics_from_moments`):
:meth:`linattn.FeatureMap.calibrate` evaluates them on the host after one transfer of
the moments (one compute on Dask), and a call to :func:`linattn.linear_attention` with
an uncalibrated map evaluates them on the caller's device, under ``stop_gradient``, so
that they work under ``jax.jit`` and act as constants for gradients either way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from linattn._xp import Array, Namespace, array_namespace, constant, stop_gradient, to_host

__all__ = [
    "QueryKeyStatistics",
    "Statistics",
    "moments",
    "oprf_optimal_a",
    "per_call_statistics",
    "query_key_statistics",
    "rebalance_scales",
    "statistics_from_moments",
]


@dataclass(frozen=True)
class QueryKeyStatistics:
    """First and second moments of scaled queries ``x`` and keys ``y`` (host arrays)."""

    query_mean: np.ndarray  # E[x], shape (d,)
    key_mean: np.ndarray  # E[y]
    query_energy: np.ndarray  # E[x_l^2] per coordinate
    key_energy: np.ndarray  # E[y_l^2]

    @property
    def rho(self) -> float:
        """``E|x + y|^2 / d`` over independent query-key pairs."""
        return float(_rho(np, *self.arrays()))

    def arrays(self) -> tuple[np.ndarray, ...]:
        """``(query_mean, key_mean, query_energy, key_energy)``."""
        return self.query_mean, self.key_mean, self.query_energy, self.key_energy


@dataclass(frozen=True)
class Statistics:
    """Per-call statistics as arrays of the caller's namespace (never stored in a map).

    ``oprf_a`` is 0-d, ``rebalance_scales`` has shape ``(d,)``; either may be ``None``.
    """

    oprf_a: Any = None
    rebalance_scales: Any = None


def moments(
    xp: Namespace,
    x: Array,
    y: Array,
    key_mask: Array | None = None,
    query_mask: Array | None = None,
) -> Array:
    """``[E x, E y, E x^2, E y^2]`` per coordinate, shape ``(4, d)``; masked rows excluded."""
    query = _masked_moments(xp, x, query_mask)
    key = _masked_moments(xp, y, key_mask)
    return xp.stack([query[0], key[0], query[1], key[1]])


def _masked_moments(xp: Namespace, x: Array, mask: Array | None) -> tuple[Array, Array]:
    """Mean and mean square per coordinate of the rows of ``x`` that ``mask`` keeps."""
    d = x.shape[-1]
    if mask is None:
        rows = xp.reshape(x, (-1, d))
        return xp.mean(rows, axis=0), xp.mean(rows * rows, axis=0)
    full = xp.broadcast_to(mask[..., None], (*mask.shape, d))
    shape = np.broadcast_shapes(tuple(x.shape), tuple(full.shape))
    keep = xp.reshape(xp.broadcast_to(full, shape), (-1, d))
    # Select, never multiply: a masked row may hold NaN or inf (0 * inf is NaN).
    rows = xp.where(keep, xp.reshape(xp.broadcast_to(x, shape), (-1, d)), constant(xp, 0.0, x))
    count = xp.maximum(xp.sum(xp.astype(keep, x.dtype), axis=0), constant(xp, 1.0, x))
    return xp.sum(rows, axis=0) / count, xp.sum(rows * rows, axis=0) / count


def query_key_statistics(
    xp: Namespace,
    x: Array,
    y: Array,
    key_mask: Array | None = None,
    query_mask: Array | None = None,
) -> QueryKeyStatistics:
    """Moments of ``x`` (``(..., L_q, d)``) and ``y`` (``(..., L_k, d)``) on the host.

    One transfer (one compute for Dask inputs).
    """
    host = np.asarray(to_host(moments(xp, x, y, key_mask, query_mask)), dtype=np.float64)
    return QueryKeyStatistics(*host)


def statistics_from_moments(
    xp: Namespace, stacked: Array, *, rebalance: bool, oprf: bool
) -> tuple[Array | None, Array | None]:
    """``(Psi, A*)`` from ``[E x, E y, E x^2, E y^2]`` (``None`` for what is not asked).

    ``Psi`` rebalances first; ``A*`` then uses the rebalanced moments.
    """
    query_mean, key_mean, query_energy, key_energy = (stacked[i, ...] for i in range(4))
    psi = None
    if rebalance:
        ok = xp.logical_and(query_energy > 0, key_energy > 0)
        one = xp.ones_like(query_energy)
        ratio = xp.where(ok, key_energy, one) / xp.where(ok, query_energy, one)
        psi = xp.where(ok, ratio**0.25, one)
        query_mean, key_mean = query_mean * psi, key_mean / psi
        query_energy, key_energy = query_energy * psi**2, key_energy / psi**2
    a = None
    if oprf:
        rho = _rho(xp, query_mean, key_mean, query_energy, key_energy)
        a = (1.0 - 2.0 * rho - xp.sqrt((2.0 * rho + 1.0) ** 2 + 8.0 * rho)) / 16.0
    return psi, a


def per_call_statistics(
    xp: Namespace,
    x: Array,
    y: Array,
    key_mask: Array | None,
    *,
    rebalance: bool,
    oprf: bool,
    query_mask: Array | None = None,
) -> Statistics:
    """The statistics a call computes for itself, on the device, held constant."""
    stacked = stop_gradient(xp, moments(xp, x, y, key_mask, query_mask))
    psi, a = statistics_from_moments(xp, stacked, rebalance=rebalance, oprf=oprf)
    return Statistics(oprf_a=a, rebalance_scales=psi)


def oprf_optimal_a(rho: float) -> float:
    """``A* = (1 - 2 rho - sqrt((2 rho + 1)^2 + 8 rho)) / 16``, always <= 0 (< 1/8 as needed).

    Examples
    --------
    >>> oprf_optimal_a(0.0)
    0.0
    >>> round(oprf_optimal_a(1.0), 6)
    -0.320194
    """
    if not (math.isfinite(rho) and rho >= 0):
        raise ValueError(f"rho must be a finite non-negative number; got {rho!r}")
    return (1.0 - 2.0 * rho - math.sqrt((2.0 * rho + 1.0) ** 2 + 8.0 * rho)) / 16.0


def rebalance_scales(stats: QueryKeyStatistics) -> np.ndarray:
    """``Psi_l = (E[y_l^2] / E[x_l^2])^(1/4)``; 1 where either energy is zero.

    Queries are multiplied by ``Psi`` and keys divided by it: ``x^T y`` is unchanged
    and ``E|Psi x + Psi^-1 y|^2``, which drives the variance, is smallest.
    """
    psi, _ = statistics_from_moments(
        array_namespace(stats.query_mean),
        np.stack(stats.arrays()),
        rebalance=True,
        oprf=False,
    )
    return np.asarray(psi)


def _rho(xp: Namespace, query_mean: Any, key_mean: Any, query_energy: Any, key_energy: Any) -> Any:
    d = query_mean.shape[0]
    total = xp.sum(query_energy) + xp.sum(key_energy) + 2.0 * xp.sum(query_mean * key_mean)
    return total / d
