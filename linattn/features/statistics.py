"""A map's statistics: OPRF's ``A`` and the rebalancing ``Psi``, checked or calibrated.

:meth:`linattn.FeatureMap.calibrate` fixes them from queries and keys on the host
(:func:`calibrated`), :meth:`linattn.FeatureMap.with_statistics` takes them from the
user; both are checked here (:func:`check_oprf_a`, :func:`check_rebalance_scales`)
before a map holds them.  A call's own statistics (bidirectional attention with an
uncalibrated map) are :mod:`linattn.calibration`'s.  The formulas are in
``docs/algorithm.md`` (section 5).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from linattn._checks import check_key_mask, check_query_mask, key_mask_batch_shape
from linattn._xp import (
    Array,
    array_namespace,
    float_dtype,
    is_array,
    is_jax_array,
    namespace_of,
    to_host,
)
from linattn.calibration import query_key_statistics, statistics_from_moments
from linattn.features.kinds import OPRF_KINDS, kind_spec

__all__ = ["MIN_OPRF_A", "calibrated", "check_oprf_a", "check_rebalance_scales"]

#: The most negative OPRF ``A`` accepted.  ``A* ~ -rho / 4`` for large ``rho =
#: E|x + y|^2 / d``; ``A < -1e4`` means ``rho > 4e4``: scaled logits with a standard
#: deviation above ``2e4``, beyond the exponent range of every float type, where no
#: random-feature estimate means anything (and ``B = sqrt(1 - 4A)`` overflows soon after).
MIN_OPRF_A = -1e4


def calibrated(
    q: Array,
    k: Array,
    /,
    *,
    head_dim: int,
    scale: float,
    rebalance: bool,
    oprf: bool,
    key_mask: Array | None = None,
    query_mask: Array | None = None,
) -> dict[str, Any]:
    """The statistics :meth:`linattn.FeatureMap.calibrate` fixes, as changes of the map.

    ``{"rebalance_scales": Psi}`` where ``rebalance``, ``{"oprf_a": A}`` where ``oprf``,
    from ``q`` and ``k`` scaled by ``sqrt(scale)``, after every check of the arguments
    (named as ``calibrate`` names them).

    Examples
    --------
    >>> import numpy as np
    >>> from linattn.features.statistics import calibrated
    >>> rng = np.random.default_rng(0)
    >>> q, k = rng.normal(size=(64, 8)), rng.normal(size=(64, 8))
    >>> changes = calibrated(q, k, head_dim=8, scale=8**-0.5, rebalance=True, oprf=True)
    >>> sorted(changes), changes["rebalance_scales"].shape
    (['oprf_a', 'rebalance_scales'], (8,))
    """
    xp = namespace_of(
        {"q": q, "k": k, "key_mask": key_mask, "query_mask": query_mask},
        optional=("key_mask", "query_mask"),
    )
    for name, x in (("q", q), ("k", k)):
        float_dtype(xp, name, x)
        if x.ndim < 2 or x.shape[-1] != head_dim or x.shape[-2] == 0:
            raise ValueError(
                f"{name} must have shape (..., L, {head_dim}) with L >= 1; got {tuple(x.shape)}"
            )
        _refuse_traced(name, x)
    if key_mask is not None:
        check_key_mask(xp, key_mask, k.shape[-2], k=k, q=q)
        key_mask_batch_shape(key_mask, k)
    if query_mask is not None:
        check_query_mask(xp, query_mask, q)
    root = math.sqrt(scale)
    stats = query_key_statistics(
        xp,
        xp.astype(q, xp.float64) * root,
        xp.astype(k, xp.float64) * root,
        key_mask,
        query_mask,
    )
    moments = np.stack(stats.arrays())
    if not np.all(np.isfinite(moments)):
        raise ValueError(
            "calibrate needs finite q and (unmasked) k: their mean or energy came out "
            "non-finite (NaN, inf or overflowing values in the inputs)"
        )
    psi, a = statistics_from_moments(
        array_namespace(moments),
        moments,
        rebalance=rebalance,
        oprf=oprf,
    )
    changes: dict[str, Any] = {}
    if psi is not None:
        changes["rebalance_scales"] = psi
    if a is not None:
        if a < MIN_OPRF_A:
            raise ValueError(
                f"calibrate needs q and k of moderate size: their statistics give "
                f"A* = {float(a):.3g}, below {MIN_OPRF_A:g} (rho = E|x + y|^2 / d above "
                f"{-4 * MIN_OPRF_A:.0e}), where softmax is a hard maximum and no random "
                "feature estimate is meaningful"
            )
        changes["oprf_a"] = float(a)
    return changes


def _refuse_traced(name: str, x: Array) -> None:
    """``calibrate`` fixes statistics on the host: a traced array has no value yet."""
    if is_jax_array(x):
        import jax

        if isinstance(x, jax.core.Tracer):
            raise TypeError(
                f"calibrate computes statistics on the host, so {name} must be a concrete "
                "array; got a JAX tracer (inside jit or grad). Calibrate outside the "
                "traced function, or pass the uncalibrated map to linear_attention, which "
                "computes per-call statistics on the device (bidirectional attention)"
            )


def check_oprf_a(oprf_a: object, kind: str) -> float:
    """``oprf_a`` as a float, for a kind with OPRF's ``A``, in ``[MIN_OPRF_A, 1/8)``.

    Examples
    --------
    >>> from linattn.features.statistics import check_oprf_a
    >>> check_oprf_a(-1, "oprf")
    -1.0
    """
    if not kind_spec(kind).oprf:
        raise ValueError(f"oprf_a applies to kinds {OPRF_KINDS}; got kind={kind!r}")
    if (
        isinstance(oprf_a, bool)
        or not isinstance(oprf_a, int | float | np.floating | np.integer)
        or not (MIN_OPRF_A <= oprf_a < 0.125)
    ):
        raise ValueError(
            f"oprf_a must be a number below 1/8 (finite variance) and at least "
            f"{MIN_OPRF_A:g} (see MIN_OPRF_A); got {oprf_a!r}"
        )
    return float(oprf_a)


def check_rebalance_scales(scales: Any, head_dim: int) -> np.ndarray:
    """``scales`` as a new float64 NumPy array of ``head_dim`` positive finite numbers.

    Examples
    --------
    >>> from linattn.features.statistics import check_rebalance_scales
    >>> check_rebalance_scales([1, 2], 2)
    array([1., 2.])
    """
    host = to_host(scales) if is_array(scales) else np.asarray(scales)
    if host.dtype.kind not in "iuf":
        raise TypeError(
            f"rebalance_scales must be {head_dim} real numbers; got dtype {host.dtype}"
        )
    host = np.array(host, dtype=np.float64, copy=True)
    if host.shape != (head_dim,) or not np.all(np.isfinite(host) & (host > 0)):
        raise ValueError(
            f"rebalance_scales must be {head_dim} positive finite numbers; got shape {host.shape}"
        )
    return host
