"""How a feature map computes: its checked, scaled input, and log-features and their VJP.

:class:`linattn.FeatureMap`'s :meth:`~linattn.FeatureMap.signed_log_features`,
:meth:`~linattn.FeatureMap.log_features_vjp` and
:meth:`~linattn.FeatureMap.log_features_parameter_vjp` are these functions.  Random kinds
project the scaled input ``x_s = sqrt(scale) Psi^(+-1) x`` (``Psi`` for rebalanced
queries, ``1 / Psi`` for keys) and hand ``W x_s`` and ``|x_s|^2 / 2`` to the map's kind
(:mod:`linattn.features.kinds`); rows too large for ``|x_s|^2`` get the kind's overflow
value.  The formulas are in ``docs/algorithm.md`` (sections 2, 3 and 5).
"""

from __future__ import annotations

import math
from typing import Any, Literal, Protocol

import numpy as np

from linattn import fitted
from linattn._xp import (
    Array,
    array_device,
    compute_dtype,
    constant,
    float_dtype,
    from_host,
    namespace_of,
)
from linattn.calibration import Statistics
from linattn.features.kinds import FeatureKind, KindInputs, MapSizes
from linattn.fitted import FittedParameters

__all__ = [
    "MapView",
    "Role",
    "log_features_vjp",
    "overflow_limit",
    "parameter_vjp",
    "signed_log_features",
]

Role = Literal["query", "key"]


class MapView(MapSizes, Protocol):
    """What computing features reads of a map (a :class:`linattn.FeatureMap` is one)."""

    @property
    def kind(self) -> str: ...

    @property
    def scale(self) -> float: ...

    @property
    def rebalance(self) -> bool: ...

    @property
    def oprf_a(self) -> float | None: ...

    @property
    def rebalance_scales(self) -> np.ndarray | None: ...

    @property
    def parameters(self) -> FittedParameters | None: ...

    @property
    def spec(self) -> FeatureKind: ...


def signed_log_features(
    fm: MapView, x: Array, /, *, role: Role | None = None, statistics: Statistics | None = None
) -> tuple[Array, Array | None]:
    """``(log|phi(x)|, sign(phi(x)))`` of the map ``fm``
    (:meth:`linattn.FeatureMap.signed_log_features`).

    Examples
    --------
    >>> import numpy as np
    >>> import linattn as la
    >>> from linattn.features.compute import signed_log_features
    >>> fm = la.FeatureMap(4, 8, seed=0)
    >>> log_phi, sign = signed_log_features(fm, np.ones((2, 4)))
    >>> log_phi.shape, sign is None
    ((2, 8), True)
    """
    xp, x = _check_input(fm, x, role, statistics)
    oprf_a, psi = _statistics(fm, statistics)
    if fm.parameters is not None:
        return fitted.log_features(xp, fm.parameters, x, _role(fm, role)), None
    if not fm.spec.random:
        return fm.spec.log_features(xp, KindInputs(fm, x, oprf_a=oprf_a))
    x, overflow = _without_overflow(fm, xp, x, role, psi)
    x = x * _input_factor(fm, xp, x, role, psi)
    proj = xp.matmul(x, xp.matrix_transpose(_projection_like(fm, xp, x)))
    half_norm = xp.sum(x * x, axis=-1, keepdims=True) / 2
    spec = fm.spec
    if spec.follows_half_norm:  # -inf (or NaN) through the half norm: an (L, 1) select
        # +inf gives 0 - inf = -inf for the Gaussian kinds, NaN gives NaN for the others.
        fill = math.inf if spec.overflow == -math.inf else math.nan
        half_norm = xp.where(overflow, constant(xp, fill, half_norm), half_norm)
    log_phi, sign = spec.log_features(xp, KindInputs(fm, x, proj, half_norm, oprf_a))
    if not spec.follows_half_norm:
        log_phi = xp.where(overflow, constant(xp, spec.overflow, log_phi), log_phi)
    return log_phi, sign


def log_features_vjp(
    fm: MapView,
    x: Array,
    d_log: Array,
    /,
    *,
    role: Role | None = None,
    statistics: Statistics | None = None,
) -> Array:
    """``dx`` from the cotangent ``d_log``: :meth:`linattn.FeatureMap.log_features_vjp`.

    Examples
    --------
    >>> import numpy as np
    >>> import linattn as la
    >>> from linattn.features.compute import log_features_vjp
    >>> fm = la.FeatureMap(4, 4, kind="relu")
    >>> log_features_vjp(fm, np.ones((1, 4)), np.ones((1, 4))).round(4).tolist()
    [[0.999, 0.999, 0.999, 0.999]]
    """
    xp, x = _check_input(fm, x, role, statistics)
    oprf_a, psi = _statistics(fm, statistics)
    x = xp.astype(x, d_log.dtype, copy=False)
    if fm.parameters is not None:
        return fitted.input_vjp(xp, fm.parameters, x, d_log, _role(fm, role))
    if not fm.spec.random:
        return fm.spec.vjp(xp, KindInputs(fm, x, oprf_a=oprf_a), d_log)[0]
    x, overflow = _without_overflow(fm, xp, x, role, psi)
    factor = _input_factor(fm, xp, x, role, psi)
    x = x * factor
    projection = _projection_like(fm, xp, x)
    proj = xp.matmul(x, xp.matrix_transpose(projection))
    d_proj, d_half_norm = fm.spec.vjp(xp, KindInputs(fm, x, proj, None, oprf_a), d_log)
    dx = factor * (xp.matmul(d_proj, projection) - x * d_half_norm)
    return xp.where(overflow, constant(xp, 0.0, dx), dx)  # constant features there


def parameter_vjp(fm: MapView, x: Array, d_log: Array, /, *, role: Role) -> dict[str, np.ndarray]:
    """A fitted map's parameter cotangents
    (:meth:`linattn.FeatureMap.log_features_parameter_vjp`).

    Examples
    --------
    >>> import numpy as np
    >>> import linattn as la
    >>> from linattn.features.compute import parameter_vjp
    >>> fm = la.FeatureMap(4, 8, kind="hedgehog")
    >>> sorted(parameter_vjp(fm, np.ones((3, 4)), np.ones((3, 8)), role="query"))
    ['query_bias', 'query_weight']
    """
    parameters = fm.parameters
    if parameters is None:
        raise ValueError(f"log_features_parameter_vjp needs a fitted map; got kind={fm.kind!r}")
    xp, x = _check_input(fm, x, role)
    x = xp.astype(x, d_log.dtype, copy=False)
    role = _role(fm, role)
    grads = fitted.parameter_vjp(xp, parameters, x, d_log, role)
    if parameters.tied and role == "key":
        grads["query_weight"] = grads.pop("key_weight")
        grads["query_bias"] = grads.pop("key_bias")
    return grads


def overflow_limit(xp: Any, dtype: Any, head_dim: int) -> float:
    """The largest scaled input entry whose row's half squared norm cannot overflow.

    ``sqrt(float_max / (2 d))``: about ``1.5e18`` for float32 and ``3e153`` for float64
    at ``d = 64``.  Past it the Gaussian kinds' true log-features
    ``w^T x - |x|^2 / 2`` are below ``-float_max / (4 d)`` (features that are 0 in
    every float type), so they are set to ``-inf``.
    """
    return math.sqrt(float(xp.finfo(dtype).max) / (2 * head_dim))


def _role(fm: MapView, role: object) -> Role:
    """A fitted map's role: given, or ``"query"`` for a tied map's ``None``."""
    p = fm.parameters
    if role is None and p is not None and p.tied:
        return "query"
    if role not in ("query", "key"):
        raise ValueError(
            "role must be 'query' or 'key' for a fitted map with separate query and key "
            f"parameters; got {role!r}"
        )
    return role


def _statistics(fm: MapView, statistics: Statistics | None) -> tuple[Any, Any]:
    """``(A, Psi)``: the map's own, or a call's (arrays) where the map has none."""
    oprf_a, psi = fm.oprf_a, fm.rebalance_scales
    if statistics is not None:
        if oprf_a is None:
            oprf_a = statistics.oprf_a
        if psi is None and fm.rebalance:
            psi = statistics.rebalance_scales
    return oprf_a, psi


def _check_input(
    fm: MapView, x: Array, role: object, statistics: Statistics | None = None
) -> tuple[Any, Array]:
    """The namespace and ``x`` in the compute dtype, after every check on ``x``."""
    xp = namespace_of({"x": x})
    dtype = float_dtype(xp, "x", x)
    if x.ndim < 1 or x.shape[-1] != fm.head_dim:
        raise ValueError(
            f"x must have shape (..., {fm.head_dim}) to match the feature map's "
            f"head_dim; got shape {tuple(x.shape)}"
        )
    if role not in (None, "query", "key"):
        raise ValueError(f"role must be 'query', 'key' or None; got {role!r}")
    oprf_a, psi = _statistics(fm, statistics)
    if (fm.spec.oprf and oprf_a is None) or (fm.rebalance and psi is None):
        raise ValueError(
            f"this {fm.kind!r} feature map{' with rebalance=True' if fm.rebalance else ''}"
            " needs query/key statistics: expected a map from calibrate(q, k) or "
            "with_statistics(...), got one without them"
        )
    if psi is not None and role is None:
        raise ValueError("role must be 'query' or 'key' for a rebalanced feature map; got None")
    return xp, xp.astype(x, compute_dtype(xp, dtype), copy=False)


def _input_factor(fm: MapView, xp: Any, x: Array, role: object, psi: Any) -> Any:
    """``sqrt(scale)``, times ``Psi`` for rebalanced queries or ``1 / Psi`` for keys."""
    factor: Any = math.sqrt(fm.scale)
    if psi is not None:
        psi = _like(xp, psi, x)
        factor = factor * (psi if role == "query" else 1.0 / psi)
    return factor


def _without_overflow(
    fm: MapView, xp: Any, x: Array, role: object, psi: Any
) -> tuple[Array, Array]:
    """``x`` with zeros for rows too large to project, and where those rows are.

    A row whose largest scaled entry exceeds :func:`overflow_limit` could overflow
    ``|x|^2`` (and ``inf - inf`` gives NaN): its log-features are set to the kind's
    ``overflow`` value instead of being computed, with no floating-point warning.
    """
    largest = xp.max(xp.abs(x), axis=-1, keepdims=True) * math.sqrt(fm.scale)
    if psi is not None:
        psi = _like(xp, psi, x)
        largest = largest * xp.max(psi if role == "query" else 1.0 / psi)
    overflow = largest > overflow_limit(xp, x.dtype, fm.head_dim)
    return xp.where(overflow, constant(xp, 0.0, x), x), overflow


def _projection_like(fm: MapView, xp: Any, x: Array) -> Array:
    assert fm.projection is not None
    return from_host(xp, fm.projection, dtype=x.dtype, device=array_device(x))


def _like(xp: Any, values: Any, x: Array) -> Array:
    """Host (NumPy) statistics moved to ``x``'s namespace; device ones cast to its dtype."""
    if isinstance(values, np.ndarray):
        return from_host(xp, values, dtype=x.dtype, device=array_device(x))
    return xp.astype(values, x.dtype)
