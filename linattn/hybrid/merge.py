"""Partial rows and their merge: each part of the hybrid yields ``(P, c)``, unnormalised
``[numerator | denominator]`` rows ``P`` whose true value is ``exp(c) P``, and
:func:`merge` adds them as online softmax does (``docs/algorithm.md``, section 17).
The window's band of exact keys (:func:`banded_partial`) and the exact parts' adjoint
(:func:`softmax_backward`) are here too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from linattn._xp import Array, Namespace, array_device, constant, from_host, safe_shift

__all__ = [
    "MIN_BAND_BLOCK",
    "Band",
    "Partial",
    "banded_partial",
    "merge",
    "softmax_backward",
    "softmax_partial",
]

#: Queries per block of the banded (window) part: at least the band's width, so that a
#: block's keys are its own block and the next; 32 keeps tiny windows from making
#: thousands of tiny products.
MIN_BAND_BLOCK = 32

Partial = tuple[Array, Array]  # (P, c): [numerator | denominator] rows and their log-scale


def softmax_partial(xp: Namespace, logits: Array, visible: Array, values: Array) -> Partial:
    """Exact weights ``exp(logits)`` over the visible keys, as a stabilised partial.

    Invisible keys are *selected* away (a NaN or infinite logit of a later or masked key
    never reaches a row); a row that sees no key has log-scale ``-inf``.
    """
    logits = xp.where(visible, logits, constant(xp, -math.inf, logits))
    top = xp.max(logits, axis=-1)
    weights = xp.exp(logits - safe_shift(xp, top)[..., None])  # exp(-inf) = 0 where hidden
    rows = xp.concat(
        [xp.matmul(weights, values), xp.sum(weights, axis=-1, keepdims=True)], axis=-1
    )
    return rows, top


def merge(xp: Namespace, parts: list[Partial]) -> Array:
    """``sum_i exp(c_i - c*) P_i`` with ``c* = max_i c_i``: the rows of all parts at one scale."""
    if len(parts) == 1:
        return parts[0][0]
    top = parts[0][1]
    for _, scale in parts[1:]:
        top = xp.maximum(top, scale)
    top = safe_shift(xp, top)
    total = None
    for rows, scale in parts:
        term = xp.exp(scale - top)[..., None] * rows
        total = term if total is None else total + term
    return total


def banded_partial(
    xp: Namespace,
    q: Array,
    keys: Array,
    values: Array,
    keep: Array,
    span: int,
    scale: float,
    *,
    kernel: Any = None,
) -> Partial:
    """Query ``i`` against ``keys[i + 1 .. i + span]`` exactly: the window part.

    ``keys`` (``(..., T + span, d)``) hold the band's keys in position order (the
    caller pads them), ``keep`` (``(..., T + span)``) which of them take part.  Blocks of
    ``B >= span`` queries see their own key block and the next (``(B, 2B)`` logits),
    so the cost is ``O(T B d)``, linear in ``T``.  ``kernel``, where the call's plan chose
    it (:func:`linattn._dispatch.window_kernel_for`), is the compiled window part
    (``linattn_numba.cpu.window``) that runs instead: the same contract, ``O(T span d)``.
    """
    if kernel is not None:
        partial: tuple[Array, Array] = kernel.banded_partial(q, keys, values, keep, span, scale)
        return partial
    band = Band.of(xp, q, keys, values, keep, span)
    logits = xp.matmul(band.queries, xp.matrix_transpose(band.keys)) * scale
    rows, top = softmax_partial(xp, logits, band.visible, band.values)
    return band.tokens(xp, rows), band.tokens(xp, top[..., None])[..., 0]


@dataclass(frozen=True)
class Band:
    """The window part's blocks: ``(..., N, B, .)`` queries, ``(..., N, 2B, .)`` keys."""

    queries: Array
    keys: Array
    values: Array
    visible: Array  # (..., N, B, 2B)
    length: int  # T
    key_length: int  # T + span
    size: int  # B

    @classmethod
    def of(
        cls, xp: Namespace, q: Array, keys: Array, values: Array, keep: Array, span: int
    ) -> Band:
        length = q.shape[-2]
        size = max(span, MIN_BAND_BLOCK)
        count = -(-length // size)
        total = (count + 1) * size
        device = array_device(q)

        def pairs(x: Array) -> Array:  # each block with the next: (..., N, 2B, .)
            x = blocked(xp, x, total, size, 0.0 if x.dtype != xp.bool else False)
            return xp.concat([x[..., :count, :, :], x[..., 1:, :, :]], axis=-2)

        offsets = np.arange(2 * size)[None, :] - np.arange(size)[:, None]
        band = from_host(xp, (offsets >= 0) & (offsets < span), dtype=xp.bool, device=device)
        band_keep = pairs(keep[..., 1:, None])[..., 0]
        return cls(
            queries=blocked(xp, q, count * size, size, 0.0),
            keys=pairs(keys[..., 1:, :]),
            values=pairs(values[..., 1:, :]),
            visible=xp.logical_and(band, band_keep[..., None, :]),
            length=length,
            key_length=keys.shape[-2],
            size=size,
        )

    def tokens(self, xp: Namespace, x: Array) -> Array:
        """Query blocks ``(..., N, B, .)`` back to queries ``(..., T, .)``."""
        x = xp.reshape(x, (*x.shape[:-3], x.shape[-3] * x.shape[-2], x.shape[-1]))
        return x[..., : self.length, :]

    def key_tokens(self, xp: Namespace, x: Array) -> Array:
        """Cotangents of paired key blocks ``(..., N, 2B, .)`` back to ``(..., T + span, .)``.

        The adjoint of :meth:`of`'s pairing: block ``b`` collects its own first half and
        the second half of block ``b - 1``.
        """
        size = self.size
        zero = xp.zeros_like(x[..., :1, :size, :])
        first = xp.concat([x[..., :size, :], zero], axis=-3)
        second = xp.concat([zero, x[..., size:, :]], axis=-3)
        flat = self.tokens_of(xp, first + second)
        need = self.key_length - 1
        if flat.shape[-2] >= need:
            flat = flat[..., :need, :]
        else:
            pad = xp.zeros(
                (*flat.shape[:-2], need - flat.shape[-2], flat.shape[-1]),
                dtype=flat.dtype,
                device=array_device(flat),
            )
            flat = xp.concat([flat, pad], axis=-2)
        return xp.concat([xp.zeros_like(flat[..., :1, :]), flat], axis=-2)

    @staticmethod
    def tokens_of(xp: Namespace, x: Array) -> Array:
        return xp.reshape(x, (*x.shape[:-3], x.shape[-3] * x.shape[-2], x.shape[-1]))


def blocked(xp: Namespace, x: Array, total: int, size: int, fill: float | bool) -> Array:
    """Rows ``(..., n, .)`` padded with ``fill`` or cut to ``total``, as blocks of ``size``."""
    pad = total - x.shape[-2]
    if pad > 0:
        device = array_device(x)
        tail = xp.full((*x.shape[:-2], pad, x.shape[-1]), fill, dtype=x.dtype, device=device)
        x = xp.concat([x, tail], axis=-2)
    elif pad < 0:
        x = x[..., :total, :]
    return xp.reshape(x, (*x.shape[:-2], total // size, size, x.shape[-1]))


def softmax_backward(
    xp: Namespace,
    q: Array,
    keys: Array,
    values: Array,
    logits: Array,
    visible: Array,
    scale: float,
    g: Array,
) -> tuple[Array, Array, Array]:
    """Adjoint of :func:`softmax_partial` on ``logits = scale q k^T`` (row max constant)."""
    logits = xp.where(visible, logits, constant(xp, -math.inf, logits))
    top = safe_shift(xp, xp.max(logits, axis=-1))
    weights = xp.exp(logits - top[..., None])
    g_num, g_den = g[..., :-1], g[..., -1:]
    d_weights = xp.matmul(g_num, xp.matrix_transpose(values)) + g_den
    d_logits = d_weights * weights * scale
    t = xp.matrix_transpose
    return (
        xp.matmul(d_logits, keys),
        xp.matmul(t(d_logits), q),
        xp.matmul(t(weights), g_num),
    )
