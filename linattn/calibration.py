"""Query/key statistics for the lower-variance estimators (``docs/algorithm.md``, section 14).

* OPRF / FAVOR++: the closed-form optimal ``A*`` from ``rho = E|x + y|^2 / d``.
* SADERF rebalancing: the diagonal ``Psi`` that balances per-coordinate query and
  key energy while keeping every ``x^T y``.

Statistics are O(L d) reductions computed in the caller's namespace and brought to
the host as a handful of floats, so they act as constants for gradients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from linattn._xp import Array, Namespace, constant, to_host

__all__ = ["QueryKeyStatistics", "oprf_optimal_a", "query_key_statistics", "rebalance_scales"]


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
        d = self.query_mean.shape[0]
        total = (
            self.query_energy.sum()
            + self.key_energy.sum()
            + 2.0 * float(self.query_mean @ self.key_mean)
        )
        return float(total) / d


def query_key_statistics(
    xp: Namespace, x: Array, y: Array, key_mask: Array | None = None
) -> QueryKeyStatistics:
    """Moments of ``x`` (``(..., L_q, d)``) and ``y`` (``(..., L_k, d)``); masked keys excluded."""
    d = x.shape[-1]
    xs = xp.reshape(x, (-1, d))
    if key_mask is None:
        ys = xp.reshape(y, (-1, d))
        weights = None
    else:
        full = xp.broadcast_to(key_mask[..., None], (*key_mask.shape, d))
        shape = np.broadcast_shapes(tuple(y.shape), tuple(full.shape))
        keep = xp.reshape(xp.broadcast_to(full, shape), (-1, d))
        # Select, never multiply: a masked key may hold NaN or inf (0 * inf is NaN).
        ys = xp.where(keep, xp.reshape(xp.broadcast_to(y, shape), (-1, d)), constant(xp, 0.0, y))
        weights = xp.astype(keep, y.dtype)
    q_mean = to_host(xp.mean(xs, axis=0))
    q_energy = to_host(xp.mean(xs * xs, axis=0))
    if weights is None:
        k_mean = to_host(xp.mean(ys, axis=0))
        k_energy = to_host(xp.mean(ys * ys, axis=0))
    else:
        count = np.maximum(to_host(xp.sum(weights, axis=0)), 1.0)
        k_mean = to_host(xp.sum(ys * weights, axis=0)) / count
        k_energy = to_host(xp.sum(ys * ys * weights, axis=0)) / count
    as64 = [np.asarray(a, dtype=np.float64) for a in (q_mean, k_mean, q_energy, k_energy)]
    return QueryKeyStatistics(*as64)


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
    q, k = stats.query_energy, stats.key_energy
    ok = (q > 0) & (k > 0)
    ratio = np.divide(k, q, out=np.ones_like(q), where=ok)
    return np.where(ok, ratio**0.25, 1.0)
