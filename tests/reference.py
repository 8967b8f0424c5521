"""Independent NumPy float64 references, written for clarity rather than speed.

These never stabilise anything and build the full L x L weight matrix, so they share
no code path with the library's chunked algorithm beyond the feature map itself.
"""

from __future__ import annotations

import numpy as np

import linattn as la


def features64(fm: la.FeatureMap, x: np.ndarray, role: str = "query") -> np.ndarray:
    """phi(x) in float64 from the map's formulas (no log-space tricks)."""
    x = np.asarray(x, dtype=np.float64)
    if fm.kind == "elu":
        return np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))
    if fm.kind == "relu":
        return np.maximum(x, 0.0) + 1e-3
    w = np.asarray(fm.projection)
    xs = x * np.sqrt(fm.scale)
    if fm.rebalance_scales is not None:
        psi = fm.rebalance_scales
        xs = xs * psi if role == "query" else xs / psi
    proj = xs @ w.T
    sq = np.sum(xs**2, axis=-1, keepdims=True)
    m = fm.num_features
    if fm.kind == "positive":
        return np.exp(proj - sq / 2) / np.sqrt(m)
    if fm.kind == "hyperbolic":
        return (
            np.concatenate([np.exp(proj), np.exp(-proj)], axis=-1) * np.exp(-sq / 2) / np.sqrt(m)
        )
    if fm.kind in ("oprf", "hyperbolic_oprf"):
        a = fm.oprf_a
        b = np.sqrt(1 - 4 * a)
        energy = a * np.sum(w**2, axis=1)
        signs = [1.0, -1.0] if fm.kind == "hyperbolic_oprf" else [1.0]
        parts = [np.exp(energy + s * b * proj) for s in signs]
        return (
            np.concatenate(parts, axis=-1)
            * np.exp(-sq / 2)
            * (1 - 4 * a) ** (fm.head_dim / 4)
            / np.sqrt(m)
        )
    if fm.kind == "trigonometric":
        return (
            np.concatenate([np.cos(proj), np.sin(proj)], axis=-1) * np.exp(sq / 2) / np.sqrt(m / 2)
        )
    if fm.kind == "random_relu":
        return np.maximum(proj, 0.0) + 1e-3
    raise AssertionError(fm.kind)


def kernel_attention(
    phi_q: np.ndarray,
    phi_k: np.ndarray,
    v: np.ndarray,
    *,
    causal: bool = False,
    key_mask: np.ndarray | None = None,
) -> np.ndarray:
    """Normalised attention with weights phi_q phi_k^T (explicit L x L), zeros for empty rows."""
    weights = phi_q @ np.swapaxes(phi_k, -1, -2)
    visible = np.ones(weights.shape[-2:], dtype=bool)
    if causal:
        visible = np.tril(visible)
    if key_mask is not None:
        visible = visible & np.asarray(key_mask)[..., None, :]
    weights = np.where(visible, weights, 0.0)
    den = weights.sum(axis=-1, keepdims=True)
    return (weights @ v) / np.where(den == 0, 1.0, den)


def linear_reference(q, k, v, fm, *, causal=False, key_mask=None) -> np.ndarray:
    if fm.needs_calibration:
        fm = fm.calibrate(q, k, key_mask=key_mask)
    return kernel_attention(
        features64(fm, q, "query"),
        features64(fm, k, "key"),
        np.asarray(v, np.float64),
        causal=causal,
        key_mask=key_mask,
    )


def softmax_reference(q, k, v, *, causal=False, key_mask=None, scale=None) -> np.ndarray:
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    logits = scale * q @ np.swapaxes(k, -1, -2)
    visible = np.ones(logits.shape[-2:], dtype=bool)
    if causal:
        visible = np.tril(visible)
    if key_mask is not None:
        visible = visible & np.asarray(key_mask)[..., None, :]
    logits = np.where(visible, logits, -np.inf)
    top = logits.max(axis=-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    w = np.exp(logits - top)
    den = w.sum(axis=-1, keepdims=True)
    return (w / np.where(den == 0, 1.0, den)) @ v
