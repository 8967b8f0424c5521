"""Feature maps: queries and keys to (log-)features whose inner products estimate a kernel.

Every map works in **log-features** ``l(x) = log phi(x)``: the attention code takes
log-features and does all stabilisation there (``MATH.md`` sections 1 and 4).
"""

from __future__ import annotations

import hashlib
import math
import secrets
from typing import Any, Literal

import array_api_compat
import numpy as np

from linattn._checks import check_key_mask
from linattn._xp import Array, compute_dtype, constant, float_dtype, from_host, namespace_of
from linattn.projections import Norms, gaussian_projection

__all__ = ["KINDS", "FeatureMap"]

Kind = Literal[
    "positive",
    "hyperbolic",
    "oprf",
    "hyperbolic_oprf",
    "trigonometric",
    "random_relu",
    "elu",
    "relu",
]

#: Feature kinds: ``(uses a random projection, projection rows per output feature)``.
KINDS: dict[str, tuple[bool, int]] = {
    "positive": (True, 1),
    "hyperbolic": (True, 2),
    "oprf": (True, 1),
    "hyperbolic_oprf": (True, 2),
    "trigonometric": (True, 2),
    "random_relu": (True, 1),
    "elu": (False, 1),
    "relu": (False, 1),
}

#: Kinds whose features estimate the softmax kernel exp(x^T y) without bias.
SOFTMAX_KINDS = ("positive", "hyperbolic", "oprf", "hyperbolic_oprf", "trigonometric")
#: Kinds with the OPRF (FAVOR++) parameter A.
OPRF_KINDS = ("oprf", "hyperbolic_oprf")
#: Kinds with antithetic +-w pairs.
ANTITHETIC_KINDS = ("hyperbolic", "hyperbolic_oprf")

Role = Literal["query", "key"]

#: Added to ReLU features so that attention denominators stay positive.
RELU_EPSILON = 1e-3


class FeatureMap:
    """An immutable random-feature map for linear attention.

    ``phi(x)^T phi(y)`` estimates the softmax kernel ``exp(scale * q^T k)`` (random
    kinds) or defines another kernel (deterministic kinds).  The map carries its
    projection matrix and its softmax scale, applied as ``scale**0.5`` to queries
    and keys, so one object fully determines the features.

    Parameters
    ----------
    head_dim : int
        Dimension ``d`` of queries and keys.
    num_features : int
        Number of output features ``m``.  Kinds with antithetic or paired features
        (``"hyperbolic"``, ``"trigonometric"``) use ``m / 2`` projection rows, so
        estimators compare at equal cost; ``m`` must then be even.  Deterministic
        kinds (``"elu"``, ``"relu"``) need ``m == head_dim``.
    kind : str, default "positive"
        ``"positive"`` (FAVOR+: ``exp(w^T x - |x|^2/2)``, unbiased, positive),
        ``"hyperbolic"`` (antithetic pairs ``exp(+-w^T x - |x|^2/2)``: unbiased, lower
        variance), ``"trigonometric"`` (sin/cos random Fourier features: unbiased but
        not positive, so attention denominators can approach zero; for comparison
        only), ``"random_relu"`` (``relu(w^T x) + 1e-3``, Performer's "generalized"
        kernel, not softmax), and the deterministic ``"elu"`` (``elu(x) + 1``) and
        ``"relu"`` (``relu(x) + 1e-3``) maps, which ignore ``scale``.  ``"oprf"`` and
        ``"hyperbolic_oprf"`` are FAVOR++'s optimal positive random features
        ``exp(A |w|^2 + B w^T x - |x|^2/2)``, ``B = sqrt(1 - 4A)``, without and with
        antithetic pairs; ``A`` comes from query/key statistics (:meth:`calibrate`).
    orthogonal : bool, default True
        Draw the projection as stacked Haar-orthogonal blocks (ORF) instead of iid.
    norms : {"chi", "fixed"}, default "chi"
        Row lengths of the projection, see :func:`linattn.projections.gaussian_projection`.
    scale : float, optional
        Softmax scale ``s`` in ``exp(s * q^T k)``; default ``1 / sqrt(head_dim)``.
    seed : int, default 0
        Seed for the projection; one seed gives the same features on every backend.
    rebalance : bool, default False
        SADERF rebalancing for the softmax kinds: queries become ``Psi x`` and keys
        ``Psi^-1 y`` with a diagonal ``Psi`` from query/key statistics, which keeps every
        ``x^T y`` and lowers the variance when per-coordinate scales differ.

    Notes
    -----
    ``"oprf"`` kinds and ``rebalance=True`` need statistics of the queries and keys.
    Bidirectional :func:`linattn.linear_attention` computes them from each call's batch;
    causal attention (and anything with a state) needs them fixed in advance, because
    statistics over a whole sequence would let later tokens change earlier outputs:
    use :meth:`calibrate` on representative data, or :meth:`with_statistics`.

    Examples
    --------
    >>> import numpy as np
    >>> import linattn as la
    >>> fm = la.FeatureMap(16, 64, seed=0)
    >>> x = np.random.default_rng(1).normal(size=(5, 16))
    >>> fm.log_features(x).shape
    (5, 64)
    >>> fm.redraw(seed=1).seed
    1
    """

    __slots__ = (
        "_fingerprint",
        "_projection",
        "_rebalance_scales",
        "head_dim",
        "kind",
        "norms",
        "num_features",
        "oprf_a",
        "orthogonal",
        "rebalance",
        "scale",
        "seed",
    )

    head_dim: int
    num_features: int
    kind: str
    orthogonal: bool
    norms: str
    scale: float
    seed: int | None
    rebalance: bool
    oprf_a: float | None
    _projection: np.ndarray | None
    _rebalance_scales: np.ndarray | None
    _fingerprint: str

    def __init__(
        self,
        head_dim: int,
        num_features: int,
        *,
        kind: Kind = "positive",
        orthogonal: bool = True,
        norms: Norms = "chi",
        scale: float | None = None,
        seed: int = 0,
        rebalance: bool = False,
    ) -> None:
        _check_positive_int("head_dim", head_dim)
        _check_positive_int("num_features", num_features)
        random, rows_per_feature = _check_kind(kind)
        if head_dim * num_features > MAX_PROJECTION_SIZE:
            raise ValueError(
                f"num_features x head_dim must be at most {MAX_PROJECTION_SIZE} (a "
                f"{8 * MAX_PROJECTION_SIZE // 2**30} GiB projection); got "
                f"{num_features} x {head_dim}"
            )
        if num_features % rows_per_feature:
            raise ValueError(
                f"num_features must be even for kind={kind!r} (it uses num_features / 2 "
                f"projection rows); got {num_features}"
            )
        if not random and num_features != head_dim:
            raise ValueError(
                f"num_features must equal head_dim for the deterministic kind {kind!r}; "
                f"got num_features={num_features}, head_dim={head_dim}"
            )
        if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer; got {seed!r}")
        if not isinstance(orthogonal, bool | np.bool_):
            raise TypeError(f"orthogonal must be True or False; got {orthogonal!r}")
        projection = None
        if random:
            projection = gaussian_projection(
                num_features // rows_per_feature,
                head_dim,
                orthogonal=orthogonal,
                norms=norms,
                seed=int(seed),
            )
        self._init(
            head_dim=head_dim,
            num_features=num_features,
            kind=kind,
            orthogonal=bool(orthogonal),
            norms=norms,
            scale=scale,
            seed=int(seed),
            projection=projection,
            rebalance=rebalance,
        )

    def _init(
        self,
        *,
        head_dim: int,
        num_features: int,
        kind: str,
        orthogonal: bool,
        norms: str,
        scale: float | None,
        seed: int | None,
        projection: np.ndarray | None,
        rebalance: bool = False,
        oprf_a: float | None = None,
        rebalance_scales: np.ndarray | None = None,
    ) -> None:
        if not isinstance(rebalance, bool):
            raise TypeError(f"rebalance must be True or False; got {rebalance!r}")
        if rebalance and kind not in SOFTMAX_KINDS:
            raise ValueError(
                f"rebalance=True needs a softmax-estimating kind {SOFTMAX_KINDS}; got {kind!r}"
            )
        if oprf_a is not None:
            if kind not in OPRF_KINDS:
                raise ValueError(f"oprf_a applies to kinds {OPRF_KINDS}; got kind={kind!r}")
            if not (isinstance(oprf_a, int | float | np.floating) and oprf_a < 0.125):
                raise ValueError(
                    f"oprf_a must be a number below 1/8 (finite variance); got {oprf_a!r}"
                )
            oprf_a = float(oprf_a)
        if rebalance_scales is not None:
            if not rebalance:
                raise ValueError("rebalance_scales need a map made with rebalance=True")
            rebalance_scales = np.array(rebalance_scales, dtype=np.float64, copy=True)
            if rebalance_scales.shape != (head_dim,) or not np.all(
                np.isfinite(rebalance_scales) & (rebalance_scales > 0)
            ):
                raise ValueError(
                    f"rebalance_scales must be {head_dim} positive finite numbers; got "
                    f"shape {rebalance_scales.shape}"
                )
            rebalance_scales.setflags(write=False)
        if scale is None:
            scale = 1.0 / math.sqrt(head_dim)
        if (
            isinstance(scale, bool)
            or not isinstance(scale, int | float | np.floating)
            or not (math.isfinite(scale) and scale > 0)
        ):
            raise ValueError(f"scale must be a positive finite number; got {scale!r}")
        if projection is not None:
            projection = np.array(projection, dtype=np.float64, copy=True)
            projection.setflags(write=False)
        digest = hashlib.sha256(
            f"{kind}|{float(scale)!r}|{head_dim}|{num_features}|{rebalance}|{oprf_a!r}".encode()
        )
        for part in (projection, rebalance_scales):
            if part is not None:
                digest.update(part.tobytes())
        setter = object.__setattr__
        setter(self, "head_dim", int(head_dim))
        setter(self, "num_features", int(num_features))
        setter(self, "kind", kind)
        setter(self, "orthogonal", orthogonal)
        setter(self, "norms", norms)
        setter(self, "scale", float(scale))
        setter(self, "seed", seed)
        setter(self, "rebalance", rebalance)
        setter(self, "oprf_a", oprf_a)
        setter(self, "_projection", projection)
        setter(self, "_rebalance_scales", rebalance_scales)
        setter(self, "_fingerprint", digest.hexdigest()[:16])

    def _fields(self) -> dict[str, Any]:
        return {
            "head_dim": self.head_dim,
            "num_features": self.num_features,
            "kind": self.kind,
            "orthogonal": self.orthogonal,
            "norms": self.norms,
            "scale": self.scale,
            "seed": self.seed,
            "projection": self._projection,
            "rebalance": self.rebalance,
            "oprf_a": self.oprf_a,
            "rebalance_scales": self._rebalance_scales,
        }

    def _replace(self, **changes: Any) -> FeatureMap:
        new = FeatureMap.__new__(FeatureMap)
        new._init(**{**self._fields(), **changes})
        return new

    def __reduce__(self) -> tuple[Any, tuple[dict[str, Any]]]:
        return _restore, (self._fields(),)

    @classmethod
    def from_projection(
        cls,
        matrix: Any,
        *,
        kind: Kind = "positive",
        scale: float | None = None,
    ) -> FeatureMap:
        """Adopt a given ``(rows, head_dim)`` projection, e.g. one a trained model saved.

        Parameters
        ----------
        matrix : array_like
            Projection rows ``omega_r`` (any array library; copied to the host).  This
            is the layout of performer-pytorch's ``projection_matrix`` buffer and of
            the reference JAX code's random matrix.
        kind : str, default "positive"
            A random feature kind; ``"hyperbolic"`` and ``"trigonometric"`` give
            ``2 * rows`` output features.
        scale : float, optional
            Softmax scale; default ``1 / sqrt(head_dim)``.

        Examples
        --------
        >>> import numpy as np
        >>> import linattn as la
        >>> fm = la.FeatureMap.from_projection(np.eye(4), kind="hyperbolic")
        >>> fm.num_features, fm.head_dim
        (8, 4)
        """
        from linattn._xp import to_host

        random, rows_per_feature = _check_kind(kind)
        if not random:
            raise ValueError(
                f"kind must be a random feature kind to adopt a projection; got {kind!r}"
            )
        host = to_host(matrix) if array_api_compat.is_array_api_obj(matrix) else matrix
        host = np.asarray(host)
        if host.ndim != 2 or 0 in host.shape:
            raise ValueError(
                f"matrix must be a non-empty 2-d (rows, head_dim) array; got shape {host.shape}"
            )
        if not (np.issubdtype(host.dtype, np.floating) and np.all(np.isfinite(host))):
            raise ValueError(
                f"matrix must hold finite real floating values; got dtype {host.dtype}"
            )
        self = cls.__new__(cls)
        self._init(
            head_dim=host.shape[1],
            num_features=host.shape[0] * rows_per_feature,
            kind=kind,
            orthogonal=False,
            norms="chi",
            scale=scale,
            seed=None,
            projection=host,
        )
        return self

    def redraw(self, *, seed: int | None = None) -> FeatureMap:
        """A new map of the same kind, size and scale with a freshly drawn projection.

        Parameters
        ----------
        seed : int, optional
            Seed of the new projection.  ``None`` takes fresh entropy from the operating
            system; the seed used is kept in the new map's ``seed``.

        Examples
        --------
        >>> import linattn as la
        >>> fm = la.FeatureMap(8, 16, seed=0)
        >>> fm.redraw(seed=0).fingerprint == fm.fingerprint
        True
        """
        if seed is None:
            seed = secrets.randbits(63)
        fresh = FeatureMap(
            self.head_dim,
            self.num_features,
            kind=self.kind,  # type: ignore[arg-type]
            orthogonal=self.orthogonal,
            norms=self.norms,  # type: ignore[arg-type]
            scale=self.scale,
            seed=seed,
            rebalance=self.rebalance,
        )
        return fresh._replace(oprf_a=self.oprf_a, rebalance_scales=self._rebalance_scales)

    # -- statistics (OPRF and rebalancing) -------------------------------------------

    @property
    def needs_calibration(self) -> bool:
        """True while an OPRF ``A`` or rebalancing scales are still to be computed."""
        return (self.kind in OPRF_KINDS and self.oprf_a is None) or (
            self.rebalance and self._rebalance_scales is None
        )

    @property
    def rebalance_scales(self) -> np.ndarray | None:
        """The read-only diagonal ``Psi`` (queries times it, keys divided by it), if set."""
        return self._rebalance_scales

    def calibrate(self, q: Array, k: Array, /, *, key_mask: Array | None = None) -> FeatureMap:
        """A copy with OPRF ``A`` and rebalancing ``Psi`` fixed from queries and keys.

        Parameters
        ----------
        q : array, shape ``(..., L_q, head_dim)``
        k : array, shape ``(..., L_k, head_dim)``
            Representative queries and keys (e.g. a calibration batch).
        key_mask : boolean array, shape ``(..., L_k)``, optional
            Keys left out of the statistics.

        Returns
        -------
        FeatureMap
            The same projection with statistics fixed; usable for causal attention.

        Examples
        --------
        >>> import numpy as np
        >>> import linattn as la
        >>> rng = np.random.default_rng(0)
        >>> q, k = rng.normal(size=(64, 8)), 2 * rng.normal(size=(64, 8))
        >>> fm = la.FeatureMap(8, 32, kind="oprf", rebalance=True).calibrate(q, k)
        >>> fm.needs_calibration, fm.oprf_a < 0
        (False, True)
        """
        from linattn.calibration import oprf_optimal_a, query_key_statistics, rebalance_scales

        xp = namespace_of(q=q, k=k, key_mask=key_mask)
        for name, x in (("q", q), ("k", k)):
            float_dtype(xp, name, x)
            if x.ndim < 2 or x.shape[-1] != self.head_dim or x.shape[-2] == 0:
                raise ValueError(
                    f"{name} must have shape (..., L, {self.head_dim}) with L >= 1; got "
                    f"{tuple(x.shape)}"
                )
        if key_mask is not None:
            check_key_mask(xp, key_mask, k.shape[-2])
        root = math.sqrt(self.scale)
        stats = query_key_statistics(
            xp, xp.astype(q, xp.float64) * root, xp.astype(k, xp.float64) * root, key_mask
        )
        moments = (stats.query_mean, stats.key_mean, stats.query_energy, stats.key_energy)
        if not all(np.all(np.isfinite(x)) for x in moments):
            raise ValueError(
                "calibrate needs finite q and (unmasked) k: their mean or energy came out "
                "non-finite (NaN, inf or overflowing values in the inputs)"
            )
        changes: dict[str, Any] = {}
        if self.rebalance:
            psi = rebalance_scales(stats)
            changes["rebalance_scales"] = psi
            stats = type(stats)(
                stats.query_mean * psi,
                stats.key_mean / psi,
                stats.query_energy * psi**2,
                stats.key_energy / psi**2,
            )
        if self.kind in OPRF_KINDS:
            changes["oprf_a"] = oprf_optimal_a(stats.rho)
        return self._replace(**changes)

    def with_statistics(
        self, *, oprf_a: float | None = None, rebalance_scales: Any = None
    ) -> FeatureMap:
        """A copy with OPRF ``A`` and/or rebalancing scales given by the user.

        Examples
        --------
        >>> import linattn as la
        >>> la.FeatureMap(4, 8, kind="oprf").with_statistics(oprf_a=-0.1).oprf_a
        -0.1
        """
        changes: dict[str, Any] = {}
        if oprf_a is not None:
            changes["oprf_a"] = oprf_a
        if rebalance_scales is not None:
            changes["rebalance_scales"] = rebalance_scales
        return self._replace(**changes)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"FeatureMap is immutable; use redraw() for new features ({name})")

    def __repr__(self) -> str:
        return (
            f"FeatureMap(head_dim={self.head_dim}, num_features={self.num_features}, "
            f"kind={self.kind!r}, orthogonal={self.orthogonal}, norms={self.norms!r}, "
            f"scale={self.scale:.6g}, seed={self.seed}, rebalance={self.rebalance}"
            + (f", oprf_a={self.oprf_a:.6g}" if self.oprf_a is not None else "")
            + ")"
        )

    @property
    def projection(self) -> np.ndarray | None:
        """The read-only float64 ``(rows, head_dim)`` projection (None for deterministic kinds)."""
        return self._projection

    @property
    def fingerprint(self) -> str:
        """A short digest of kind, scale and projection; states remember it."""
        return self._fingerprint

    @property
    def is_positive(self) -> bool:
        """True when every feature is positive (all kinds but ``"trigonometric"``)."""
        return self.kind != "trigonometric"

    # -- features -------------------------------------------------------------------

    def log_features(self, x: Array, /, *, role: Role | None = None) -> Array:
        """Log-features ``log phi(x)`` of shape ``(..., num_features)``, in x's namespace.

        Computed in float32 for half-precision inputs, else in x's dtype.  Not defined
        for ``"trigonometric"`` features, which can be negative (use :meth:`features`).
        ``role`` (``"query"`` or ``"key"``) is needed only by rebalanced maps.

        Examples
        --------
        >>> import numpy as np
        >>> import linattn as la
        >>> fm = la.FeatureMap(4, 8, seed=0)
        >>> np.exp(fm.log_features(np.zeros((1, 4)))).sum().round(6)  # phi(0) = 1/sqrt(m)
        np.float64(2.828427)
        """
        if not self.is_positive:
            raise ValueError(
                "log_features is not defined for kind='trigonometric' (its features can be "
                "negative); use features()"
            )
        return self.signed_log_features(x, role=role)[0]

    def features(self, x: Array, /, *, role: Role | None = None) -> Array:
        """Features ``phi(x)`` of shape ``(..., num_features)``, in x's namespace.

        Examples
        --------
        >>> import numpy as np
        >>> import linattn as la
        >>> fm = la.FeatureMap(4, 8, seed=0)
        >>> fm.features(np.ones((2, 4))).shape
        (2, 8)
        """
        log_phi, sign = self.signed_log_features(x, role=role)
        xp = array_api_compat.array_namespace(log_phi)
        phi = xp.exp(log_phi)
        return phi if sign is None else sign * phi

    def signed_log_features(
        self, x: Array, /, *, role: Role | None = None
    ) -> tuple[Array, Array | None]:
        """``(log|phi(x)|, sign(phi(x)))``; the sign is ``None`` for positive kinds.

        This is what the attention code consumes: magnitudes in log space (where all
        stabilisation happens) and, for trigonometric features only, their signs.
        ``role`` says whether ``x`` holds queries or keys; rebalanced maps need it.
        """
        xp = namespace_of(x=x)
        dtype = float_dtype(xp, "x", x)
        if x.ndim < 1 or x.shape[-1] != self.head_dim:
            raise ValueError(
                f"x must have shape (..., {self.head_dim}) to match the feature map's "
                f"head_dim; got shape {tuple(x.shape)}"
            )
        if role not in (None, "query", "key"):
            raise ValueError(f"role must be 'query', 'key' or None; got {role!r}")
        if self.needs_calibration:
            raise ValueError(
                f"this {self.kind!r} feature map{' with rebalance=True' if self.rebalance else ''}"
                " needs query/key statistics: expected a map from calibrate(q, k) or "
                "with_statistics(...), got one without them"
            )
        x = xp.astype(x, compute_dtype(xp, dtype), copy=False)
        kind = self.kind
        if kind == "elu":
            zero = xp.zeros_like(x)
            return xp.where(x > 0, xp.log1p(xp.maximum(x, zero)), xp.minimum(x, zero)), None
        if kind == "relu":
            return xp.log(xp.maximum(x, xp.zeros_like(x)) + RELU_EPSILON), None
        x = x * math.sqrt(self.scale)
        if self._rebalance_scales is not None:
            if role is None:
                raise ValueError(
                    "role must be 'query' or 'key' for a rebalanced feature map; got None"
                )
            psi = from_host(
                xp, self._rebalance_scales, dtype=x.dtype, device=array_api_compat.device(x)
            )
            x = x * psi if role == "query" else x / psi
        projection = self._projection_like(xp, x)
        proj = xp.matmul(x, xp.matrix_transpose(projection))
        half_norm = xp.sum(x * x, axis=-1, keepdims=True) / 2
        log_m = 0.5 * math.log(self.num_features)
        if kind == "random_relu":
            return xp.log(xp.maximum(proj, xp.zeros_like(proj)) + RELU_EPSILON), None
        if kind == "trigonometric":
            # [cos, sin](w^T x) * exp(|x|^2 / 2) / sqrt(m / 2)
            trig = xp.concat([xp.cos(proj), xp.sin(proj)], axis=-1)
            size = xp.abs(trig)  # log 0 = -inf without a warning (w^T x = 0 for x = 0)
            nonzero = size > 0
            one, neg_inf = constant(xp, 1.0, size), constant(xp, -math.inf, size)
            log_size = xp.where(nonzero, xp.log(xp.where(nonzero, size, one)), neg_inf)
            log_abs = log_size + half_norm - 0.5 * math.log(self.num_features / 2)
            return log_abs, xp.sign(trig)
        offset = -log_m
        if kind in OPRF_KINDS:
            # exp(A|w|^2 + B w^T x - |x|^2/2) (1 - 4A)^(d/4) is unbiased for B^2 = 1 - 4A.
            assert self.oprf_a is not None and self._projection is not None
            a = self.oprf_a
            proj = math.sqrt(1.0 - 4.0 * a) * proj
            offset += 0.25 * self.head_dim * math.log1p(-4.0 * a)
        if kind in ANTITHETIC_KINDS:
            proj = xp.concat([proj, -proj], axis=-1)
        log_phi = proj - half_norm + offset
        if kind in OPRF_KINDS:
            energy = self.oprf_a * np.sum(self._projection**2, axis=1)  # type: ignore[operator]
            if kind in ANTITHETIC_KINDS:
                energy = np.concatenate([energy, energy])
            log_phi = log_phi + from_host(
                xp, energy, dtype=x.dtype, device=array_api_compat.device(x)
            )
        return log_phi, None

    def _projection_like(self, xp: Any, x: Array) -> Array:
        assert self._projection is not None
        return from_host(xp, self._projection, dtype=x.dtype, device=array_api_compat.device(x))


#: Largest projection (entries) a FeatureMap draws: 2 GiB of float64.
MAX_PROJECTION_SIZE = 2**28


def _restore(fields: dict[str, Any]) -> FeatureMap:
    """Unpickle a FeatureMap (it travels to Dask workers and subprocesses)."""
    new = FeatureMap.__new__(FeatureMap)
    new._init(**fields)
    return new


def _check_kind(kind: object) -> tuple[bool, int]:
    if not isinstance(kind, str) or kind not in KINDS:
        raise ValueError(f"kind must be one of {sorted(KINDS)}; got {kind!r}")
    return KINDS[kind]


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{name} must be a positive integer; got {value!r}")
