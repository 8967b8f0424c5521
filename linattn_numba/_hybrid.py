"""The causal hybrid forward in one Numba pass: window, sinks and far keys per chunk.

``linattn.hybrid`` splits the keys of causal hybrid attention into three parts (each key
in exactly one): the window, the sink keys, and the far keys, which random features
estimate through the causal pass on keys lagged by the window ``w``.  On NumPy arrays
that took three kernels (the fused causal pass, the window kernel, the sinks' products)
and a merge, each reading and writing ``L``-long arrays.  Here one pass does it all:
per block of tokens it computes the queries' and the lagged keys' features
(:func:`linattn_numba.cpu._log_features`), runs each chunk of the far part
(:func:`linattn_numba.cpu._chunk_forward`, which leaves the rows ``[num | den]`` and
their log-scale), then, per query, the exact logits of its window and of the sinks it
sees (invisible keys *skipped*, as in :mod:`linattn_numba._window`; windows of
:data:`BLOCKED_SPAN` keys or more as two products per chunk, the chunk's logits against its
band of keys and the selected weights times the band's values, invisible keys' values
zeroed first), and merges the two
partials as online softmax does before normalising.  No ``L x m`` array and no
``L``-long intermediate exists; the random-feature state after the far keys is the
result's ``(kv, log_shift)``.

The contract is that of ``linattn.hybrid``'s causal parts.  The band's keys ``E`` are the
window cache ``recent`` (``(..., w, d)``, the ``w`` keys before the call) followed by the
call's keys ``k`` (``(..., T, d)``; values likewise), and ``keep`` (``(..., w + T)``)
says which of them take part (it excludes the sinks): query ``i`` sees ``E[i + 1 .. i +
w]`` exactly and ``E[0 .. i]`` (on top of the state) by random features.  ``E`` is never
built: row ``e`` is read from the cache or the call's keys.  The sinks are ``(..., S,
d)`` keys with ``visible`` ``(..., T, S)``.  Forward only: gradients go through the
parts' adjoints.

Examples
--------
>>> import numpy as np
>>> from linattn_numba import _hybrid
>>> q = np.zeros((1, 2, 2)); k = np.zeros((1, 2, 2)); keep = np.array([[False, True, True]])
>>> v = np.array([[[1.0], [3.0]]]); recent = np.zeros((1, 1, 2)), np.zeros((1, 1, 1))
>>> sinks = np.zeros((1, 0, 2)), np.zeros((1, 0, 1)), np.zeros((1, 2, 0), bool)
>>> out, kv, mu = _hybrid.causal_forward(q, k, v, keep, *recent, 1, 1.0, *sinks,
...     np.eye(2), hyperbolic=False, kv=np.zeros((1, 2, 2)), log_shift=np.full((1, 2), -np.inf),
...     chunk_size=64)
>>> out[0]  # query 1 averages its window key (3) and its far key (1), equal weights
array([[1.],
       [2.]])
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import prange

from linattn_numba import _contract, _machinery, cpu
from linattn_numba._window import _shift

__all__ = ["causal_forward"]

_jit = _machinery.jit

#: Windows of at least this many keys run as two products per chunk (logits against the
#: chunk's band of keys, weights times its values); smaller ones as direct loops.
BLOCKED_SPAN = 16


@_jit(fastmath=frozenset({"contract", "reassoc"}))
def _dot_rows(a, i, b, j, zero):
    """``a[i] . b[j]`` summed in any order (rows by index: no views in the hot loop)."""
    acc = zero
    for r in range(a.shape[1]):
        acc += a[i, r] * b[j, r]
    return acc


@_jit()
def _exact_rows(
    q, k, v, recent, recent_values, keep, sinks, sink_values, visible, i, span, consts, scratch,
    row,
):  # fmt: skip
    """Query ``i``'s exact partial: ``row = [sum p v | sum p]`` over its window ``E[i + 1
    .. i + span]`` (where ``keep``) and the sinks it sees, ``p = exp(logit - c)``; returns
    ``c``, the largest visible logit (``-inf`` where it sees none, NaN if one is NaN).
    Invisible keys are skipped: nothing they hold reaches the row."""
    dv = v.shape[1]
    zero, scale = consts[0], consts[2]
    count = sinks.shape[0]
    top = consts[1]
    for o in range(span):
        j = i + 1 + o
        logit = consts[1]
        if keep[j]:
            if j < span:
                logit = _dot_rows(q, i, recent, j, zero) * scale
            else:
                logit = _dot_rows(q, i, k, j - span, zero) * scale
            if logit > top or logit != logit:  # (once NaN, nothing is greater)
                top = logit
        scratch[o] = logit
    for j in range(count):
        logit = consts[1]
        if visible[i, j]:
            logit = _dot_rows(q, i, sinks, j, zero) * scale
            if logit > top or logit != logit:
                top = logit
        scratch[span + j] = logit
    shift = _shift(top, zero)
    for o in range(span + count):  # (one loop of exponentials: it vectorises; exp(-inf) = 0)
        scratch[o] = cpu.fast_exp(scratch[o] - shift)
    for e in range(dv + 1):
        row[e] = zero
    for o in range(span):
        j = i + 1 + o
        if keep[j]:
            _add_row(
                row, scratch[o], recent_values if j < span else v, j - span if j >= span else j
            )
    for j in range(count):
        if visible[i, j]:
            _add_row(row, scratch[span + j], sink_values, j)
    return top


@_jit()
def _add_row(row, p, values, j):
    """``row += p [values[j] | 1]``."""
    dv = values.shape[1]
    for e in range(dv):
        row[e] += p * values[j, e]
    row[dv] += p


@_jit()
def _exact_chunk(
    q, k, v, keep, sinks, sink_values, visible, t0, t1, span, consts, logit_buffer,
    weight_buffer, sink_weights, band_values, tops, rows,
):  # fmt: skip
    """:func:`_exact_rows` for queries ``t0 .. t1 - 1`` whose windows lie in the call's keys
    (``t0 >= span - 1``), as two products: the chunk's logits against its band of keys
    ``k[t0 + 1 - span .. t1 - 1]``, and the selected weights times the band's values (the
    invisible keys' values zeroed first, so that nothing they hold reaches a row)."""
    c, dv, count = t1 - t0, v.shape[1], sinks.shape[0]
    zero, scale = consts[0], consts[2]
    first = t0 + 1 - span  # k row of band column 0
    width = c + span - 1
    logits = logit_buffer[: c * width].reshape((c, width))
    weights = weight_buffer[: c * width].reshape((c, width))
    np.dot(q[t0:t1], k[first : first + width].T, logits)
    for j in range(width):
        if keep[span + first + j]:
            for e in range(dv):
                band_values[j, e] = v[first + j, e]
            band_values[j, dv] = 1
        else:
            for e in range(dv + 1):
                band_values[j, e] = zero
    for i in range(c):
        top = consts[1]
        for o in range(span):  # query t0 + i, key E[t0 + i + 1 + o] = band column i + o
            j = i + o
            logit = consts[1]
            if keep[span + first + j]:
                logit = logits[i, j] * scale
                if logit > top or logit != logit:
                    top = logit
            logits[i, j] = logit
        for j in range(count):
            logit = consts[1]
            if visible[t0 + i, j]:
                logit = _dot_rows(q, t0 + i, sinks, j, zero) * scale
                if logit > top or logit != logit:
                    top = logit
            sink_weights[i, j] = logit
        tops[i] = top
        shift = _shift(top, zero)
        for j in range(width):
            weights[i, j] = zero
        for o in range(span):
            weights[i, i + o] = cpu.fast_exp(logits[i, i + o] - shift)
        for j in range(count):
            sink_weights[i, j] = cpu.fast_exp(sink_weights[i, j] - shift)
    np.dot(weights, band_values[:width], rows[:c])
    for i in range(c):
        for j in range(count):
            if visible[t0 + i, j]:
                _add_row(rows[i], sink_weights[i, j], sink_values, j)


@_jit()
def _merge_into(far, i, far_scale, row, top, zero, out, t):
    """``out[t] = (a far[i] + b row)[:d_v] / (a far[i] + b row)[d_v]``, ``a, b`` the two
    partials' scales against their maximum (online softmax); ``0`` where nothing is seen."""
    dv = out.shape[1]
    if far[i, dv] == 0:
        far_scale = -np.inf  # a row that saw no far key holds nothing
    both = far_scale if (far_scale > top or far_scale != far_scale) else top
    both = _shift(both, zero)
    a = cpu.fast_exp(far_scale - both)
    b = cpu.fast_exp(top - both)
    den = a * far[i, dv] + b * row[dv]
    if den == 0:
        den = zero + 1
    a, b = a / den, b / den
    for e in range(dv):
        out[t, e] = a * far[i, e] + b * row[e]


@_machinery.Variants
def _forward(
    q, k, v, keep, recent, recent_values, sinks, sink_values, visible, projection, consts,
    window_consts, hyperbolic, kv, mu, chunk, span, out,
):  # fmt: skip
    batch, length, d = q.shape
    dv = v.shape[2]
    m = kv.shape[1]
    rows = projection.shape[0]
    dtype = q.dtype
    block_rows = chunk * max(1, cpu.FEATURE_BLOCK // chunk)
    for b in prange(batch):
        work, square, vecs, state_out, product = cpu._workspace(chunk, m, dv + 1, dtype)
        proj = np.empty((block_rows if hyperbolic else 0, rows), dtype)
        lq = np.empty((block_rows, m), dtype)
        lk = np.empty((block_rows, m), dtype)
        kx = np.empty((block_rows, d), dtype)
        va = np.empty((block_rows, dv + 1), dtype)
        far = np.empty((chunk, dv + 1), dtype)
        far_scale = np.empty(chunk, dtype)
        scratch = np.empty(span + sinks.shape[1], dtype)
        row = np.empty(dv + 1, dtype)
        blocked = span >= BLOCKED_SPAN
        width = chunk + span - 1 if blocked else 0
        logits = np.empty(chunk * width, dtype)
        weights = np.empty(chunk * width, dtype)
        sink_weights = np.empty((chunk, sinks.shape[1]), dtype)
        band_values = np.empty((width, dv + 1), dtype)
        tops = np.empty(chunk, dtype)
        exact = np.empty((chunk, dv + 1), dtype)
        qb, kb, vb, keepb, outb = q[b], k[b], v[b], keep[b], out[b]
        rb, rvb = recent[b], recent_values[b]
        sb, svb, visb = sinks[b], sink_values[b], visible[b]
        for s0 in range(0, length, block_rows):
            s1 = min(s0 + block_rows, length)
            n = s1 - s0
            # The far key of query row t is E[t] (lagged by the window): gathered per block.
            for i in range(n):
                e = s0 + i
                source, j = (rb, e) if e < span else (kb, e - span)
                values = rvb if e < span else vb
                for r in range(d):
                    kx[i, r] = source[j, r]
                if keepb[e]:
                    for r in range(dv):
                        va[i, r] = values[j, r]
                    va[i, dv] = 1
                else:  # not a far key: no values (a NaN must not leak), no features below
                    for r in range(dv + 1):
                        va[i, r] = 0
            cpu._log_features(qb[s0:s1], projection, consts, hyperbolic, proj[:n], lq[:n])
            cpu._log_features(kx[:n], projection, consts, hyperbolic, proj[:n], lk[:n])
            for i in range(n):
                if not keepb[s0 + i]:
                    for r in range(m):
                        lk[i, r] = -np.inf
            for t0 in range(0, n, chunk):
                t1 = min(t0 + chunk, n)
                c = t1 - t0
                cpu._chunk_forward(
                    lq[t0:t1], lk[t0:t1], va[t0:t1], kv[b], mu[b], far[:c], work, square,
                    vecs, state_out, product, far_scale[:c],
                )  # fmt: skip
                g0 = s0 + t0
                if span >= BLOCKED_SPAN and g0 >= span - 1:
                    _exact_chunk(
                        qb, kb, vb, keepb, sb, svb, visb, g0, g0 + c, span, window_consts,
                        logits, weights, sink_weights, band_values, tops, exact,
                    )  # fmt: skip
                    for i in range(c):
                        _merge_into(
                            far, i, far_scale[i], exact[i], tops[i], window_consts[0], outb,
                            g0 + i,
                        )  # fmt: skip
                    continue
                for i in range(c):
                    t = g0 + i
                    top = _exact_rows(
                        qb, kb, vb, rb, rvb, keepb, sb, svb, visb, t, span, window_consts,
                        scratch, row,
                    )  # fmt: skip
                    _merge_into(far, i, far_scale[i], row, top, window_consts[0], outb, t)


def _check(named: dict[str, Any]) -> np.dtype:
    for name, x in named.items():
        if not isinstance(x, np.ndarray):
            raise TypeError(
                f"{name} must be a numpy.ndarray; got {type(x).__module__}.{type(x).__name__}"
            )
    dtype = named["q"].dtype
    if dtype not in cpu.DTYPES:
        raise TypeError(f"q must have dtype float32 or float64; got {dtype}")
    for name, x in named.items():
        wanted = np.dtype(np.bool_) if name in ("keep", "visible") else dtype
        if x.dtype != wanted:
            raise TypeError(f"{name} must have dtype {wanted}; got {x.dtype}")
    return dtype


def causal_forward(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    keep: np.ndarray,
    recent: np.ndarray,
    recent_values: np.ndarray,
    span: int,
    scale: float,
    sinks: np.ndarray,
    sink_values: np.ndarray,
    visible: np.ndarray,
    projection: np.ndarray,
    *,
    hyperbolic: bool,
    kv: np.ndarray,
    log_shift: np.ndarray,
    chunk_size: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Normalised causal hybrid attention and the far keys' state after the call.

    Parameters
    ----------
    q : numpy.ndarray
        Queries ``(..., T, d)``, float32 or float64 (every float array has its dtype).
    k, v : numpy.ndarray
        The call's keys ``(..., T, d)`` and values ``(..., T, d_v)``.
    keep : numpy.ndarray
        bool ``(..., span + T)``: which of the band's keys ``E = [recent | k]`` take part;
        query ``i``'s window is ``E[i + 1 .. i + span]``, its far keys ``E[0 .. i]``.
    recent, recent_values : numpy.ndarray
        The window cache: the ``span`` keys ``(..., span, d)`` and values before the call.
    span : int
        The window ``w`` (0: no window; the far keys are then the call's own).
    scale : float
        Logits are ``scale * q . k``; the feature map's scale.
    sinks, sink_values, visible : numpy.ndarray
        ``(..., S, d)``, ``(..., S, d_v)`` and bool ``(..., T, S)``: the sink keys and
        which query sees which.
    projection : numpy.ndarray
        The feature map's ``(rows, d)`` projection; ``hyperbolic`` for that kind.
    kv, log_shift : numpy.ndarray
        The far keys' state before the call, ``(..., m, d_v + 1)`` and ``(..., m)``.
    chunk_size : int
        Tokens per chunk of the far part's causal pass.

    Returns
    -------
    (outputs, kv, log_shift)
        Outputs ``(..., T, d_v)`` and the state after the far keys ``E[:T]``.

    Examples
    --------
    >>> import numpy as np
    >>> q = k = np.zeros((1, 1, 1)); v = np.full((1, 1, 1), 5.0)
    >>> recent = np.zeros((1, 0, 1)), np.zeros((1, 0, 1))
    >>> sinks = np.zeros((1, 1, 1)), np.full((1, 1, 1), 7.0), np.ones((1, 1, 1), bool)
    >>> out, _, _ = causal_forward(q, k, v, np.ones((1, 1), bool), *recent, 0, 1.0, *sinks,
    ...     np.eye(1), hyperbolic=False, kv=np.zeros((1, 1, 2)),
    ...     log_shift=np.full((1, 1), -np.inf), chunk_size=64)
    >>> out  # the far key (5, weight 1) and the sink (7, weight exp(0) = 1)
    array([[[6.]]])
    """
    span = int(span)
    named = {
        "q": q, "k": k, "v": v, "keep": keep, "recent": recent, "recent_values": recent_values,
        "sinks": sinks, "sink_values": sink_values, "visible": visible, "kv": kv,
        "log_shift": log_shift,
    }  # fmt: skip
    dtype = _check(named)
    if span < 0:
        raise ValueError(f"span must be a non-negative integer; got {span}")
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be positive and finite; got {scale}")
    *batch, length, d = q.shape
    dv, count = v.shape[-1], sinks.shape[-2]
    m = kv.shape[-2]
    rows = projection.shape[0]
    if projection.shape != (rows, d) or m != rows * (2 if hyperbolic else 1):
        raise ValueError(
            f"projection {projection.shape} does not match q {q.shape} and kv {kv.shape}"
        )
    expected = {
        "k": (*batch, length, d),
        "v": (*batch, length, dv),
        "keep": (*batch, span + length),
        "recent": (*batch, span, d),
        "recent_values": (*batch, span, dv),
        "sinks": (*batch, count, d),
        "sink_values": (*batch, count, dv),
        "visible": (*batch, length, count),
        "kv": (*batch, m, dv + 1),
        "log_shift": (*batch, m),
    }
    for name, shape in expected.items():
        if tuple(named[name].shape) != shape:
            raise ValueError(
                f"{name} must have shape {shape} for q {q.shape}, span {span} and "
                f"values (..., {dv}); got {tuple(named[name].shape)}"
            )
    n = math.prod(batch)

    def flat(x: np.ndarray, tail: int) -> np.ndarray:
        return np.ascontiguousarray(x).reshape((n, *x.shape[x.ndim - tail :]))

    mu = np.array(log_shift, dtype=dtype).reshape((n, m))
    state = cpu._without_empty_rows(np.array(kv, dtype=dtype).reshape((n, m, dv + 1)), mu)
    consts = np.array([0.5 * scale, 0.5 * np.log(m)], dtype=dtype)
    window_consts = np.array([0.0, -np.inf, scale], dtype=dtype)
    scaled_projection = np.ascontiguousarray(np.sqrt(scale) * projection, dtype=dtype)
    out = np.empty((n, length, dv), dtype)
    chunk = cpu._chunk(_contract.check_chunk_size(chunk_size), length)
    work = m * (dv + 1) + span * (d + dv)
    with cpu._single_threaded_blas():
        _forward.run(
            _machinery.choose_variant(n, length, work),
            flat(q, 2), flat(k, 2), flat(v, 2), flat(keep, 1), flat(recent, 2),
            flat(recent_values, 2), flat(sinks, 2),
            flat(sink_values, 2), flat(visible, 2), scaled_projection, consts,
            window_consts, bool(hyperbolic), state, mu, chunk, span, out,
        )  # fmt: skip
    return (
        out.reshape((*batch, length, dv)),
        state.reshape((*batch, m, dv + 1)),
        mu.reshape((*batch, m)),
    )
