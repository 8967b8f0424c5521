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

from linattn._xp import Array, compute_dtype, float_dtype, from_host, namespace_of
from linattn.projections import Norms, gaussian_projection

__all__ = ["KINDS", "FeatureMap"]

Kind = Literal["positive", "hyperbolic", "trigonometric", "random_relu", "elu", "relu"]

#: Feature kinds: ``(uses a random projection, projection rows per output feature)``.
KINDS: dict[str, tuple[bool, int]] = {
    "positive": (True, 1),
    "hyperbolic": (True, 2),
    "trigonometric": (True, 2),
    "random_relu": (True, 1),
    "elu": (False, 1),
    "relu": (False, 1),
}

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
        ``"relu"`` (``relu(x) + 1e-3``) maps, which ignore ``scale``.
    orthogonal : bool, default True
        Draw the projection as stacked Haar-orthogonal blocks (ORF) instead of iid.
    norms : {"chi", "fixed"}, default "chi"
        Row lengths of the projection, see :func:`linattn.projections.gaussian_projection`.
    scale : float, optional
        Softmax scale ``s`` in ``exp(s * q^T k)``; default ``1 / sqrt(head_dim)``.
    seed : int, default 0
        Seed for the projection; one seed gives the same features on every backend.

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
        "head_dim",
        "kind",
        "norms",
        "num_features",
        "orthogonal",
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
    _projection: np.ndarray | None
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
    ) -> None:
        _check_positive_int("head_dim", head_dim)
        _check_positive_int("num_features", num_features)
        random, rows_per_feature = _check_kind(kind)
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
        if not isinstance(seed, int | np.integer) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer; got {seed!r}")
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
    ) -> None:
        if scale is None:
            scale = 1.0 / math.sqrt(head_dim)
        if not isinstance(scale, int | float | np.floating) or not (
            math.isfinite(scale) and scale > 0
        ):
            raise ValueError(f"scale must be a positive finite number; got {scale!r}")
        if projection is not None:
            projection = np.array(projection, dtype=np.float64, copy=True)
            projection.setflags(write=False)
        digest = hashlib.sha256(f"{kind}|{float(scale)!r}|{head_dim}|{num_features}".encode())
        if projection is not None:
            digest.update(projection.tobytes())
        setter = object.__setattr__
        setter(self, "head_dim", int(head_dim))
        setter(self, "num_features", int(num_features))
        setter(self, "kind", kind)
        setter(self, "orthogonal", orthogonal)
        setter(self, "norms", norms)
        setter(self, "scale", float(scale))
        setter(self, "seed", seed)
        setter(self, "_projection", projection)
        setter(self, "_fingerprint", digest.hexdigest()[:16])

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
        return FeatureMap(
            self.head_dim,
            self.num_features,
            kind=self.kind,  # type: ignore[arg-type]
            orthogonal=self.orthogonal,
            norms=self.norms,  # type: ignore[arg-type]
            scale=self.scale,
            seed=seed,
        )

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"FeatureMap is immutable; use redraw() for new features ({name})")

    def __repr__(self) -> str:
        return (
            f"FeatureMap(head_dim={self.head_dim}, num_features={self.num_features}, "
            f"kind={self.kind!r}, orthogonal={self.orthogonal}, norms={self.norms!r}, "
            f"scale={self.scale:.6g}, seed={self.seed})"
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

    def log_features(self, x: Array, /) -> Array:
        """Log-features ``log phi(x)`` of shape ``(..., num_features)``, in x's namespace.

        Computed in float32 for half-precision inputs, else in x's dtype.  Not defined
        for ``"trigonometric"`` features, which can be negative (use :meth:`features`).

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
        return self.signed_log_features(x)[0]

    def features(self, x: Array, /) -> Array:
        """Features ``phi(x)`` of shape ``(..., num_features)``, in x's namespace.

        Examples
        --------
        >>> import numpy as np
        >>> import linattn as la
        >>> fm = la.FeatureMap(4, 8, seed=0)
        >>> fm.features(np.ones((2, 4))).shape
        (2, 8)
        """
        log_phi, sign = self.signed_log_features(x)
        xp = array_api_compat.array_namespace(log_phi)
        phi = xp.exp(log_phi)
        return phi if sign is None else sign * phi

    def signed_log_features(self, x: Array, /) -> tuple[Array, Array | None]:
        """``(log|phi(x)|, sign(phi(x)))``; the sign is ``None`` for positive kinds.

        This is what the attention code consumes: magnitudes in log space (where all
        stabilisation happens) and, for trigonometric features only, their signs.
        """
        xp = namespace_of(x=x)
        dtype = float_dtype(xp, "x", x)
        if x.ndim < 1 or x.shape[-1] != self.head_dim:
            raise ValueError(
                f"x must have shape (..., {self.head_dim}) to match the feature map's "
                f"head_dim; got shape {tuple(x.shape)}"
            )
        x = xp.astype(x, compute_dtype(xp, dtype))
        kind = self.kind
        if kind == "elu":
            zero = xp.zeros_like(x)
            return xp.where(x > 0, xp.log1p(xp.maximum(x, zero)), xp.minimum(x, zero)), None
        if kind == "relu":
            return xp.log(xp.maximum(x, xp.zeros_like(x)) + RELU_EPSILON), None
        x = x * math.sqrt(self.scale)
        projection = self._projection_like(xp, x)
        proj = xp.matmul(x, xp.matrix_transpose(projection))
        half_norm = xp.sum(x * x, axis=-1, keepdims=True) / 2
        if kind == "positive":
            return proj - half_norm - 0.5 * math.log(self.num_features), None
        if kind == "hyperbolic":
            both = xp.concat([proj, -proj], axis=-1)
            return both - half_norm - 0.5 * math.log(self.num_features), None
        if kind == "random_relu":
            return xp.log(xp.maximum(proj, xp.zeros_like(proj)) + RELU_EPSILON), None
        # trigonometric: [cos, sin](w^T x) * exp(|x|^2 / 2) / sqrt(m / 2)
        trig = xp.concat([xp.cos(proj), xp.sin(proj)], axis=-1)
        log_abs = xp.log(xp.abs(trig)) + half_norm - 0.5 * math.log(self.num_features / 2)
        return log_abs, xp.sign(trig)

    def _projection_like(self, xp: Any, x: Array) -> Array:
        assert self._projection is not None
        return from_host(
            xp, self._projection, dtype=x.dtype, device=array_api_compat.device(x)
        )


def _check_kind(kind: object) -> tuple[bool, int]:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {sorted(KINDS)}; got {kind!r}")
    return KINDS[kind]  # type: ignore[index]


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{name} must be a positive integer; got {value!r}")
