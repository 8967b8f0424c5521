"""Feature kinds: one small object per kind, holding everything that differs between kinds.

A kind turns inputs into log-features ``log phi(x)`` (and signs, for features that can
be negative) and knows the vector-Jacobian product of that map.  Random kinds work on
the projection ``p = W x_s`` and the half squared norm ``n = |x_s|^2 / 2`` of the
scaled input ``x_s`` (:meth:`linattn.FeatureMap.signed_log_features` computes both);
deterministic kinds work on ``x`` itself.  Adding a kind means adding one object to
:data:`KIND_SPECS` and its name to :data:`Kind` (and, only if it should run in the fused
CPU pass, a kernel); the kind names (:data:`KINDS`, :data:`SOFTMAX_KINDS`,
:data:`OPRF_KINDS`) are read from the objects.

The formulas are in ``docs/algorithm.md`` (sections 3 and 5).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Protocol, SupportsIndex, overload

import numpy as np

from linattn._xp import Array, Namespace, array_device, constant, from_host
from linattn.fitted import log_softmax_pairs, log_softmax_pairs_vjp

__all__ = [
    "KINDS",
    "KIND_SPECS",
    "OPRF_KINDS",
    "SOFTMAX_KINDS",
    "FeatureKind",
    "Kind",
    "KindInputs",
    "KindNames",
    "MapSizes",
    "kind_spec",
]

#: Added to ReLU features so that attention denominators stay positive.
RELU_EPSILON = 1e-3


class MapSizes(Protocol):
    """What a kind reads of its feature map (a :class:`linattn.FeatureMap` is one)."""

    @property
    def num_features(self) -> int: ...

    @property
    def head_dim(self) -> int: ...

    @property
    def projection(self) -> Any: ...


class KindInputs(NamedTuple):
    """What a kind computes from: the (scaled) input and, for random kinds, its projection.

    ``x`` is the input itself for deterministic kinds and ``sqrt(scale) Psi^(+-1) x`` for
    random ones, ``proj = W x`` and ``half_norm = |x|^2 / 2``; ``oprf_a`` is OPRF's ``A``
    (a float, or a 0-d array for a call's own statistics).
    """

    feature_map: MapSizes
    x: Array
    proj: Array | None = None
    half_norm: Array | None = None
    oprf_a: Any = None


@dataclass(frozen=True, slots=True)
class FeatureKind:
    """What one feature kind is and how it computes; subclasses implement the maps.

    Attributes
    ----------
    name : str
        The ``kind=`` string.
    random : bool
        Uses a random projection (``False``: a deterministic map of ``x``).
    rows_per_feature : int
        Projection rows per output feature: 2 for antithetic or sin/cos pairs.
    softmax : bool
        Estimates the softmax kernel ``exp(x^T y)`` without bias.
    oprf : bool
        Has FAVOR++'s parameter ``A`` (needs statistics).
    positive : bool
        Every feature is positive, so log-features exist (no signs).
    fused : bool
        The fused CPU kernel computes these features itself (``linattn_numba.cpu``).
    overflow : float
        The log-feature of an input too large for its squared norm to be computed
        (:func:`linattn.features.overflow_limit`): ``-inf`` where the true value lies
        below the float range (the Gaussian kinds: ``|x|^2 / 2`` dominates), NaN where
        it is not representable.
    fitted : bool
        Parameters fitted to a layer's attention, per role and head
        (:mod:`linattn.fitted`): ``proj`` is ``x W + b``.
    follows_half_norm : bool
        The log-features subtract (or add) ``|x|^2 / 2``: the overflow value is reached by
        setting the half norm of such a row to ``+inf`` (or NaN), an ``(L, 1)`` selection
        instead of one over every feature.
    """

    name: str
    random: bool = True
    rows_per_feature: int = 1
    softmax: bool = False
    oprf: bool = False
    positive: bool = True
    fused: bool = False
    overflow: float = math.nan
    follows_half_norm: bool = False
    fitted: bool = False

    def log_features(self, xp: Namespace, i: KindInputs) -> tuple[Array, Array | None]:
        """``(log|phi|, sign or None)`` from the input (deterministic) or its projection."""
        raise NotImplementedError

    def vjp(self, xp: Namespace, i: KindInputs, d_log: Array) -> tuple[Array, Array]:
        """Cotangents ``(d_proj, d_half_norm)`` (random kinds) or ``(dx, 0)`` (deterministic)."""
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class _Exponential(FeatureKind):
    """``exp(B w^T x + A |w|^2 - |x|^2 / 2)``; FAVOR+ has ``A = 0``, ``B = 1``.

    ``antithetic`` appends the features of ``-w`` (hyperbolic kinds).
    """

    antithetic: bool = False

    def log_features(self, xp: Namespace, i: KindInputs) -> tuple[Array, Array | None]:
        assert i.proj is not None and i.half_norm is not None
        proj, fm = i.proj, i.feature_map
        offset: Any = -0.5 * math.log(fm.num_features)
        if self.oprf:
            # (1 - 4A)^(d/4) exp(A|w|^2 + B w^T x - |x|^2/2) is unbiased for B^2 = 1 - 4A;
            # A is a float (a calibrated map) or a 0-d array (a call's own statistics).
            proj = _slope(xp, i.oprf_a) * proj
            offset = offset + 0.25 * fm.head_dim * _log1p(xp, -4.0 * i.oprf_a)
        if self.antithetic:
            proj = xp.concat([proj, -proj], axis=-1)
        log_phi = proj - i.half_norm + offset
        if self.oprf:
            energy = np.sum(fm.projection**2, axis=1)
            if self.antithetic:
                energy = np.concatenate([energy, energy])
            x = i.x
            log_phi = log_phi + i.oprf_a * from_host(
                xp, energy, dtype=x.dtype, device=array_device(x)
            )
        return log_phi, None

    def vjp(self, xp: Namespace, i: KindInputs, d_log: Array) -> tuple[Array, Array]:
        total = xp.sum(d_log, axis=-1, keepdims=True)
        if self.antithetic:
            half = d_log.shape[-1] // 2
            d_log = d_log[..., :half] - d_log[..., half:]
        return (_slope(xp, i.oprf_a) * d_log if self.oprf else d_log), total


@dataclass(frozen=True, slots=True)
class _Trigonometric(FeatureKind):
    """``[cos, sin](w^T x) exp(|x|^2 / 2) / sqrt(m / 2)``: signed random Fourier features."""

    def log_features(self, xp: Namespace, i: KindInputs) -> tuple[Array, Array | None]:
        proj, half_norm, fm = i.proj, i.half_norm, i.feature_map
        assert proj is not None and half_norm is not None
        trig = xp.concat([xp.cos(proj), xp.sin(proj)], axis=-1)
        size = xp.abs(trig)  # log 0 = -inf without a warning (w^T x = 0 for x = 0)
        nonzero = size > 0
        one, neg_inf = constant(xp, 1.0, size), constant(xp, -math.inf, size)
        log_size = xp.where(nonzero, xp.log(xp.where(nonzero, size, one)), neg_inf)
        return log_size + half_norm - 0.5 * math.log(fm.num_features / 2), xp.sign(trig)

    def vjp(self, xp: Namespace, i: KindInputs, d_log: Array) -> tuple[Array, Array]:
        proj = i.proj
        assert proj is not None
        zero, one = constant(xp, 0.0, d_log), constant(xp, 1.0, d_log)
        half = proj.shape[-1]
        cos, sin = xp.cos(proj), xp.sin(proj)
        d_cos = xp.where(cos == 0, zero, -d_log[..., :half] * sin / xp.where(cos == 0, one, cos))
        d_sin = xp.where(sin == 0, zero, d_log[..., half:] * cos / xp.where(sin == 0, one, sin))
        return d_cos + d_sin, -xp.sum(d_log, axis=-1, keepdims=True)


def _slope(xp: Namespace, oprf_a: Any) -> Any:
    """OPRF's ``B = sqrt(1 - 4A)``, for a float or a 0-d array ``A``."""
    if isinstance(oprf_a, float):
        return math.sqrt(1.0 - 4.0 * oprf_a)
    return xp.sqrt(1.0 - 4.0 * oprf_a)


def _log1p(xp: Namespace, value: Any) -> Any:
    return math.log1p(value) if isinstance(value, float) else xp.log1p(value)


def _log_relu(xp: Namespace, z: Array) -> Array:
    return xp.log(xp.maximum(z, xp.zeros_like(z)) + RELU_EPSILON)


def _log_relu_vjp(xp: Namespace, z: Array, d_log: Array) -> Array:
    zero = constant(xp, 0.0, d_log)
    return xp.where(z > 0, d_log / (xp.maximum(z, zero) + RELU_EPSILON), zero)


@dataclass(frozen=True, slots=True)
class _RandomReLU(FeatureKind):
    """``relu(w^T x) + 1e-3``: Performer's "generalized" kernel, not softmax."""

    def log_features(self, xp: Namespace, i: KindInputs) -> tuple[Array, Array | None]:
        assert i.proj is not None
        return _log_relu(xp, i.proj), None

    def vjp(self, xp: Namespace, i: KindInputs, d_log: Array) -> tuple[Array, Array]:
        assert i.proj is not None
        return _log_relu_vjp(xp, i.proj, d_log), constant(xp, 0.0, d_log)


@dataclass(frozen=True, slots=True)
class _ReLU(FeatureKind):
    """``relu(x) + 1e-3`` (deterministic)."""

    def log_features(self, xp: Namespace, i: KindInputs) -> tuple[Array, Array | None]:
        return _log_relu(xp, i.x), None

    def vjp(self, xp: Namespace, i: KindInputs, d_log: Array) -> tuple[Array, Array]:
        return _log_relu_vjp(xp, i.x, d_log), constant(xp, 0.0, d_log)


@dataclass(frozen=True, slots=True)
class _ELU(FeatureKind):
    """``elu(x) + 1``: ``log1p(x)`` for ``x > 0``, ``x`` otherwise (deterministic)."""

    def log_features(self, xp: Namespace, i: KindInputs) -> tuple[Array, Array | None]:
        x = i.x
        zero = xp.zeros_like(x)
        return xp.where(x > 0, xp.log1p(xp.maximum(x, zero)), xp.minimum(x, zero)), None

    def vjp(self, xp: Namespace, i: KindInputs, d_log: Array) -> tuple[Array, Array]:
        x, zero, one = i.x, constant(xp, 0.0, d_log), constant(xp, 1.0, d_log)
        return xp.where(x > 0, d_log / (one + xp.where(x > 0, x, zero)), d_log), zero


@dataclass(frozen=True, slots=True)
class _Hedgehog(FeatureKind):
    """``softmax([u, -u])`` of ``u = x W + b``: a fitted map (:mod:`linattn.fitted`)."""

    def log_features(self, xp: Namespace, i: KindInputs) -> tuple[Array, Array | None]:
        assert i.proj is not None
        return log_softmax_pairs(xp, i.proj), None

    def vjp(self, xp: Namespace, i: KindInputs, d_log: Array) -> tuple[Array, Array]:
        assert i.proj is not None
        log_phi = log_softmax_pairs(xp, i.proj)
        return log_softmax_pairs_vjp(xp, log_phi, d_log), constant(xp, 0.0, d_log)


#: Every kind, by name.
KIND_SPECS: dict[str, FeatureKind] = {
    spec.name: spec
    for spec in (
        _Exponential(
            "positive", softmax=True, fused=True, overflow=-math.inf, follows_half_norm=True
        ),
        _Exponential(
            "hyperbolic",
            rows_per_feature=2,
            softmax=True,
            fused=True,
            overflow=-math.inf,
            follows_half_norm=True,
            antithetic=True,
        ),
        _Exponential("oprf", softmax=True, oprf=True, overflow=-math.inf, follows_half_norm=True),
        _Exponential(
            "hyperbolic_oprf",
            rows_per_feature=2,
            softmax=True,
            oprf=True,
            overflow=-math.inf,
            follows_half_norm=True,
            antithetic=True,
        ),
        _Trigonometric(
            "trigonometric",
            rows_per_feature=2,
            softmax=True,
            positive=False,
            follows_half_norm=True,
        ),
        _RandomReLU("random_relu"),
        _ELU("elu", random=False),
        _ReLU("relu", random=False),
        _Hedgehog("hedgehog", random=False, rows_per_feature=2, fitted=True),
    )
}


def kind_spec(kind: object) -> FeatureKind:
    """The :class:`FeatureKind` named ``kind``: what the kind is and how it computes.

    Parameters
    ----------
    kind : str
        A ``kind=`` name, one of :data:`linattn.KINDS`.

    Returns
    -------
    FeatureKind
        Its flags (``random``, ``rows_per_feature``, ``softmax``, ``oprf``, ...) and its
        log-features.

    Raises
    ------
    ValueError
        ``kind`` is not a kind name (the message lists them).

    Examples
    --------
    >>> from linattn.features import kind_spec
    >>> spec = kind_spec("hyperbolic")
    >>> spec.random, spec.rows_per_feature, spec.softmax
    (True, 2, True)
    """
    if not isinstance(kind, str) or kind not in KIND_SPECS:
        raise ValueError(f"kind must be one of {sorted(KIND_SPECS)}; got {kind!r}")
    return KIND_SPECS[kind]


#: The ``kind=`` names, in the order of :data:`KIND_SPECS` (a test checks that they are
#: its keys: a type checker needs them spelled out).
Kind = Literal[
    "positive",
    "hyperbolic",
    "oprf",
    "hyperbolic_oprf",
    "trigonometric",
    "random_relu",
    "elu",
    "relu",
    "hedgehog",
]

_KINDS_DEPRECATED = (
    "linattn.KINDS is a tuple of kind names; {use} is deprecated: use "
    "linattn.features.kind_spec(name).random / .rows_per_feature"
)


class KindNames(tuple[str, ...]):
    """The kind names, a tuple (for one release also the former dict of their facts).

    Iterating, ``in``, ``len`` and integer indices are the tuple's.  The former dict's
    ``KINDS[name]``, ``items()``, ``keys()``, ``values()`` and ``get()`` still give its
    values ``(uses a random projection, projection rows per output feature)`` with a
    :class:`DeprecationWarning`; :func:`linattn.features.kind_spec` gives them as attributes.

    Examples
    --------
    >>> import linattn as la
    >>> "oprf" in la.KINDS, la.KINDS[0], len(la.KINDS) == len(set(la.KINDS))
    (True, 'positive', True)
    """

    __slots__ = ()

    @overload
    def __getitem__(self, key: SupportsIndex, /) -> str: ...
    @overload
    def __getitem__(self, key: slice, /) -> tuple[str, ...]: ...
    @overload
    def __getitem__(self, key: str, /) -> tuple[bool, int]: ...
    def __getitem__(self, key: SupportsIndex | slice | str, /) -> Any:
        if isinstance(key, str):
            _warn_dict_use("KINDS[name]")
            if key not in self:
                raise KeyError(key)
            return _old_entry(key)
        return super().__getitem__(key)

    def items(self) -> list[tuple[str, tuple[bool, int]]]:
        """Deprecated: ``(name, (random, rows_per_feature))`` for each kind."""
        _warn_dict_use("KINDS.items()")
        return [(name, _old_entry(name)) for name in self]

    def keys(self) -> tuple[str, ...]:
        """Deprecated: the names (iterate over ``KINDS`` itself)."""
        _warn_dict_use("KINDS.keys()")
        return tuple(self)

    def values(self) -> list[tuple[bool, int]]:
        """Deprecated: ``(random, rows_per_feature)`` for each kind."""
        _warn_dict_use("KINDS.values()")
        return [_old_entry(name) for name in self]

    def get(self, key: str, default: Any = None) -> Any:
        """Deprecated: ``(random, rows_per_feature)`` of ``key``, or ``default``."""
        _warn_dict_use("KINDS.get(name)")
        return _old_entry(key) if key in self else default


def _warn_dict_use(use: str) -> None:
    # stacklevel 3: the caller of the KindNames method.
    warnings.warn(_KINDS_DEPRECATED.format(use=use), DeprecationWarning, stacklevel=3)


def _old_entry(name: str) -> tuple[bool, int]:
    """The former ``KINDS[name]``: ``(uses a random projection, rows per feature)``."""
    spec = KIND_SPECS[name]
    return spec.random, spec.rows_per_feature


#: Every feature kind's name, in the order of :data:`KIND_SPECS` (a tuple;
#: :class:`KindNames` keeps the former dict's uses for one release, deprecated).
KINDS = KindNames(KIND_SPECS)
#: Kinds whose features estimate the softmax kernel exp(x^T y) without bias.
SOFTMAX_KINDS = tuple(name for name, spec in KIND_SPECS.items() if spec.softmax)
#: Kinds with the OPRF (FAVOR++) parameter A.
OPRF_KINDS = tuple(name for name, spec in KIND_SPECS.items() if spec.oprf)
