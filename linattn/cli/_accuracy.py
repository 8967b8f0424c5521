"""The accuracy study behind ``linattn accuracy`` and ``demo``: plain functions, no I/O.

The seed's experiment done right (``docs/algorithm.md``, section 15): fixed data
``Q, K ~ scale * N(0, 1)``, ``V ~ N(0, 1)``, one exact reference in NumPy float64,
and the error of each estimator averaged over independent projection draws.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

import linattn as la
from linattn._dispatch import Backend
from linattn._xp import to_host
from linattn.cli._backends import ArrayLibrary
from linattn.features import SOFTMAX_KINDS, kind_spec

__all__ = [
    "AccuracyRow",
    "Estimator",
    "accuracy_study",
    "fitted_slope",
    "parse_estimator",
    "random_kinds",
    "seed_data",
]

Step = Callable[[], None]


def no_step() -> None:
    """The default ``on_step``: progress is not reported."""
    return None


# -- estimators ---------------------------------------------------------------------


def random_kinds() -> list[str]:
    """The feature kinds that estimate softmax attention with a random projection."""
    return [kind for kind in la.KINDS if kind_spec(kind).random]


@dataclass(frozen=True)
class Estimator:
    """A random-feature estimator: a feature kind, iid or orthogonal, maybe rebalanced."""

    kind: str
    orthogonal: bool
    rebalance: bool = False

    @property
    def label(self) -> str:
        label = f"{self.kind}-{'orf' if self.orthogonal else 'iid'}"
        return label + "-rebalanced" if self.rebalance else label

    def feature_map(self, head_dim: int, num_features: int, seed: int) -> la.FeatureMap:
        return la.FeatureMap(
            head_dim,
            num_features,
            kind=self.kind,  # type: ignore[arg-type]
            orthogonal=self.orthogonal,
            rebalance=self.rebalance,
            seed=seed,
        )


def parse_estimator(text: str) -> Estimator:
    """``"KIND-orf"`` or ``"KIND-iid"`` (``"KIND"`` alone means orthogonal), optionally
    followed by ``"-rebalanced"`` (SADERF rebalancing).

    Examples
    --------
    >>> parse_estimator("positive-iid").label
    'positive-iid'
    >>> parse_estimator("hyperbolic")
    Estimator(kind='hyperbolic', orthogonal=True, rebalance=False)
    >>> parse_estimator("hyperbolic_oprf-orf-rebalanced").rebalance
    True
    """
    body = text.strip()
    rebalance = body.endswith("-rebalanced")
    body = body.removesuffix("-rebalanced")
    kind, _, projection = body.rpartition("-")
    if not kind or projection not in ("orf", "iid"):
        kind, projection = body, "orf"
    kinds = random_kinds()
    if kind not in kinds or (rebalance and kind not in SOFTMAX_KINDS):
        choices = ", ".join(f"{k}-orf, {k}-iid" for k in kinds)
        raise ValueError(
            f"unknown estimator {text!r}; choose from {choices}, each softmax kind "
            "optionally followed by -rebalanced"
        )
    return Estimator(kind, projection == "orf", rebalance)


# -- accuracy -----------------------------------------------------------------------


@dataclass(frozen=True)
class AccuracyRow:
    """Error of one estimator at one feature count, over ``draws`` projection draws."""

    estimator: str
    num_features: int
    metric: str
    mean: float
    standard_error: float
    std: float
    draws: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


METRICS = {
    "mse": "attention output MSE vs exact",
    "tv": "total variation of attention rows vs exact",
}


def seed_data(
    length: int, head_dim: int, scale: float, seed: int, anisotropy: float = 0.0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``Q, K ~ scale * N(0, 1)`` and ``V ~ N(0, 1)``, float64, from ``seed``.

    With ``anisotropy`` ``a > 0``, query coordinate ``l`` is scaled by ``exp(a z_l)`` and
    key coordinate ``l`` by ``exp(-a z_l)`` (``z ~ N(0, 1)``): the logits keep their
    distribution, only the per-coordinate balance of queries and keys changes.
    """
    rng = np.random.default_rng(seed)
    q = scale * rng.standard_normal((length, head_dim))
    k = scale * rng.standard_normal((length, head_dim))
    v = rng.standard_normal((length, head_dim))
    if anisotropy:
        tilt = np.exp(anisotropy * rng.standard_normal(head_dim))
        q, k = q * tilt, k / tilt
    return q, k, v


def _attention_weights(
    feature_map: la.FeatureMap, q: np.ndarray, k: np.ndarray, causal: bool
) -> np.ndarray:
    """The estimated attention matrix, rows normalised, computed stably in float64."""
    log_q, sign_q = feature_map.signed_log_features(q, role="query")
    log_k, sign_k = feature_map.signed_log_features(k, role="key")
    # A per-row shift of the queries and one global shift of the keys cancel on
    # normalisation (a per-feature key shift would not).
    phi_q = np.exp(log_q - log_q.max(axis=-1, keepdims=True))
    phi_k = np.exp(log_k - log_k.max())
    if sign_q is not None:
        phi_q, phi_k = sign_q * phi_q, sign_k * phi_k
    weights = phi_q @ phi_k.T
    if causal:
        weights = np.tril(weights)
    normalised: np.ndarray = weights / weights.sum(axis=-1, keepdims=True)
    return normalised


def _exact_weights(q: np.ndarray, k: np.ndarray, scale: float, causal: bool) -> np.ndarray:
    logits = scale * (q @ k.T)
    if causal:
        logits = np.where(np.tri(len(q), len(k), dtype=bool), logits, -np.inf)
    weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
    normalised: np.ndarray = weights / weights.sum(axis=-1, keepdims=True)
    return normalised


def accuracy_study(
    library: ArrayLibrary,
    estimators: Sequence[Estimator],
    num_features: Sequence[int],
    *,
    length: int = 64,
    head_dim: int = 32,
    input_scale: float = 0.3,
    anisotropy: float = 0.0,
    draws: int = 50,
    data_seed: int = 0,
    causal: bool = False,
    metrics: Sequence[str] = tuple(METRICS),
    on_step: Step = no_step,
    backend: Backend | None = None,
) -> list[AccuracyRow]:
    """Error of each estimator against exact softmax attention, per feature count.

    One fixed data set; projections drawn with seeds ``0 .. draws - 1``.  Linear
    attention runs on ``library`` (the error includes its rounding); the exact
    reference is NumPy float64.  ``on_step`` is called once per projection draw.
    Estimators that need query/key statistics (OPRF, rebalancing) are calibrated on
    the study's own queries and keys.  ``backend`` is passed to
    :func:`linattn.linear_attention`.

    Examples
    --------
    >>> from linattn.cli._backends import load_library
    >>> rows = accuracy_study(
    ...     load_library("numpy", "float64"), [parse_estimator("positive-orf")], [16, 64],
    ...     length=16, head_dim=8, draws=4)
    >>> [(r.num_features, r.metric) for r in rows]
    [(16, 'mse'), (16, 'tv'), (64, 'mse'), (64, 'tv')]
    """
    with _one_blas_thread():
        return _accuracy_study(
            library,
            estimators,
            num_features,
            length=length,
            head_dim=head_dim,
            input_scale=input_scale,
            anisotropy=anisotropy,
            draws=draws,
            data_seed=data_seed,
            causal=causal,
            metrics=metrics,
            on_step=on_step,
            backend=backend,
        )


def _one_blas_thread() -> Any:
    """One BLAS thread for the study's small matrices: threads only contend there."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return contextlib.nullcontext()
    return threadpool_limits(limits=1, user_api="blas")


def _accuracy_study(
    library: ArrayLibrary,
    estimators: Sequence[Estimator],
    num_features: Sequence[int],
    *,
    length: int,
    head_dim: int,
    input_scale: float,
    anisotropy: float,
    draws: int,
    data_seed: int,
    causal: bool,
    metrics: Sequence[str],
    on_step: Step,
    backend: Backend | None = None,
) -> list[AccuracyRow]:
    unknown = [metric for metric in metrics if metric not in METRICS]
    if unknown:
        raise ValueError(f"metrics must be among {sorted(METRICS)}; got {unknown}")
    q, k, v = seed_data(length, head_dim, input_scale, data_seed, anisotropy)
    exact = la.softmax_attention(q, k, v, causal=causal)
    exact_weights = _exact_weights(q, k, 1.0 / math.sqrt(head_dim), causal)
    q_lib, k_lib, v_lib = (library.asarray(a) for a in (q, k, v))
    rows = []
    for estimator in estimators:
        for m in num_features:
            errors: dict[str, list[float]] = {metric: [] for metric in metrics}
            for seed in range(draws):
                feature_map = estimator.feature_map(head_dim, m, seed)
                if feature_map.needs_calibration:
                    feature_map = feature_map.calibrate(q, k)
                if "mse" in errors:
                    out = la.linear_attention(
                        q_lib, k_lib, v_lib, feature_map, causal=causal, backend=backend
                    )
                    out = np.asarray(to_host(out), dtype=np.float64)
                    errors["mse"].append(float(np.mean((out - exact) ** 2)))
                if "tv" in errors:
                    weights = _attention_weights(feature_map, q, k, causal)
                    tv = 0.5 * np.abs(weights - exact_weights).sum(axis=-1)
                    errors["tv"].append(float(tv.mean()))
                on_step()
            for metric, values in errors.items():
                sample = np.asarray(values)
                std = float(sample.std(ddof=1)) if draws > 1 else 0.0
                rows.append(
                    AccuracyRow(
                        estimator=estimator.label,
                        num_features=m,
                        metric=metric,
                        mean=float(sample.mean()),
                        standard_error=std / math.sqrt(draws),
                        std=std,
                        draws=draws,
                    )
                )
    return rows


def fitted_slope(rows: Sequence[AccuracyRow], estimator: str, metric: str = "mse") -> float:
    """Least-squares slope of log(mean error) against log(m); NaN with fewer than 2 points."""
    points = [
        (r.num_features, r.mean)
        for r in rows
        if r.estimator == estimator and r.metric == metric and r.mean > 0
    ]
    if len({m for m, _ in points}) < 2:
        return math.nan
    x, y = np.log([p[0] for p in points]), np.log([p[1] for p in points])
    return float(np.polyfit(x, y, 1)[0])
