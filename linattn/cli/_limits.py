"""What a run may ask for: memory it would need, and inputs whose exponentials overflow.

Both checks run before anything large is allocated, so a size or scale that cannot
work ends in a message naming the option (exit status 2) instead of a traceback.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "MemoryNeed",
    "accuracy_memory",
    "bench_memory",
    "format_bytes",
    "largest_logit_scale",
]

FLOAT64 = 8


def format_bytes(count: float) -> str:
    """``3.2 GiB``: binary units up to EiB, then powers of ten of bytes.

    Examples
    --------
    >>> format_bytes(3 * 2**30)
    '3.0 GiB'
    """
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if count < 1024 or unit == "EiB":
            break
        count /= 1024
    if count >= 1024:
        return f"{count:.3g} EiB"
    return f"{count:.1f} {unit}" if unit != "B" else f"{int(count)} B"


@dataclass(frozen=True)
class MemoryNeed:
    """Bytes a run needs on the host and, for accelerator arrays, on the device."""

    host: int
    device: int
    what: str  # what dominates, for the message
    length: int


def accuracy_memory(length: int, head_dim: int, num_features: int, itemsize: int) -> MemoryNeed:
    """The accuracy study: NumPy float64 data and reference, and the library's copies.

    The exact reference holds the ``L x L`` attention weights and, while total
    variation is computed, the estimated weights and two temporaries of that size.
    """
    square = 5 * length * length * FLOAT64
    features = 6 * length * num_features * FLOAT64
    data = 5 * length * head_dim * FLOAT64
    library = 3 * length * (head_dim + num_features) * itemsize
    what = "mostly the exact reference's L x L float64 attention weights"
    return MemoryNeed(square + features + data, library, what, length)


def bench_memory(
    batch: int,
    heads: int,
    length: int,
    head_dim: int,
    num_features: int,
    itemsize: int,
    exact: bool,
    causal: bool,
) -> MemoryNeed:
    """One length of the benchmark: inputs and output, then the larger of the two methods.

    Exact attention holds three ``(B, H, L, L)`` arrays at once (logits, weights and a
    temporary) and, when causal, an ``L x L`` mask; linear attention a few
    ``(B, H, L, m)`` feature arrays.  Inputs are drawn on the host in float64.
    """
    rows = batch * heads * length
    inputs = 4 * rows * head_dim * itemsize
    linear = 6 * rows * num_features * itemsize
    method = linear
    what = "the inputs and linear attention's features"
    if exact:
        square = 3 * rows * length * itemsize + (2 * length * length if causal else 0)
        if square > method:
            method = square
            what = "mostly exact attention's B x H x L x L weights"
    host_draw = 3 * rows * head_dim * FLOAT64  # two float64 draws and a scaled copy
    return MemoryNeed(host_draw, inputs + method, what, length)


def _log_squared_norms(z: np.ndarray, log_scale: np.ndarray) -> np.ndarray:
    """``log |x_i|^2`` for ``x_il = exp(log_scale_l) z_il``, without forming ``x``."""
    with np.errstate(divide="ignore"):
        logs = 2 * (np.log(np.abs(z)) + log_scale)
    top = logs.max(axis=-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):
        norms: np.ndarray = (top + np.log(np.exp(logs - top).sum(axis=-1, keepdims=True)))[..., 0]
    return norms


def log_exponent(length: int, head_dim: int, scale: float, anisotropy: float, seed: int) -> float:
    """``log`` of the largest ``(|q|^2 + |k|^2) / (2 sqrt(d))`` of the study's data.

    By Cauchy-Schwarz it bounds every logit ``q.k / sqrt(d)``; the positive and
    hyperbolic features carry ``exp(-|x|^2 / (2 sqrt(d)))``.  Computed in log space
    from the same draws as :func:`linattn.cli._accuracy.seed_data`, so scales whose
    data would overflow are measured too.
    """
    rng = np.random.default_rng(seed)
    zq = rng.standard_normal((length, head_dim))
    zk = rng.standard_normal((length, head_dim))
    rng.standard_normal((length, head_dim))  # the values: drawn, not needed
    tilt = anisotropy * rng.standard_normal(head_dim) if anisotropy else np.zeros(head_dim)
    log_s = math.log(scale)
    top_q = _log_squared_norms(zq, log_s + tilt).max()
    top_k = _log_squared_norms(zk, log_s - tilt).max()
    return float(np.logaddexp(top_q, top_k)) - math.log(2 * math.sqrt(head_dim))


def largest_logit_scale(dtype: str) -> float:
    """``log`` of the largest finite ``dtype``: where ``exp`` overflows (709.8 for float64)."""
    return math.log(float(np.finfo(dtype).max))


def largest_anisotropy(
    length: int, head_dim: int, scale: float, anisotropy: float, seed: int, limit: float
) -> float:
    """The largest tilt in ``[0, anisotropy]`` whose exponent stays within ``limit``."""
    low, high = 0.0, anisotropy
    for _ in range(60):
        middle = 0.5 * (low + high)
        if log_exponent(length, head_dim, scale, middle, seed) <= math.log(limit):
            low = middle
        else:
            high = middle
    return low


def power_of_ten(log_value: float) -> str:
    """``exp(log_value)`` as text, also beyond the float range (``1e+401``)."""
    if log_value < 700:
        return f"{math.exp(log_value):.3g}"
    exponent = log_value / math.log(10)
    mantissa = 10 ** (exponent - math.floor(exponent))
    return f"{mantissa:.2f}e+{math.floor(exponent)}"


def round_down(value: float) -> str:
    """``value`` to three significant digits, never above it (a limit users may pass).

    Examples
    --------
    >>> round_down(8.7689)
    '8.76'
    """
    text = f"{value:.3g}"
    if float(text) > value:
        step = 10 ** (math.floor(math.log10(value)) - 2)
        text = f"{float(text) - step:.3g}"
    return text


def oversized(options: Sequence[tuple[str, float, float]]) -> str:
    """The options above their defaults, ``--a/--b``; the first one when none is."""
    names = [name for name, value, default in options if value > default]
    return "/".join(names or [options[0][0]])
