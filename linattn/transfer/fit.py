"""The fit of one layer (:func:`fit_layer`): Adam steps on the fit split, early stopping
per key head on the validation split, ``g = 0`` for a key head whose fit does not beat
the exact parts alone there (:data:`MIN_GAIN`), and what it found (:class:`LayerFit`).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from linattn import fitted
from linattn._checks import check_scale
from linattn._xp import namespace_of
from linattn.features import FeatureMap
from linattn.fitted import FittedParameters
from linattn.transfer.batches import LayerBatch, prepare, sampled_rows
from linattn.transfer.loss import batch_loss_grad, forward, squared_error, squared_norm
from linattn.transfer.optimiser import Adam, parameters_of, values_of
from linattn.transfer.start import start_far_weight
from linattn.transfer.threads import Run, one_blas_thread, pieces_run

__all__ = ["MIN_GAIN", "SINK_KEYS", "LayerFit", "fit_layer"]

#: A key head keeps its far part only where the fit lowers its relative validation
#: error (``||out - exact|| / ||exact||``) below window + sinks' by more than this: where
#: there is nothing to gain (no far keys) both are rounding (1e-16 in float64, 1e-7 in
#: float32), which must not decide; a fit that helps lowers it by 1e-2 or more.
MIN_GAIN = 1e-5

#: The first keys of every row that a conversion attends exactly by default (its
#: ``sink_keys``), StreamingLLM's four attention sinks (Xiao et al. 2024).  Measured on
#: all-MiniLM-L6-v2 (``docs/estimators.md``, "Sink keys"): beside a window of 16 the
#: fitted hybrid's test cosine rises with them, more than a window widened by as many
#: keys gives it; each costs one exact key per row.
SINK_KEYS = 4


@dataclass
class LayerFit:
    """What :func:`fit_layer` found.

    Attributes
    ----------
    feature_map : FeatureMap
        The fitted map (``kind="hedgehog"``, per-head parameters, far weights; ``g = 0``
        for the heads in ``exact_only``).
    validation_error : numpy.ndarray, shape ``(H,)``
        Relative error ``||out - exact|| / ||exact||`` per head on the validation split,
        of the kept parameters.
    exact_parts_error : numpy.ndarray, shape ``(H,)``
        The same for the exact parts alone (window + sinks, ``g = 0``).
    exact_squared_norm : numpy.ndarray, shape ``(H,)``
        ``||exact||**2`` per head on the validation split, the weights that combine the
        heads' errors into the layer's (:meth:`error_shares`).
    exact_only : numpy.ndarray of bool, shape ``(H_kv,)``
        Key heads set to ``g = 0`` (their fit did not beat the exact parts).
    steps : int
        Gradient steps taken (early stopping may end before ``steps``).
    seconds : float
        Wall time of the fit.
    history : list of (int, float)
        ``(step, relative validation error of all heads)`` at each evaluation.
    """

    feature_map: FeatureMap
    validation_error: np.ndarray
    exact_parts_error: np.ndarray
    exact_squared_norm: np.ndarray
    exact_only: np.ndarray
    steps: int
    seconds: float
    history: list[tuple[int, float]] = field(default_factory=list)

    def error_shares(self) -> np.ndarray:
        """Each head's share of the layer's fitted squared error on the validation
        split, ``(H,)``, summing to 1 (0 everywhere for a layer without error).

        A head with a large share is one the map cannot follow, typically one that looks
        a single key up (``docs/estimators.md``, "Where the error stays").

        Examples
        --------
        >>> import numpy as np
        >>> from linattn import FeatureMap
        >>> fit = LayerFit(FeatureMap.fitted(np.eye(2), tied=True), np.array([0.1, 0.3]),
        ...     np.ones(2), np.array([4.0, 1.0]), np.zeros(2, bool), 0, 0.0)
        >>> fit.error_shares().round(3)
        array([0.308, 0.692])
        """
        squared = self.validation_error**2 * self.exact_squared_norm
        total = squared.sum()
        return squared / total if total > 0 else np.zeros_like(squared)

    def worst_heads(self, count: int) -> tuple[int, ...]:
        """The ``count`` heads with the largest :meth:`error_shares` (ties: the lower
        index), in increasing order: the heads to attend exactly (``exact_heads``).

        Raises
        ------
        ValueError
            ``count`` is not an integer from 0 to the number of heads.

        Examples
        --------
        >>> import numpy as np
        >>> from linattn import FeatureMap
        >>> fit = LayerFit(FeatureMap.fitted(np.eye(2), tied=True), np.array([0.1, 0.3, 0.2]),
        ...     np.ones(3), np.array([4.0, 1.0, 4.0]), np.zeros(3, bool), 0, 0.0)
        >>> fit.worst_heads(1), fit.worst_heads(2)
        ((2,), (1, 2))
        """
        shares = self.error_shares()
        given: object = count  # (what was given: the annotation says what to give)
        if isinstance(given, bool) or not isinstance(given, int) or not 0 <= given <= shares.size:
            raise ValueError(
                f"exact_heads must be an integer from 0 to the number of query heads "
                f"({shares.size}); got {given!r}"
            )
        return tuple(sorted(int(h) for h in np.argsort(-shares, kind="stable")[:given]))


def fit_layer(
    fit: Sequence[LayerBatch],
    validation: Sequence[LayerBatch],
    *,
    num_features: int = 64,
    window: int | None,
    sink_keys: int = 0,
    causal: bool = False,
    scale: float | None = None,
    tied: bool = False,
    steps: int = 300,
    learning_rate: float = 1e-2,
    evaluate_every: int = 25,
    patience: int = 3,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
    query_rows: int | None = None,
) -> LayerFit:
    """Fit one layer's per-head maps and far weights to its exact attention.

    Parameters
    ----------
    fit, validation : sequence of LayerBatch
        Calibration batches of this layer, from disjoint texts: ``fit`` takes the Adam
        steps (one batch per step, in a seeded order), ``validation`` chooses, per head,
        the parameters kept (early stopping) and ``g = 0`` where the fit does not beat
        the exact parts alone.
    num_features : int, default 64
        ``m``, features per head (``W`` is ``d x m/2``).
    window, sink_keys, causal, scale
        The exact parts and softmax scale, as :func:`linattn.linear_attention` will
        be called with them (``scale`` default ``1 / sqrt(d)``).
    tied : bool, default False
        One map for queries and keys.
    steps, learning_rate, evaluate_every, patience
        Adam steps at most, its rate, steps between validation passes, and passes
        without a better head before stopping.
    seed : int, default 0
        The start's noise and the batch order: the fit is deterministic for a seed.
    progress : callable, optional
        Called with a one-line status after each validation pass (the default prints
        it on stderr when stderr is a terminal).
    query_rows : int, optional
        Query rows the loss takes of each batch longer than this: that many positions
        drawn per batch (seeded; ``linattn.transfer.batches.sampled_rows``), every
        key still counted, so a batch's exact targets and weights hold ``query_rows x L``
        per head instead of ``L x L``.  None (default): every row.  Said in a progress
        line when it samples.

    Returns
    -------
    LayerFit

    Notes
    -----
    BLAS runs one thread during the fit (its many ``L x L`` products only contend with
    more); NumPy batches are computed in :data:`~linattn.transfer.PIECES` pieces of rows
    on as many threads instead, which keeps a second core busy.  Other array libraries
    keep their own threads.

    Examples
    --------
    >>> import numpy as np
    >>> import linattn as la
    >>> from linattn.transfer import LayerBatch, fit_layer
    >>> rng = np.random.default_rng(0)
    >>> def batch():
    ...     q, k, v = (rng.normal(size=(2, 2, 16, 4)) for _ in range(3))
    ...     return LayerBatch(q, k, v, np.ones((2, 16), dtype=bool))
    >>> result = fit_layer([batch()], [batch()], num_features=8, window=2, steps=20,
    ...                    evaluate_every=10, progress=lambda line: None)
    >>> result.feature_map.kind, result.feature_map.parameters.query_weight.shape
    ('hedgehog', (2, 4, 4))
    """
    if not fit or not validation:
        raise ValueError("fit and validation must each hold at least one LayerBatch")
    _check_options(num_features=num_features, steps=steps, evaluate_every=evaluate_every,
                   patience=patience, learning_rate=learning_rate,
                   query_rows=query_rows)  # fmt: skip
    with one_blas_thread(), pieces_run(namespace_of({"q": fit[0].q})) as run:
        return _fit_layer(
            fit, validation, num_features=num_features, window=window, sink_keys=sink_keys,
            causal=causal, scale=scale, tied=tied, steps=steps, learning_rate=learning_rate,
            evaluate_every=evaluate_every, patience=patience, seed=seed, progress=progress,
            run=run, query_rows=query_rows,
        )  # fmt: skip


def _check_options(
    *, num_features: object, steps: object, evaluate_every: object, patience: object,
    learning_rate: object, query_rows: object = None,
) -> None:  # fmt: skip
    """The fit's numeric options, before anything runs (``evaluate_every=0`` was a
    ZeroDivisionError, ``num_features=63`` a traceback after a layer's work)."""
    counts = {
        "steps": (steps, 0),
        "evaluate_every": (evaluate_every, 1),
        "patience": (patience, 1),
        **({} if query_rows is None else {"query_rows": (query_rows, 1)}),
    }
    for name, (value, low) in counts.items():
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
            kind = "a non-negative" if low == 0 else "a positive"
            raise ValueError(f"{name} must be {kind} integer; got {value!r}")
    if (
        isinstance(num_features, bool)
        or not isinstance(num_features, int | np.integer)
        or num_features < 2
        or num_features % 2
    ):
        raise ValueError(
            "num_features must be an even integer of at least 2 (a fitted map's features "
            f"come in pairs, [u, -u]); got {num_features!r}"
        )
    if (
        isinstance(learning_rate, bool)
        or not isinstance(learning_rate, int | float | np.floating)
        or not (math.isfinite(learning_rate) and learning_rate > 0)
    ):
        raise ValueError(f"learning_rate must be a positive finite number; got {learning_rate!r}")


def _fit_layer(
    fit: Sequence[LayerBatch],
    validation: Sequence[LayerBatch],
    *,
    num_features: int,
    window: int | None,
    sink_keys: int,
    causal: bool,
    scale: float | None,
    tied: bool,
    steps: int,
    learning_rate: float,
    evaluate_every: int,
    patience: int,
    seed: int,
    progress: Callable[[str], None] | None,
    run: Run,
    query_rows: int | None,
) -> LayerFit:
    start = time.perf_counter()
    first = fit[0]
    heads, key_heads, head_dim = (
        int(first.q.shape[1]),
        int(first.k.shape[1]),
        int(first.q.shape[-1]),
    )
    scale = check_scale(scale, head_dim)
    if tied and heads != key_heads:
        raise ValueError(
            f"tied=True needs as many key heads as query heads; got {key_heads} and {heads}"
        )
    report = progress if progress is not None else _terminal_progress

    def rows(batch: LayerBatch, index: int) -> np.ndarray | None:
        return sampled_rows(int(batch.q.shape[-2]), query_rows, seed * 100_003 + index)

    lengths = [int(b.q.shape[-2]) for b in (*fit, *validation)]
    sampled = [n for n in lengths if query_rows is not None and n > query_rows]
    if sampled:
        report(
            f"{query_rows} query rows per batch sampled in {len(sampled)} of "
            f"{len(fit) + len(validation)} batches (up to {max(sampled)} tokens), every key"
        )
    fit_parts = [
        prepare(b, window, sink_keys, causal, scale, rows(b, i)).pieces()
        for i, b in enumerate(fit)
    ]
    val_parts = [
        piece
        for i, b in enumerate(validation)
        for piece in prepare(b, window, sink_keys, causal, scale, rows(b, len(fit) + i)).pieces()
    ]
    p = fitted.initial_parameters(
        head_dim, num_features, heads=heads, key_heads=key_heads, tied=tied, seed=seed
    )
    p = start_far_weight(p, fit_parts[0])
    values = values_of(p)

    def val_errors(params: FittedParameters) -> np.ndarray:
        errors = run(lambda parts: squared_error(parts, forward(params, parts)[0]), val_parts)
        return np.asarray(sum(errors)).reshape(key_heads, -1)

    norms = np.sum([squared_norm(parts) for parts in val_parts], axis=0).reshape(key_heads, -1)
    base = val_errors(fitted.check_parameters(np.eye(head_dim), far_weight=0.0, tied=True))
    best_err = val_errors(p)
    best = {name: value.copy() for name, value in values.items()}
    adam = Adam(learning_rate)
    order = np.random.default_rng(seed).permutation
    queue: list[int] = []
    history = [(0, float(np.sqrt(best_err.sum() / norms.sum())))]
    since, step = 0, 0
    for step in range(1, steps + 1):
        if not queue:
            queue = list(order(len(fit_parts)))
        _, grads = batch_loss_grad(p, fit_parts[queue.pop()], run)
        values = adam.update(values, grads)
        p = parameters_of(values, tied)
        if step % evaluate_every and step != steps:
            continue
        err = val_errors(p)
        history.append((step, float(np.sqrt(err.sum() / norms.sum()))))
        report(
            f"step {step}/{steps}: validation error {history[-1][1]:.4f} "
            f"(window + sinks {np.sqrt(base.sum() / norms.sum()):.4f})"
        )
        better = err.sum(axis=1) < best_err.sum(axis=1)  # per key head (its groups share it)
        if not better.any():
            since += 1
            if since >= patience:
                break
            continue
        since = 0
        best_err = np.where(better[:, None], err, best_err)
        for name, value in values.items():
            _take_heads(best[name], value, better, heads, key_heads, name, tied)
    head_norms = norms.sum(axis=1)
    gain = np.sqrt(base.sum(axis=1) / head_norms) - np.sqrt(best_err.sum(axis=1) / head_norms)
    exact_only = ~(gain > MIN_GAIN)
    if window is None and not sink_keys and all(b.exact_key_mask is None for b in validation):
        exact_only[:] = False  # no exact part: g cancels, the map is all there is
    best["log_far_weight"] = np.where(exact_only, -np.inf, best["log_far_weight"])
    kept = parameters_of(best, tied)
    fm = FeatureMap.fitted(
        kept.query_weight,
        kept.query_bias,
        key_weight=None if tied else kept.key_weight,
        key_bias=None if tied else kept.key_bias,
        far_weight=kept.far_weight,
        tied=tied,
        scale=scale,
    )
    final = np.where(exact_only[:, None], base, best_err)
    return LayerFit(
        feature_map=fm,
        validation_error=np.sqrt(final / norms).reshape(-1),
        exact_parts_error=np.sqrt(base / norms).reshape(-1),
        exact_squared_norm=norms.reshape(-1),
        exact_only=exact_only,
        steps=step,
        seconds=time.perf_counter() - start,
        history=history,
    )


def _take_heads(
    best: np.ndarray,
    value: np.ndarray,
    better: np.ndarray,
    heads: int,
    key_heads: int,
    name: str,
    tied: bool,
) -> None:
    """Copy the improved key heads' slices of ``value`` into ``best`` (in place)."""
    if value.ndim == 0:
        return
    if name.startswith("key") or name == "log_far_weight":
        best[better] = value[better]
        return
    group = heads // key_heads  # query parameters: every query head of an improved key head
    chosen = np.repeat(better, group)
    best[chosen] = value[chosen]


def _terminal_progress(line: str) -> None:
    if sys.stderr.isatty():
        print(f"\r{line}", end="", file=sys.stderr, flush=True)
