"""The feature map: :class:`FeatureMap`, an immutable map from queries and keys to
log-features, and :func:`feature_map_for`, which finds a live map by its fingerprint.

The class holds what a map is (its fields, how it is made, copied and pickled) and its
public methods; the work is done by its sibling modules: :mod:`linattn.features.checks`
(arguments, fields, fingerprint), :mod:`linattn.features.statistics` (calibration),
:mod:`linattn.features.compute` (log-features and their VJP) and
:mod:`linattn.features.kinds` (one object per kind).
"""

from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass
from typing import Any

import numpy as np

from linattn import fitted
from linattn._xp import Array, array_namespace
from linattn.calibration import Statistics
from linattn.features import compute
from linattn.features.checks import (
    adopted_projection,
    check_map_arguments,
    checked_fields,
)
from linattn.features.compute import Role
from linattn.features.kinds import KIND_SPECS, FeatureKind, Kind
from linattn.features.registry import LiveRegistry
from linattn.features.statistics import calibrated
from linattn.fitted import FittedParameters, check_parameters, initial_parameters
from linattn.projections import Norms, gaussian_projection

__all__ = ["FeatureMap", "feature_map_for"]

#: The fields :meth:`FeatureMap.replace` changes (the others must agree with the
#: projection or the fitted parameters).
_REPLACEABLE = ("scale", "rebalance", "oprf_a", "rebalance_scales")


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
        spec = check_map_arguments(head_dim, num_features, kind, orthogonal, seed)
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
        checked = checked_fields(
            head_dim=head_dim,
            num_features=num_features,
            kind=kind,
            scale=scale,
            projection=projection,
            rebalance=rebalance,
            oprf_a=oprf_a,
            rebalance_scales=rebalance_scales,
            parameters=parameters,
        )
        fields: dict[str, object] = {
            "head_dim": int(head_dim),
            "num_features": int(num_features),
            "kind": kind,
            "orthogonal": orthogonal,
            "norms": norms,
            "scale": checked.scale,
            "seed": seed,
            "rebalance": rebalance,
            "oprf_a": checked.oprf_a,
            "_projection": checked.projection,
            "_rebalance_scales": checked.rebalance_scales,
            "_parameters": parameters,
            "_fingerprint": checked.fingerprint,
            "_grouped_maps": {},
        }
        for name, value in fields.items():
            object.__setattr__(self, name, value)
        _LIVE_MAPS.register(self)
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
        """A copy with any fields of :meth:`_assign` changed (checked as :meth:`_assign` does).

        Outside this module, :meth:`replace`.
        """
        return _restore({**self._fields(), **changes})

    def replace(self, **changes: Any) -> FeatureMap:
        """A copy with some of ``scale``, ``rebalance``, ``oprf_a`` and ``rebalance_scales``
        changed, checked as the constructor checks them.

        The projection (or the fitted parameters) stays; a changed ``scale`` changes the
        features and the fingerprint.  :meth:`from_projection` makes maps without
        rebalancing: ``replace(rebalance=True)`` asks for it.

        Examples
        --------
        >>> import numpy as np
        >>> import linattn as la
        >>> fm = la.FeatureMap.from_projection(np.eye(4)).replace(rebalance=True)
        >>> fm.rebalance, fm.needs_calibration
        (True, True)
        """
        unknown = sorted(set(changes) - set(_REPLACEABLE))
        if unknown:
            raise TypeError(
                f"replace takes {', '.join(_REPLACEABLE)}; got unknown names {unknown}"
            )
        return self._replace(**changes)

    def __reduce__(self) -> tuple[Any, tuple[dict[str, Any]]]:
        # Rebuilt through _assign, so the arrays are read-only again after unpickling.
        return _restore, (self._fields(),)

    @property
    def spec(self) -> FeatureKind:
        """The :class:`linattn.features.FeatureKind` that computes this map's features."""
        return KIND_SPECS[self.kind]

    # The former name of ``spec``, still read by ``linattn._call``.

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
        host, spec = adopted_projection(matrix, kind)
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

    def far_cancelled(self) -> FeatureMap:
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
        return (self.spec.oprf and self.oprf_a is None) or (
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
        changes = calibrated(
            q,
            k,
            head_dim=self.head_dim,
            scale=self.scale,
            rebalance=self.rebalance,
            oprf=self.spec.oprf,
            key_mask=key_mask,
            query_mask=query_mask,
        )
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
        return self.spec.positive

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
        return compute.signed_log_features(self, x, role=role, statistics=statistics)

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
        return compute.log_features_vjp(self, x, d_log, role=role, statistics=statistics)

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
        return compute.parameter_vjp(self, x, d_log, role=role)


def _refuse_assignment(self: FeatureMap, name: str, value: object) -> None:
    raise dataclasses.FrozenInstanceError(
        f"FeatureMap is immutable; use redraw() for new features ({name})"
    )


# The frozen dataclass refuses assignment already; this says what to do instead.
FeatureMap.__setattr__ = _refuse_assignment  # type: ignore[assignment,method-assign]

#: Every live map by fingerprint (see :func:`feature_map_for`).
_LIVE_MAPS: LiveRegistry[FeatureMap] = LiveRegistry()


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
    return _LIVE_MAPS.find(fingerprint)


def _restore(fields: dict[str, Any]) -> FeatureMap:
    """A FeatureMap from its fields (unpickling, copies with new statistics, adoption)."""
    new = object.__new__(FeatureMap)
    new._assign(**fields)
    return new
