"""Feature maps: queries and keys to (log-)features whose inner products estimate a kernel.

Every map works in **log-features** ``l(x) = log phi(x)``: the attention code takes
log-features and does all stabilisation there (``docs/algorithm.md``, sections
2, 3 and 5).  What differs between kinds lives in
:mod:`linattn._kinds`, one object per kind.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import secrets
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from linattn import fitted
from linattn._checks import (
    check_key_mask,
    check_query_mask,
    check_scale,
    key_mask_batch_shape,
)
from linattn._kinds import KIND_SPECS, FeatureKind, KindInputs, kind_spec
from linattn._xp import (
    Array,
    array_device,
    array_namespace,
    compute_dtype,
    constant,
    float_dtype,
    from_host,
    is_array,
    is_jax_array,
    namespace_of,
    to_host,
)
from linattn.calibration import Statistics
from linattn.fitted import FittedParameters, check_parameters, initial_parameters
from linattn.projections import MAX_PROJECTION_SIZE, Norms, gaussian_projection

__all__ = ["KINDS", "FeatureMap", "feature_map_for"]

Kind = Literal[
    "hedgehog",
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
    name: (spec.random, spec.rows_per_feature) for name, spec in KIND_SPECS.items()
}

#: Kinds whose features estimate the softmax kernel exp(x^T y) without bias.
SOFTMAX_KINDS = tuple(name for name, spec in KIND_SPECS.items() if spec.softmax)
#: Kinds with the OPRF (FAVOR++) parameter A.
OPRF_KINDS = tuple(name for name, spec in KIND_SPECS.items() if spec.oprf)

#: The most negative OPRF ``A`` accepted.  ``A* ~ -rho / 4`` for large ``rho =
#: E|x + y|^2 / d``; ``A < -1e4`` means ``rho > 4e4``: scaled logits with a standard
#: deviation above ``2e4``, beyond the exponent range of every float type, where no
#: random-feature estimate means anything (and ``B = sqrt(1 - 4A)`` overflows soon after).
MIN_OPRF_A = -1e4

Role = Literal["query", "key"]


@dataclass(frozen=True, eq=False, init=False, repr=False, slots=True, weakref_slot=True)
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
        kinds (``"elu"``, ``"relu"``) need ``m == head_dim``; ``"hedgehog"`` needs an
        even ``m``.
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
        ``"hedgehog"`` is a *fitted* map (:mod:`linattn.fitted`): ``softmax([u, -u])``
        of ``u = x W + b`` with separate query and key parameters; this constructor
        gives its starting point (:func:`linattn.fitted.initial_parameters`, shared by
        all heads), :meth:`fitted` adopts fitted parameters and
        :func:`linattn.transfer.fit_layer` fits them.
    orthogonal : bool, default True
        Draw the projection as stacked Haar-orthogonal blocks (ORF) instead of iid.
    norms : {"chi", "fixed"}, default "chi"
        Row lengths of the projection, see :func:`linattn.gaussian_projection`.
    scale : float, optional
        Softmax scale ``s`` in ``exp(s * q^T k)``; default ``1 / sqrt(head_dim)``.
    seed : int, default 0
        Seed for the projection; one seed gives the same features on every backend.
    rebalance : bool, default False
        SADERF rebalancing for the softmax kinds: queries become ``Psi x`` and keys
        ``Psi^-1 y`` with a diagonal ``Psi`` from query/key statistics, which keeps every
        ``x^T y`` and lowers the variance when per-coordinate scales differ.

    Attributes
    ----------
    oprf_a : float or None
        OPRF's ``A`` once calibrated or given (kinds ``"oprf"``, ``"hyperbolic_oprf"``),
        else None.
    seed : int or None
        The projection's seed; None for a map made by :meth:`from_projection`.

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

    head_dim: int
    num_features: int
    kind: Kind
    orthogonal: bool
    norms: Norms
    scale: float
    seed: int | None
    rebalance: bool
    oprf_a: float | None
    _projection: np.ndarray | None
    _rebalance_scales: np.ndarray | None
    _parameters: FittedParameters | None
    _fingerprint: str
    _grouped_maps: dict[object, FeatureMap]  # derived maps: grouped, far weight off

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
        _check_seed(seed)
        if not isinstance(orthogonal, bool | np.bool_):
            raise TypeError(f"orthogonal must be True or False; got {orthogonal!r}")
        projection = parameters = None
        if spec.fitted:
            parameters = initial_parameters(head_dim, num_features, seed=int(seed))
        if spec.random:
            projection = gaussian_projection(
                num_features // spec.rows_per_feature,
                head_dim,
                orthogonal=bool(orthogonal),
                norms=norms,
                seed=int(seed),
            )
        self._assign(
            head_dim=head_dim,
            num_features=num_features,
            kind=kind,
            orthogonal=bool(orthogonal),
            norms=norms,
            scale=scale,
            seed=int(seed),
            projection=projection,
            rebalance=rebalance,
            parameters=parameters,
        )

    def _assign(
        self,
        *,
        head_dim: int,
        num_features: int,
        kind: Kind,
        orthogonal: bool,
        norms: Norms,
        scale: float | None,
        seed: int | None,
        projection: np.ndarray | None,
        rebalance: bool = False,
        oprf_a: float | None = None,
        rebalance_scales: Any = None,
        parameters: FittedParameters | None = None,
    ) -> None:
        """Check the statistics and scale, freeze the arrays and set every field once."""
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
            oprf_a = _check_oprf_a(oprf_a, kind)
        if rebalance_scales is not None:
            if not rebalance:
                raise ValueError("rebalance_scales need a map made with rebalance=True")
            rebalance_scales = _frozen(_check_rebalance_scales(rebalance_scales, head_dim))
        scale = check_scale(scale, head_dim)
        if projection is not None:
            projection = _frozen(np.array(projection, dtype=np.float64, copy=True))
        digest = hashlib.sha256(
            f"{kind}|{scale!r}|{head_dim}|{num_features}|{rebalance}|{oprf_a!r}".encode()
        )
        for part in (projection, rebalance_scales):
            if part is not None:
                digest.update(part.tobytes())
        if parameters is not None:
            for name, array in parameters.arrays().items():
                digest.update(f"|{name}{array.shape}".encode() + array.tobytes())
        fields = {
            "head_dim": int(head_dim),
            "num_features": int(num_features),
            "kind": kind,
            "orthogonal": orthogonal,
            "norms": norms,
            "scale": scale,
            "seed": seed,
            "rebalance": rebalance,
            "oprf_a": oprf_a,
            "_projection": projection,
            "_rebalance_scales": rebalance_scales,
            "_parameters": parameters,
            "_fingerprint": digest.hexdigest()[:16],
            "_grouped_maps": {},
        }
        for name, value in fields.items():
            object.__setattr__(self, name, value)
        _register_live(self)
        if parameters is not None and not np.all(parameters.far_weight == 1.0):
            # Made here, on the host: a call (maybe traced by torch.compile) only looks up.
            ones = np.ones_like(parameters.far_weight)
            ones.setflags(write=False)
            self._grouped_maps["far"] = self._replace(
                parameters=parameters._replace(far_weight=ones)
            )

    def _fields(self) -> dict[str, Any]:
        """The keyword arguments of :meth:`_assign` that rebuild this map."""
        fields = {f.name.lstrip("_"): getattr(self, f.name) for f in dataclasses.fields(self)}
        del fields["fingerprint"], fields["grouped_maps"]
        return fields

    def _replace(self, **changes: Any) -> FeatureMap:
        return _restore({**self._fields(), **changes})

    def __reduce__(self) -> tuple[Any, tuple[dict[str, Any]]]:
        # Rebuilt through _assign, so the arrays are read-only again after unpickling.
        return _restore, (self._fields(),)

    @property
    def _spec(self) -> FeatureKind:
        """The :class:`linattn._kinds.FeatureKind` that computes this map's features."""
        return KIND_SPECS[self.kind]

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
        spec = kind_spec(kind)
        if not spec.random:
            raise ValueError(
                f"kind must be a random feature kind to adopt a projection; got {kind!r}"
            )
        host = to_host(matrix) if is_array(matrix) else matrix
        host = np.asarray(host)
        if host.ndim != 2 or 0 in host.shape:
            raise ValueError(
                f"matrix must be a non-empty 2-d (rows, head_dim) array; got shape {host.shape}"
            )
        if not (np.issubdtype(host.dtype, np.floating) and np.all(np.isfinite(host))):
            raise ValueError(
                f"matrix must hold finite real floating values; got dtype {host.dtype}"
            )
        return _restore(
            {
                "head_dim": host.shape[1],
                "num_features": host.shape[0] * spec.rows_per_feature,
                "kind": kind,
                "orthogonal": False,
                "norms": "chi",
                "scale": scale,
                "seed": None,
                "projection": host,
            }
        )

    @classmethod
    def fitted(
        cls,
        query_weight: Any,
        query_bias: Any = None,
        *,
        key_weight: Any = None,
        key_bias: Any = None,
        far_weight: Any = None,
        tied: bool = False,
        scale: float | None = None,
    ) -> FeatureMap:
        """A fitted (``"hedgehog"``) map from its parameters (:mod:`linattn.fitted`).

        Parameters
        ----------
        query_weight : array_like, shape ``(d, m/2)`` or ``(H, d, m/2)``
            Query ``W``: ``m`` features ``softmax([x W + b, -(x W + b)])``; a leading
            head axis gives every query head its own (inputs ``(..., H, L, d)``).
        query_bias : array_like, shape ``(m/2,)`` or ``(H, m/2)``, optional
            Query ``b``; default zeros.
        key_weight, key_bias : array_like, optional
            The keys' ``W`` and ``b`` (a head axis counts key heads: grouped-query
            attention); required unless ``tied``.
        far_weight : float or array_like of shape ``(H_kv,)``, optional
            ``g >= 0``, the weight of the far keys against exact ones in the hybrid
            (``0``: window and sinks alone; default 1).  It multiplies the key features.
        tied : bool, default False
            Keys use the query parameters.
        scale : float, optional
            Softmax scale of the *exact* parts of a hybrid call; default
            ``1 / sqrt(d)`` (the features themselves ignore it).

        Examples
        --------
        >>> import numpy as np
        >>> import linattn as la
        >>> w = np.stack([np.eye(4)] * 2)  # 2 heads, d = 4, m = 8
        >>> fm = la.FeatureMap.fitted(w, key_weight=w, far_weight=[0.5, 2.0])
        >>> fm.kind, fm.num_features, fm.parameters.far_weight.tolist()
        ('hedgehog', 8, [0.5, 2.0])
        >>> x = np.zeros((1, 2, 3, 4))
        >>> np.exp(fm.log_features(x, role="query")).sum(-1)[0, :, 0].round(12).tolist()
        [1.0, 1.0]
        """
        p = check_parameters(query_weight, query_bias, key_weight, key_bias, far_weight, tied=tied)
        return _restore(
            {
                "head_dim": p.head_dim,
                "num_features": p.num_features,
                "kind": "hedgehog",
                "orthogonal": False,
                "norms": "chi",
                "scale": scale,
                "seed": None,
                "projection": None,
                "parameters": p,
            }
        )

    @property
    def parameters(self) -> FittedParameters | None:
        """A fitted map's read-only parameters (None for other kinds)."""
        return self._parameters

    def with_parameters(self, **changes: Any) -> FeatureMap:
        """A copy of a fitted map with some parameters replaced (names of :meth:`fitted`).

        Examples
        --------
        >>> import linattn as la
        >>> fm = la.FeatureMap(4, 8, kind="hedgehog")
        >>> float(fm.with_parameters(far_weight=0.0).parameters.far_weight)
        0.0
        """
        p = self._parameters
        if p is None:
            raise ValueError(f"with_parameters needs a fitted map; got kind={self.kind!r}")
        unknown = sorted(set(changes) - set(FittedParameters._fields) - {"tied"})
        if unknown:
            raise TypeError(f"with_parameters got unknown names {unknown}")
        tied = changes.pop("tied", p.tied)
        fields = {**p._asdict(), **changes}
        if tied:
            fields.pop("key_weight")
            fields.pop("key_bias")
        return FeatureMap.fitted(**fields, tied=tied, scale=self.scale)

    def grouped(self, group: int, key_heads: int | None = None) -> FeatureMap:
        """This map for grouped-query inputs split as :func:`linattn._gqa.grouped` does:
        per-head parameters get the ``(H_kv, G)`` head axes (others: the map itself).
        ``key_heads`` (``H_kv``), when given, is checked against the parameters' heads
        (``linattn.fitted.grouped``).

        Examples
        --------
        >>> import numpy as np
        >>> import linattn as la
        >>> fm = la.FeatureMap.fitted(np.ones((4, 2, 3)), key_weight=np.ones((2, 2, 3)))
        >>> fm.grouped(2).parameters.query_weight.shape
        (2, 2, 2, 3)
        """
        p = self._parameters
        if p is None or (p.query_weight.ndim == 2 and p.key_weight.ndim == 2):
            return self
        # Kept by this map: the grouped one must stay live while this one is (torch's
        # custom operators find it by fingerprint, in the backward pass too), and a
        # call per decoding step should not build it again.
        key = (group, key_heads)
        if key not in self._grouped_maps:
            grouped = fitted.grouped(p, group, key_heads)  # (checks key_heads)
            self._grouped_maps[key] = self._replace(parameters=grouped)
        return self._grouped_maps[key]

    def _far_cancelled(self) -> FeatureMap:
        """This map with far weight 1, for calls without exact parts, where ``g`` cancels.

        Every key of a head carries the same ``log g``, so without exact parts it cancels
        in the normalisation; left in, ``log g = ZERO_FAR_LOG`` would round the key
        log-features to its float spacing (about ``1e-3`` in float32).  Only the features
        come from it: states keep the map's own fingerprint.
        """
        return self._grouped_maps.get("far", self)  # (made by _assign)

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
        if self._parameters is not None:
            raise ValueError("a fitted (hedgehog) map has no random draw to redraw")
        if seed is None:
            seed = secrets.randbits(63)
        fresh = FeatureMap(
            self.head_dim,
            self.num_features,
            kind=self.kind,
            orthogonal=self.orthogonal,
            norms=self.norms,
            scale=self.scale,
            seed=seed,
            rebalance=self.rebalance,
        )
        return fresh._replace(oprf_a=self.oprf_a, rebalance_scales=self._rebalance_scales)

    # -- statistics (OPRF and rebalancing) -------------------------------------------

    @property
    def needs_calibration(self) -> bool:
        """True while an OPRF ``A`` or rebalancing scales are still to be computed."""
        return (self._spec.oprf and self.oprf_a is None) or (
            self.rebalance and self._rebalance_scales is None
        )

    @property
    def rebalance_scales(self) -> np.ndarray | None:
        """The read-only diagonal ``Psi`` (queries times it, keys divided by it), if set."""
        return self._rebalance_scales

    def calibrate(
        self,
        q: Array,
        k: Array,
        /,
        *,
        key_mask: Array | None = None,
        query_mask: Array | None = None,
    ) -> FeatureMap:
        """A copy with OPRF ``A`` and rebalancing ``Psi`` fixed from queries and keys.

        Parameters
        ----------
        q : array, shape ``(..., L_q, head_dim)``
        k : array, shape ``(..., L_k, head_dim)``
            Representative queries and keys (e.g. a calibration batch).
        key_mask : boolean array, shape ``(..., L_k)``, optional
            True for the keys that enter the statistics (the rank rule of
            :func:`linattn.linear_attention`).
        query_mask : boolean array, shape ``(..., L_q)``, optional
            True for the queries that enter the statistics: padded query rows would
            shift OPRF's ``A`` and the rebalancing.

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
        from linattn.calibration import query_key_statistics, statistics_from_moments

        xp = namespace_of(
            {"q": q, "k": k, "key_mask": key_mask, "query_mask": query_mask},
            optional=("key_mask", "query_mask"),
        )
        for name, x in (("q", q), ("k", k)):
            float_dtype(xp, name, x)
            if x.ndim < 2 or x.shape[-1] != self.head_dim or x.shape[-2] == 0:
                raise ValueError(
                    f"{name} must have shape (..., L, {self.head_dim}) with L >= 1; got "
                    f"{tuple(x.shape)}"
                )
            _refuse_traced(name, x)
        if key_mask is not None:
            check_key_mask(xp, key_mask, k.shape[-2], k=k, q=q)
            key_mask_batch_shape(key_mask, k)
        if query_mask is not None:
            check_query_mask(xp, query_mask, q)
        root = math.sqrt(self.scale)
        stats = query_key_statistics(
            xp,
            xp.astype(q, xp.float64) * root,
            xp.astype(k, xp.float64) * root,
            key_mask,
            query_mask,
        )
        moments = np.stack(stats._arrays())
        if not np.all(np.isfinite(moments)):
            raise ValueError(
                "calibrate needs finite q and (unmasked) k: their mean or energy came out "
                "non-finite (NaN, inf or overflowing values in the inputs)"
            )
        psi, a = statistics_from_moments(
            array_namespace(moments),
            moments,
            rebalance=self.rebalance,
            oprf=self._spec.oprf,
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

    def __repr__(self) -> str:
        return (
            f"FeatureMap(head_dim={self.head_dim}, num_features={self.num_features}, "
            f"kind={self.kind!r}, orthogonal={self.orthogonal}, norms={self.norms!r}, "
            f"scale={self.scale:.6g}, seed={self.seed}, rebalance={self.rebalance}"
            + (f", oprf_a={self.oprf_a:.6g}" if self.oprf_a is not None else "")
            + (f", {fitted.describe(self._parameters)}" if self._parameters is not None else "")
            + ")"
        )

    @property
    def projection(self) -> np.ndarray | None:
        """The read-only float64 ``(rows, head_dim)`` projection (None for deterministic kinds)."""
        return self._projection

    @property
    def fingerprint(self) -> str:
        """A short digest of kind, scale, statistics and projection; states remember it."""
        return self._fingerprint

    @property
    def is_positive(self) -> bool:
        """True when every feature is positive (all kinds but ``"trigonometric"``)."""
        return self._spec.positive

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
        xp = array_namespace(log_phi)
        phi = xp.exp(log_phi)
        return phi if sign is None else sign * phi

    def signed_log_features(
        self, x: Array, /, *, role: Role | None = None, statistics: Statistics | None = None
    ) -> tuple[Array, Array | None]:
        """``(log|phi(x)|, sign(phi(x)))``; the sign is ``None`` for positive kinds.

        This is what the attention code consumes: magnitudes in log space (where all
        stabilisation happens) and, for trigonometric features only, their signs.
        ``role`` says whether ``x`` holds queries or keys; rebalanced maps need it.
        An input whose squared norm overflows gets log-features ``-inf`` (its true
        features lie below the float range), never NaN.  ``statistics`` (arrays of
        ``x``'s namespace, from ``linattn.calibration.per_call_statistics``) stand in
        for a map's missing ``oprf_a`` and rebalancing scales.

        Examples
        --------
        >>> import numpy as np
        >>> import linattn as la
        >>> fm = la.FeatureMap(4, 8, kind="trigonometric", seed=0)
        >>> log_abs, sign = fm.signed_log_features(np.ones((2, 4)))
        >>> log_abs.shape, sorted(set(sign.ravel().tolist())) <= [-1.0, 1.0]
        ((2, 8), True)
        """
        xp, x = self._check_input(x, role, statistics)
        oprf_a, psi = self._statistics(statistics)
        if self._parameters is not None:
            return fitted.log_features(xp, self._parameters, x, self._role(role)), None
        if not self._spec.random:
            return self._spec.log_features(xp, KindInputs(self, x, oprf_a=oprf_a))
        x, overflow = self._without_overflow(xp, x, role, psi)
        x = x * self._input_factor(xp, x, role, psi)
        proj = xp.matmul(x, xp.matrix_transpose(self._projection_like(xp, x)))
        half_norm = xp.sum(x * x, axis=-1, keepdims=True) / 2
        spec = self._spec
        if spec.follows_half_norm:  # -inf (or NaN) through the half norm: an (L, 1) select
            # +inf gives 0 - inf = -inf for the Gaussian kinds, NaN gives NaN for the others.
            fill = math.inf if spec.overflow == -math.inf else math.nan
            half_norm = xp.where(overflow, constant(xp, fill, half_norm), half_norm)
        log_phi, sign = spec.log_features(xp, KindInputs(self, x, proj, half_norm, oprf_a))
        if not spec.follows_half_norm:
            log_phi = xp.where(overflow, constant(xp, spec.overflow, log_phi), log_phi)
        return log_phi, sign

    def log_features_vjp(
        self,
        x: Array,
        d_log: Array,
        /,
        *,
        role: Role | None = None,
        statistics: Statistics | None = None,
    ) -> Array:
        """``dx`` from the cotangent ``d_log`` of :meth:`signed_log_features` (magnitudes).

        The projection, OPRF's ``A`` and the rebalancing ``Psi`` are constants
        (a fixed draw and statistics, not parameters).

        Examples
        --------
        >>> import numpy as np
        >>> import linattn as la
        >>> fm = la.FeatureMap(4, 8, seed=0)
        >>> x, d = np.ones((1, 4)), np.ones((1, 8))
        >>> eps = 1e-7; x2 = x.copy(); x2[0, 2] += eps
        >>> slope = (fm.log_features(x2) - fm.log_features(x)).sum() / eps
        >>> bool(abs(slope - fm.log_features_vjp(x, d)[0, 2]) < 1e-5)
        True
        """
        xp, x = self._check_input(x, role, statistics)
        oprf_a, psi = self._statistics(statistics)
        x = xp.astype(x, d_log.dtype, copy=False)
        if self._parameters is not None:
            return fitted.input_vjp(xp, self._parameters, x, d_log, self._role(role))
        if not self._spec.random:
            return self._spec.vjp(xp, KindInputs(self, x, oprf_a=oprf_a), d_log)[0]
        x, overflow = self._without_overflow(xp, x, role, psi)
        factor = self._input_factor(xp, x, role, psi)
        x = x * factor
        projection = self._projection_like(xp, x)
        proj = xp.matmul(x, xp.matrix_transpose(projection))
        d_proj, d_half_norm = self._spec.vjp(xp, KindInputs(self, x, proj, None, oprf_a), d_log)
        dx = factor * (xp.matmul(d_proj, projection) - x * d_half_norm)
        return xp.where(overflow, constant(xp, 0.0, dx), dx)  # constant features there

    def log_features_parameter_vjp(
        self, x: Array, d_log: Array, /, *, role: Role
    ) -> dict[str, np.ndarray]:
        """A fitted map's parameter cotangents from the cotangent ``d_log`` of
        :meth:`signed_log_features` (``role``'s ``W`` and ``b``; keys also ``far_weight``).

        Float64 NumPy arrays of the parameters' shapes, summed over the batch; a tied map
        names them ``query_*`` for both roles (add them).

        Examples
        --------
        >>> import numpy as np
        >>> import linattn as la
        >>> fm = la.FeatureMap(4, 8, kind="hedgehog")
        >>> x, d = np.ones((3, 4)), np.ones((3, 8))
        >>> sorted(fm.log_features_parameter_vjp(x, d, role="key"))
        ['far_weight', 'key_bias', 'key_weight']
        """
        if self._parameters is None:
            raise ValueError(
                f"log_features_parameter_vjp needs a fitted map; got kind={self.kind!r}"
            )
        xp, x = self._check_input(x, role)
        x = xp.astype(x, d_log.dtype, copy=False)
        role = self._role(role)
        grads = fitted.parameter_vjp(xp, self._parameters, x, d_log, role)
        if self._parameters.tied and role == "key":
            grads["query_weight"] = grads.pop("key_weight")
            grads["query_bias"] = grads.pop("key_bias")
        return grads

    def _role(self, role: object) -> Role:
        """A fitted map's role: given, or ``"query"`` for a tied map's ``None``."""
        p = self._parameters
        if role is None and p is not None and p.tied:
            return "query"
        if role not in ("query", "key"):
            raise ValueError(
                "role must be 'query' or 'key' for a fitted map with separate query and key "
                f"parameters; got {role!r}"
            )
        return role

    def _statistics(self, statistics: Statistics | None) -> tuple[Any, Any]:
        """``(A, Psi)``: the map's own, or a call's (arrays) where the map has none."""
        oprf_a, psi = self.oprf_a, self._rebalance_scales
        if statistics is not None:
            if oprf_a is None:
                oprf_a = statistics.oprf_a
            if psi is None and self.rebalance:
                psi = statistics.rebalance_scales
        return oprf_a, psi

    def _check_input(
        self, x: Array, role: object, statistics: Statistics | None = None
    ) -> tuple[Any, Array]:
        """The namespace and ``x`` in the compute dtype, after every check on ``x``."""
        xp = namespace_of({"x": x})
        dtype = float_dtype(xp, "x", x)
        if x.ndim < 1 or x.shape[-1] != self.head_dim:
            raise ValueError(
                f"x must have shape (..., {self.head_dim}) to match the feature map's "
                f"head_dim; got shape {tuple(x.shape)}"
            )
        if role not in (None, "query", "key"):
            raise ValueError(f"role must be 'query', 'key' or None; got {role!r}")
        oprf_a, psi = self._statistics(statistics)
        if (self._spec.oprf and oprf_a is None) or (self.rebalance and psi is None):
            raise ValueError(
                f"this {self.kind!r} feature map{' with rebalance=True' if self.rebalance else ''}"
                " needs query/key statistics: expected a map from calibrate(q, k) or "
                "with_statistics(...), got one without them"
            )
        if psi is not None and role is None:
            raise ValueError(
                "role must be 'query' or 'key' for a rebalanced feature map; got None"
            )
        return xp, xp.astype(x, compute_dtype(xp, dtype), copy=False)

    def _input_factor(self, xp: Any, x: Array, role: object, psi: Any) -> Any:
        """``sqrt(scale)``, times ``Psi`` for rebalanced queries or ``1 / Psi`` for keys."""
        factor: Any = math.sqrt(self.scale)
        if psi is not None:
            psi = _like(xp, psi, x)
            factor = factor * (psi if role == "query" else 1.0 / psi)
        return factor

    def _without_overflow(self, xp: Any, x: Array, role: object, psi: Any) -> tuple[Array, Array]:
        """``x`` with zeros for rows too large to project, and where those rows are.

        A row whose largest scaled entry exceeds :func:`overflow_limit` could overflow
        ``|x|^2`` (and ``inf - inf`` gives NaN): its log-features are set to the kind's
        ``overflow`` value instead of being computed, with no floating-point warning.
        """
        largest = xp.max(xp.abs(x), axis=-1, keepdims=True) * math.sqrt(self.scale)
        if psi is not None:
            psi = _like(xp, psi, x)
            largest = largest * xp.max(psi if role == "query" else 1.0 / psi)
        overflow = largest > overflow_limit(xp, x.dtype, self.head_dim)
        return xp.where(overflow, constant(xp, 0.0, x), x), overflow

    def _projection_like(self, xp: Any, x: Array) -> Array:
        assert self._projection is not None
        return from_host(xp, self._projection, dtype=x.dtype, device=array_device(x))


def overflow_limit(xp: Any, dtype: Any, head_dim: int) -> float:
    """The largest scaled input entry whose row's ``|x|^2 / 2`` cannot overflow.

    ``sqrt(float_max / (2 d))``: about ``1.5e18`` for float32 and ``3e153`` for float64
    at ``d = 64``.  Past it the Gaussian kinds' true log-features
    ``w^T x - |x|^2 / 2`` are below ``-float_max / (4 d)`` (features that are 0 in
    every float type), so they are set to ``-inf``.
    """
    return math.sqrt(float(xp.finfo(dtype).max) / (2 * head_dim))


def _like(xp: Any, values: Any, x: Array) -> Array:
    """Host (NumPy) statistics moved to ``x``'s namespace; device ones cast to its dtype."""
    if isinstance(values, np.ndarray):
        return from_host(xp, values, dtype=x.dtype, device=array_device(x))
    return xp.astype(values, x.dtype)


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


def _refuse_assignment(self: FeatureMap, name: str, value: object) -> None:
    raise dataclasses.FrozenInstanceError(
        f"FeatureMap is immutable; use redraw() for new features ({name})"
    )


# The frozen dataclass refuses assignment already; this says what to do instead.
FeatureMap.__setattr__ = _refuse_assignment  # type: ignore[assignment,method-assign]


#: Every live map by fingerprint (see :func:`feature_map_for`): weak references to all
#: the equal maps alive, so that one's death leaves the others found.
_LIVE: dict[str, list[weakref.ref[FeatureMap]]] = {}
#: Guards ``_LIVE``; re-entrant, since a reference's callback may run (garbage
#: collection) in a thread that holds it.
_LIVE_LOCK = threading.RLock()


def _register_live(feature_map: FeatureMap) -> None:
    fingerprint = feature_map.fingerprint

    def forget(ref: weakref.ref[FeatureMap]) -> None:
        with _LIVE_LOCK:
            refs = [r for r in _LIVE.get(fingerprint, []) if r is not ref]
            if refs:
                _LIVE[fingerprint] = refs
            else:
                _LIVE.pop(fingerprint, None)

    with _LIVE_LOCK:
        _LIVE[fingerprint] = [*_LIVE.get(fingerprint, []), weakref.ref(feature_map, forget)]


def feature_map_for(fingerprint: str) -> FeatureMap | None:
    """The live map with ``fingerprint`` (any of equal ones), or ``None``.

    Custom operators take tensors and scalars only: a torch operator that needs a map is
    passed its fingerprint and finds the map here (registered when it was made, outside
    any traced code).

    Examples
    --------
    >>> import linattn as la
    >>> from linattn.features import feature_map_for
    >>> fm = la.FeatureMap(8, 16, seed=0)
    >>> feature_map_for(fm.fingerprint).fingerprint == fm.fingerprint
    True
    """
    with _LIVE_LOCK:
        refs = list(_LIVE.get(fingerprint, []))
    for ref in refs:
        if (feature_map := ref()) is not None:
            return feature_map
    return None


def _restore(fields: dict[str, Any]) -> FeatureMap:
    """A FeatureMap from its fields (unpickling, copies with new statistics, adoption)."""
    new = object.__new__(FeatureMap)
    new._assign(**fields)
    return new


def _frozen(array: np.ndarray) -> np.ndarray:
    array.setflags(write=False)
    return array


def _check_oprf_a(oprf_a: object, kind: str) -> float:
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


def _check_rebalance_scales(scales: Any, head_dim: int) -> np.ndarray:
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


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{name} must be a positive integer; got {value!r}")


def _check_seed(seed: object) -> None:
    """(``object``: the annotation says what a caller should pass, not what it did.)"""
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer; got {seed!r}")
