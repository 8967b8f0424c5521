"""Exact-attention primitives: the window's and sinks' logits, their shifts and merges.

The exact rows of a query (its window and sinks), each shifted by its own maximum, and
their merge with the far part's rows (``docs/algorithm.md``, section "Hybrid
attention"): used by the hybrid and bidirectional passes.
"""

from __future__ import annotations

import numpy as np

from linattn_numba import _machinery
from linattn_numba.cpu.scalars import fast_exp, finite_shift, larger, root_tiny, typed

__all__ = [
    "add_row",
    "dot_rows",
    "exact_chunk",
    "exact_rows",
    "exp_segment",
    "in_band",
    "merge_into",
    "segment_max",
]

_jit = _machinery.jit


@_jit(fastmath=frozenset({"contract", "reassoc"}))
def dot_rows(a, i, b, j, zero):
    """``a[i] . b[j]`` summed in any order (rows by index: no views in the hot loop)."""
    acc = zero
    for r in range(a.shape[1]):
        acc += a[i, r] * b[j, r]
    return acc


@_jit()
def in_band(keep, first, length, j):
    """Whether key ``j`` (call coordinates; ``j < 0`` is cache row ``first + j``) takes
    part: it exists and ``keep[first + j]``."""
    return j >= -first and j < length and keep[first + j]


@_jit()
def exact_rows(
    q, k, v, recent, recent_values, keep, sinks, sink_values, visible, i, back, ahead, consts,
    scratch, row,
):  # fmt: skip
    """Query ``i``'s exact partial: ``row = [sum p v | sum p]`` over its window, the keys
    ``j = i - back .. i + ahead`` that take part (:func:`in_band`; ``j < 0`` are the
    cache's), and the sinks it sees, ``p = exp(logit - c)``; returns ``c``, the largest
    visible logit (``-inf`` where it sees none, NaN if one is NaN).  Invisible keys are
    skipped: nothing they hold reaches the row."""
    dv = v.shape[1]
    first, length = recent.shape[0], k.shape[0]
    zero, scale = consts[0], consts[2]
    count = sinks.shape[0]
    span = back + ahead + 1
    top = consts[1]
    for o in range(span):
        j = i - back + o
        logit = consts[1]
        if in_band(keep, first, length, j):
            if j < 0:
                logit = dot_rows(q, i, recent, first + j, zero) * scale
            else:
                logit = dot_rows(q, i, k, j, zero) * scale
            if logit > top or logit != logit:  # (once NaN, nothing is greater)
                top = logit
        scratch[o] = logit
    for j in range(count):
        logit = consts[1]
        if visible[i, j]:
            logit = dot_rows(q, i, sinks, j, zero) * scale
            if logit > top or logit != logit:
                top = logit
        scratch[span + j] = logit
    shift = finite_shift(top, zero)
    for o in range(span + count):  # (one loop of exponentials: it vectorises; exp(-inf) = 0)
        scratch[o] = fast_exp(scratch[o] - shift)
    for e in range(dv + 1):
        row[e] = zero
    for o in range(span):
        j = i - back + o
        if in_band(keep, first, length, j):
            if j < 0:
                add_row(row, scratch[o], recent_values, first + j)
            else:
                add_row(row, scratch[o], v, j)
    for j in range(count):
        if visible[i, j]:
            add_row(row, scratch[span + j], sink_values, j)
    return top


@_jit()
def add_row(row, p, values, j):
    """``row += p [values[j] | 1]``."""
    dv = values.shape[1]
    for e in range(dv):
        row[e] += p * values[j, e]
    row[dv] += p


@_jit()
def segment_max(x, i, j0, j1, low):
    """``max x[i, j0:j1]`` (``-inf`` if empty; NaN passed over), in four running maxima."""
    a0 = a1 = a2 = a3 = low
    j = j0
    while j + 4 <= j1:
        a0 = larger(x[i, j], a0)
        a1 = larger(x[i, j + 1], a1)
        a2 = larger(x[i, j + 2], a2)
        a3 = larger(x[i, j + 3], a3)
        j += 4
    while j < j1:
        a0 = larger(x[i, j], a0)
        j += 1
    return larger(larger(a0, a1), larger(a2, a3))


@_jit(fastmath=frozenset({"contract", "reassoc"}))
def exp_segment(logits, scale, shift, zero, weights):
    """``weights = exp(scale logits - shift)`` for two rows of equal length (slices of
    the blocks: 2-D indexing from a varying start ran half as fast, measured); returns
    their sum (in any order)."""
    total = zero
    for j in range(logits.shape[0]):
        p = fast_exp(logits[j] * scale - shift)
        weights[j] = p
        total += p
    return total


@_jit()
def exact_chunk(
    q, k, v, keep, first, sinks, sink_values, visible, t0, t1, back, ahead, consts,
    logit_buffer, weight_buffer, sink_weights, band_values, tops, rows, sums,
):  # fmt: skip
    """:func:`exact_rows` for queries ``t0 .. t1 - 1`` whose windows lie in the call's keys
    (``t0 >= back``, ``t1 + ahead <= T``), as two products: the chunk's logits against its
    band of keys ``k[t0 - back .. t1 - 1 + ahead]``, and the weights (zero outside each
    query's window and for invisible keys) times the band's values, taken in place where
    every key of the band takes part, else copied with invisible keys' values zeroed (so
    that nothing they hold reaches a row).

    A NaN logit is passed over by the row's maximum (it reaches the row through its
    weight all the same)."""
    c, dv, count = t1 - t0, v.shape[1], sinks.shape[0]
    zero, scale = consts[0], consts[2]
    lo = t0 - back  # k row of band column 0
    span = back + ahead + 1
    width = c + span - 1
    logits = logit_buffer[: c * width].reshape((c, width))
    weights = weight_buffer[: c * width].reshape((c, width))
    np.dot(q[t0:t1], k[lo : lo + width].T, logits)
    every = True
    for j in range(width):
        every = every and keep[first + lo + j]
    values = v[lo : lo + width]
    if not every:
        values = band_values[:width]
        for j in range(width):
            if keep[first + lo + j]:
                for e in range(dv):
                    values[j, e] = v[lo + j, e]
            else:
                for e in range(dv):
                    values[j, e] = zero
    for i in range(c):  # query t0 + i sees band columns i .. i + span - 1
        if not every:
            for j in range(i, i + span):
                if not keep[first + lo + j]:
                    logits[i, j] = consts[1]
        top = segment_max(logits, i, i, i + span, consts[1]) * scale
        for j in range(count):
            logit = consts[1]
            if visible[t0 + i, j]:
                logit = dot_rows(q, t0 + i, sinks, j, zero) * scale
                top = larger(logit, top)
            sink_weights[i, j] = logit
        tops[i] = top
        shift = finite_shift(top, zero)
        for j in range(i):
            weights[i, j] = zero
        sums[i] = exp_segment(
            logits[i, i : i + span], scale, shift, zero, weights[i, i : i + span]
        )
        for j in range(i + span, width):
            weights[i, j] = zero
        for j in range(count):
            sink_weights[i, j] = fast_exp(sink_weights[i, j] - shift)
    np.dot(weights, values, rows[:c])
    for i in range(c):
        for j in range(count):
            if visible[t0 + i, j]:
                p = sink_weights[i, j]
                for e in range(dv):
                    rows[i, e] += p * sink_values[j, e]
                sums[i] += p


@_jit()
def _log_mass(scale, den):
    """``scale + log(den)``: the log of a partial's true denominator (``-inf`` where it
    holds nothing; NaN stays NaN)."""
    if den == 0:
        return typed(-np.inf, scale) if scale == scale else scale
    return scale + np.log(den)


@_jit()
def merge_into(far, i, far_scale, later, s, later_scale, numerators, r, den, top, zero, out, t):
    """``out[t] = P[:d_v] / P[d_v]`` for ``P = a far[i] + b later[s] + c [numerators[r] |
    den]``: the forward far keys, the reverse far keys (bidirectional; a zero row
    otherwise) and the exact keys, each partial's true row being ``exp(scale) [num |
    den]``, ``a, b, c`` their scales against the largest (online softmax); ``0`` where
    nothing is seen.

    Where the merged denominator falls below :func:`~linattn_numba.cpu.scalars.root_tiny`
    (a partial whose scale is large but whose denominator is tiny, a sharply peaked
    fitted map's far keys, pushed the others below the float range: off by 0.4 at
    weights x1e4 in float64), :func:`_merge_by_mass` merges the row again.
    """
    dv = out.shape[1]
    far_den, later_den = far[i, dv], later[s, dv]
    if far_den == 0:
        far_scale = typed(-np.inf, zero)  # a row that saw no far key holds nothing
    if later_den == 0:
        later_scale = typed(-np.inf, zero)
    both = top
    if later_scale > both or later_scale != later_scale:  # (a NaN scale stays)
        both = later_scale
    if far_scale > both or far_scale != far_scale:
        both = far_scale
    both = finite_shift(both, zero)
    a = fast_exp(far_scale - both)
    b = fast_exp(later_scale - both)
    c = fast_exp(top - both)
    total = a * far_den + b * later_den + c * den
    if total < root_tiny(zero):  # (NaN takes the first form)
        _merge_by_mass(far, i, far_scale, later, s, later_scale, numerators, r, den, top,
                       zero, out, t)  # fmt: skip
        return
    a, b, c = a / total, b / total, c / total
    for e in range(dv):
        out[t, e] = a * far[i, e] + b * later[s, e] + c * numerators[r, e]


@_jit()
def _merge_by_mass(far, i, far_scale, later, s, later_scale, numerators, r, den, top, zero,
                   out, t):  # fmt: skip
    """:func:`merge_into` shifted by the largest of the partials' log-denominators
    ``scale + log(den)``, not of their scales: each partial enters as its own normalised
    row times its share of the mass (``0`` where nothing is seen)."""
    dv = out.shape[1]
    far_den, later_den = far[i, dv], later[s, dv]
    masses = (
        _log_mass(far_scale, far_den), _log_mass(later_scale, later_den), _log_mass(top, den)
    )  # fmt: skip
    both = masses[0]
    if masses[1] > both or masses[1] != masses[1]:  # (a NaN stays)
        both = masses[1]
    if both == both and (masses[2] > both or masses[2] != masses[2]):
        both = masses[2]
    both = finite_shift(both, zero)
    one = typed(1, zero)
    a = fast_exp(masses[0] - both)
    b = fast_exp(masses[1] - both)
    c = fast_exp(masses[2] - both)
    total = a + b + c
    if total == 0:
        total = one
    a = a / (total * (far_den if far_den != 0 else one))
    b = b / (total * (later_den if later_den != 0 else one))
    c = c / (total * (den if den != 0 else one))
    for e in range(dv):
        out[t, e] = a * far[i, e] + b * later[s, e] + c * numerators[r, e]
