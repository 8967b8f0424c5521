"""Where the fit starts: the far weight ``g`` of each key head from one batch, the exact
far mass over the initial map's (:func:`start_far_weight`)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from linattn import fitted
from linattn._xp import constant, to_host
from linattn.fitted import FittedParameters
from linattn.transfer.batches import Parts
from linattn.transfer.loss import forward

__all__ = ["start_far_weight"]


def start_far_weight(p: FittedParameters, pieces: Sequence[Parts]) -> FittedParameters:
    """``g``'s start per key head: the median over real rows of one batch (its
    ``pieces``) of the exact far mass over the initial map's far mass (both relative to
    the row's near mass)."""
    ratios = [_log_far_mass_ratio(p, parts) for parts in pieces]
    log_ratio = np.concatenate([r[0] for r in ratios])  # (B, H_kv, G, L)
    rows = np.concatenate([r[1] for r in ratios])  # (B, L)
    g = np.ones(p.far_weight.shape)
    for h in range(log_ratio.shape[1]):
        values = log_ratio[:, h]
        ok = np.broadcast_to(rows[:, None, :], values.shape) & np.isfinite(values)
        if ok.any():
            value = float(np.exp(np.median(values[ok])))
            if g.ndim:
                g[h] = value
            else:
                g = np.asarray(value)
    return fitted.check_parameters(
        p.query_weight,
        p.query_bias,
        None if p.tied else p.key_weight,
        None if p.tied else p.key_bias,
        g,
        tied=p.tied,
    )


def _log_far_mass_ratio(p: FittedParameters, parts: Parts) -> tuple[np.ndarray, np.ndarray]:
    """``log`` of the exact far mass over the map's, both relative to the near mass, per
    row (``(B, H_kv, G, L)``, NaN where undefined), and which rows are real (``(B, L)``)."""
    xp = parts.xp
    _, saved = forward(p, parts)
    probs = saved["probs"]
    mapped_far = xp.sum(probs * parts.far_weights, axis=-1)
    mapped_near = xp.sum(xp.where(parts.near_weights > 0, probs, xp.zeros_like(probs)), axis=-1)
    log_exact = xp.matmul(parts.q, xp.matrix_transpose(parts.k)) * parts.scale - parts.near_top
    neg = constant(xp, -math.inf, log_exact)
    log_far = xp.where(parts.far, log_exact, neg)
    top = xp.max(log_far, axis=-1, keepdims=True)
    top = xp.where(xp.isfinite(top), top, xp.zeros_like(top))
    masses = [
        xp.sum(xp.exp(log_far - top), axis=-1),
        xp.sum(parts.near_weights, axis=-1),
        mapped_far,
        mapped_near,
    ]
    far, near, m_far, m_near = (np.asarray(to_host(x), dtype=np.float64) for x in masses)
    usable = (far > 0) & (near > 0) & (m_far > 0) & (m_near > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        log_ratio = np.log(far) + np.asarray(to_host(top[..., 0]), dtype=np.float64)
        log_ratio = log_ratio - np.log(near) - np.log(m_far) + np.log(m_near)
    log_ratio = np.where(usable, log_ratio, np.nan)
    return log_ratio, np.asarray(to_host(parts.rows[..., 0]))[:, 0, 0] > 0
