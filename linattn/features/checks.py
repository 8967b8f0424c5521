"""A feature map's arguments checked, its arrays frozen and its fingerprint computed.

:class:`linattn.FeatureMap` sets its fields once, in ``_assign``, from what these
functions return: every way of making a map (the constructor,
:meth:`~linattn.FeatureMap.from_projection`, :meth:`~linattn.FeatureMap.fitted`, copies
and unpickling) passes through :func:`checked_fields`.
"""

from __future__ import annotations

import hashlib
from typing import Any, NamedTuple

import numpy as np

from linattn._checks import check_scale
from linattn._xp import is_array, to_host
from linattn.features.kinds import SOFTMAX_KINDS, FeatureKind, kind_spec
from linattn.features.statistics import check_oprf_a, check_rebalance_scales
from linattn.fitted import FittedParameters
from linattn.projections import MAX_PROJECTION_SIZE

__all__ = [
    "CheckedFields",
    "adopted_projection",
    "check_map_arguments",
    "check_seed",
    "checked_fields",
    "frozen",
]


def check_map_arguments(
    head_dim: int, num_features: int, kind: object, orthogonal: bool, seed: int
) -> FeatureKind:
    """The kind of a :class:`linattn.FeatureMap` made by its constructor, after every
    check of the constructor's arguments but ``norms``, ``scale`` and ``rebalance``.

    Examples
    --------
    >>> from linattn.features.checks import check_map_arguments
    >>> check_map_arguments(4, 8, "hyperbolic", True, 0).rows_per_feature
    2
    """
    _check_positive_int("head_dim", head_dim)
    _check_positive_int("num_features", num_features)
    spec = kind_spec(kind)
    if head_dim * num_features > MAX_PROJECTION_SIZE:
        raise ValueError(
            f"num_features x head_dim must be at most {MAX_PROJECTION_SIZE} (a "
            f"{8 * MAX_PROJECTION_SIZE // 2**30} GiB projection); got "
            f"{num_features} x {head_dim}"
        )
    if num_features % spec.rows_per_feature:
        raise ValueError(
            f"num_features must be even for kind={kind!r} (it uses num_features / 2 "
            f"projection rows); got {num_features}"
        )
    if not spec.random and not spec.fitted and num_features != head_dim:
        raise ValueError(
            f"num_features must equal head_dim for the deterministic kind {kind!r}; "
            f"got num_features={num_features}, head_dim={head_dim}"
        )
    check_seed(seed)
    if not isinstance(orthogonal, bool | np.bool_):
        raise TypeError(f"orthogonal must be True or False; got {orthogonal!r}")
    return spec


def adopted_projection(matrix: Any, kind: object) -> tuple[np.ndarray, FeatureKind]:
    """``(host matrix, kind)`` for :meth:`linattn.FeatureMap.from_projection`, checked.

    Examples
    --------
    >>> import numpy as np
    >>> from linattn.features.checks import adopted_projection
    >>> host, spec = adopted_projection(np.eye(2), "positive")
    >>> host.shape, spec.name
    ((2, 2), 'positive')
    """
    spec = kind_spec(kind)
    if not spec.random:
        raise ValueError(f"kind must be a random feature kind to adopt a projection; got {kind!r}")
    host = to_host(matrix) if is_array(matrix) else matrix
    host = np.asarray(host)
    if host.ndim != 2 or 0 in host.shape:
        raise ValueError(
            f"matrix must be a non-empty 2-d (rows, head_dim) array; got shape {host.shape}"
        )
    if not (np.issubdtype(host.dtype, np.floating) and np.all(np.isfinite(host))):
        raise ValueError(f"matrix must hold finite real floating values; got dtype {host.dtype}")
    return host, spec


class CheckedFields(NamedTuple):
    """What :func:`checked_fields` returns: the checked values a map holds."""

    scale: float
    oprf_a: float | None
    rebalance_scales: np.ndarray | None  # read-only
    projection: np.ndarray | None  # a read-only float64 copy
    fingerprint: str


def checked_fields(
    *,
    head_dim: int,
    num_features: int,
    kind: str,
    scale: float | None,
    projection: np.ndarray | None,
    rebalance: bool,
    oprf_a: float | None,
    rebalance_scales: Any,
    parameters: FittedParameters | None,
) -> CheckedFields:
    """Check the statistics and scale, freeze the arrays and compute the fingerprint.

    Examples
    --------
    >>> from linattn.features.checks import checked_fields
    >>> fields = checked_fields(
    ...     head_dim=4, num_features=4, kind="elu", scale=None, projection=None,
    ...     rebalance=False, oprf_a=None, rebalance_scales=None, parameters=None,
    ... )
    >>> fields.scale, len(fields.fingerprint)
    (0.5, 16)
    """
    spec = kind_spec(kind)
    if spec.fitted != (parameters is not None):
        raise ValueError(f"kind={kind!r} {'needs' if spec.fitted else 'takes no'} parameters")
    if not isinstance(rebalance, bool):
        raise TypeError(f"rebalance must be True or False; got {rebalance!r}")
    if rebalance and not spec.softmax:
        raise ValueError(
            f"rebalance=True needs a softmax-estimating kind {SOFTMAX_KINDS}; got {kind!r}"
        )
    if oprf_a is not None:
        oprf_a = check_oprf_a(oprf_a, kind)
    if rebalance_scales is not None:
        if not rebalance:
            raise ValueError("rebalance_scales need a map made with rebalance=True")
        rebalance_scales = frozen(check_rebalance_scales(rebalance_scales, head_dim))
    scale = check_scale(scale, head_dim)
    if projection is not None:
        projection = frozen(np.array(projection, dtype=np.float64, copy=True))
    digest = hashlib.sha256(
        f"{kind}|{scale!r}|{head_dim}|{num_features}|{rebalance}|{oprf_a!r}".encode()
    )
    for part in (projection, rebalance_scales):
        if part is not None:
            digest.update(part.tobytes())
    if parameters is not None:
        for name, array in parameters.arrays().items():
            digest.update(f"|{name}{array.shape}".encode() + array.tobytes())
    return CheckedFields(scale, oprf_a, rebalance_scales, projection, digest.hexdigest()[:16])


def frozen(array: np.ndarray) -> np.ndarray:
    """``array``, made read-only (in place)."""
    array.setflags(write=False)
    return array


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{name} must be a positive integer; got {value!r}")


def check_seed(seed: object) -> None:
    """``seed`` is a non-negative integer (``ValueError`` otherwise).

    (``object``: the annotation says what a caller should pass, not what it did.)
    """
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer; got {seed!r}")
