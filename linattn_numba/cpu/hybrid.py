"""The hybrid forward in one Numba pass: window, sinks and far keys per chunk.

``linattn.hybrid`` splits the keys of causal hybrid attention into three parts (each key
in exactly one): the window, the sink keys, and the far keys, which random features
estimate through the causal pass on keys lagged by the window ``w``.  On NumPy arrays
that took three kernels (the fused causal pass, the window kernel, the sinks' products)
and a merge, each reading and writing ``L``-long arrays.  Here one pass does it all:
per block of tokens it computes the queries' and the lagged keys' features
(:func:`linattn_numba.cpu.features.log_features`), runs each chunk of the far part
(:func:`linattn_numba.cpu.chunks.chunk_forward`, which leaves the rows ``[num | den]`` and
their log-scale), then, per query, the exact logits of its window and of the sinks it
sees (invisible keys *skipped*, as in :mod:`linattn_numba.cpu.window`; windows of
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

Bidirectional windows (:func:`bidirectional_forward`: exact keys ``|t - j| < w``, far
keys ``j <= t - w`` and ``j >= t + w``) run the same kernel twice over: a reverse scan
first (scan row ``s`` is query ``T - 1 - s``, its far key ``t + w``), which keeps every
query's rows ``[num | den]`` and log-scale (``L x (d_v + 1)`` per head, not ``L x m``),
then the forward scan, which merges them with its own far keys, the window and the sinks.
Two states, each built only by adding keys: the window is never subtracted.

Examples
--------
>>> import numpy as np
>>> from linattn_numba.cpu import hybrid
>>> q = np.zeros((1, 2, 2)); k = np.zeros((1, 2, 2)); keep = np.array([[False, True, True]])
>>> v = np.array([[[1.0], [3.0]]]); recent = np.zeros((1, 1, 2)), np.zeros((1, 1, 1))
>>> sinks = np.zeros((1, 0, 2)), np.zeros((1, 0, 1)), np.zeros((1, 2, 0), bool)
>>> out, kv, mu = hybrid.causal_forward(q, k, v, keep, *recent, 1, 1.0, *sinks,
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

from linattn_numba import _contract, _machinery
from linattn_numba.cpu.arrays import DTYPES, chunk_length, contiguous, readonly, without_empty_rows
from linattn_numba.cpu.calls import check_fitted, fitted_operands
from linattn_numba.cpu.chunks import chunk_forward, chunk_workspace
from linattn_numba.cpu.exact import exact_chunk, exact_rows, in_band, merge_into
from linattn_numba.cpu.features import FEATURE_BLOCK, block_log_features, feature_scratch
from linattn_numba.cpu.scalars import typed

__all__ = ["BLOCKED_SPAN", "bidirectional_forward", "causal_forward"]

_jit = _machinery.jit


#: Windows of at least this many keys run as two products per chunk (logits against the
#: chunk's band of keys, weights times its values); smaller ones as direct loops.
BLOCKED_SPAN = 16


@_jit()
def _far_keys(qb, kb, vb, keepb, rb, rvb, lag, reverse, s0, n, qx, kx, va, present):
    """Rows ``0 .. n - 1`` of a block of the far keys' scan, from scan row ``s0``.

    Scan row ``s`` is query ``t = s`` (forward) or ``t = T - 1 - s`` (reverse: its row
    is copied into ``qx``); its far key is ``j = t - lag`` (forward; ``j < 0`` are the
    cache's) or ``j = t + lag`` (reverse), copied into ``kx`` with ``va = [v_j | 1]``,
    where it takes part (:func:`in_band`); elsewhere both are zero and ``present`` is
    false (nothing such a key holds, NaN included, reaches the scan).
    """
    first, length, d, dv = rb.shape[0], kb.shape[0], kb.shape[1], vb.shape[1]
    for i in range(n):
        if reverse:
            t = length - 1 - s0 - i
            j = t + lag
            for r in range(d):
                qx[i, r] = qb[t, r]
        else:
            t = s0 + i
            j = t - lag
        present[i] = in_band(keepb, first, length, j)
        if not present[i]:
            for r in range(d):
                kx[i, r] = 0
            for r in range(dv + 1):
                va[i, r] = 0
            continue
        source, values, row = (rb, rvb, first + j) if j < 0 else (kb, vb, j)
        for r in range(d):
            kx[i, r] = source[row, r]
        for r in range(dv):
            va[i, r] = values[row, r]
        va[i, dv] = 1


@_machinery.Variants.over(shared=("projection", "consts", "window_consts"))
def _forward(
    q, k, v, keep, recent, recent_values, sinks, sink_values, visible, projection, consts,
    window_consts, hyperbolic, fitted_weights, fitted_biases, key_shift, kv, mu, later_kv,
    later_mu, chunk, lag, back, ahead, bidirectional, out,
):  # fmt: skip
    """All heads.  Causal: one forward scan of the far keys (lag ``lag``) and the exact
    window ``[t - back, t + ahead]``.  Bidirectional: first a reverse scan of the keys
    ``j >= t + lag`` (from the state ``later_kv``, ``later_mu``) into per-query rows, then
    the forward scan, which merges them.  Where ``fitted_weights`` has columns the far
    part's features are a fitted map's, row ``b``'s query and key parameters
    ``fitted_weights[b, 0 | 1]``, ``fitted_biases[b, 0 | 1]`` and its key head's ``log
    g``, ``key_shift[b]``; else ``projection``'s."""
    batch, length, d = q.shape
    dv = v.shape[2]
    m = kv.shape[1]
    dtype = q.dtype
    block_rows = chunk * max(1, FEATURE_BLOCK // chunk)
    span = back + ahead + 1
    first = recent.shape[1]
    for b in range(batch):
        work, square, vecs, state_out, product = chunk_workspace(chunk, m, dv + 1, dtype)
        fw, fb, shift = fitted_weights[b], fitted_biases[b], key_shift[b]
        proj = feature_scratch(block_rows, projection, hyperbolic, fw[0], q)
        lq = np.empty((block_rows, m), dtype)
        lk = np.empty((block_rows, m), dtype)
        qx = np.empty((block_rows if bidirectional else 0, d), dtype)
        kx = np.empty((block_rows, d), dtype)
        va = np.empty((block_rows, dv + 1), dtype)
        present = np.empty(block_rows, np.bool_)
        far = np.empty((chunk, dv + 1), dtype)
        far_scale = np.empty(chunk, dtype)
        later = np.zeros((length if bidirectional else 1, dv + 1), dtype)  # (causal: 0)
        later_scale = np.full(length if bidirectional else 1, -np.inf, dtype)
        scratch = np.empty(span + sinks.shape[1], dtype)
        width = chunk + span - 1 if span >= BLOCKED_SPAN else 0
        logits = np.empty(chunk * width, dtype)
        weights = np.empty(chunk * width, dtype)
        sink_weights = np.empty((chunk, sinks.shape[1]), dtype)
        band_values = np.empty((width, dv), dtype)
        tops = np.empty(chunk, dtype)
        exact = np.empty((chunk, dv), dtype)
        sums = np.empty(chunk, dtype)
        row = np.empty((1, dv + 1), dtype)
        qb, kb, vb, keepb, outb = q[b], k[b], v[b], keep[b], out[b]
        rb, rvb = recent[b], recent_values[b]
        sb, svb, visb = sinks[b], sink_values[b], visible[b]
        for reverse in (True, False):
            if reverse and not bidirectional:
                continue
            state, state_mu = (later_kv[b], later_mu[b]) if reverse else (kv[b], mu[b])
            for s0 in range(0, length, block_rows):
                s1 = min(s0 + block_rows, length)
                n = s1 - s0
                _far_keys(qb, kb, vb, keepb, rb, rvb, lag, reverse, s0, n, qx, kx, va, present)
                queries = qx[:n] if reverse else qb[s0:s1]
                block_log_features(queries, projection, consts, hyperbolic, fw[0], fb[0],
                                   typed(0, shift), proj[:n], lq[:n])  # fmt: skip
                block_log_features(kx[:n], projection, consts, hyperbolic, fw[1], fb[1], shift,
                                   proj[:n], lk[:n])  # fmt: skip
                for i in range(n):
                    if not present[i]:
                        for r in range(m):
                            lk[i, r] = -np.inf
                for t0 in range(0, n, chunk):
                    t1 = min(t0 + chunk, n)
                    c = t1 - t0
                    g0 = s0 + t0
                    if reverse:  # scan row s (query T - 1 - s) kept for the forward scan
                        chunk_forward(
                            lq[t0:t1], lk[t0:t1], va[t0:t1], state, state_mu,
                            later[g0 : g0 + c], work, square, vecs, state_out, product,
                            later_scale[g0 : g0 + c], window_consts[3],
                        )  # fmt: skip
                        continue
                    chunk_forward(
                        lq[t0:t1], lk[t0:t1], va[t0:t1], state, state_mu, far[:c], work,
                        square, vecs, state_out, product, far_scale[:c], window_consts[3],
                    )  # fmt: skip
                    if width and g0 >= back and g0 + c + ahead <= length:
                        exact_chunk(
                            qb, kb, vb, keepb, first, sb, svb, visb, g0, g0 + c, back, ahead,
                            window_consts, logits, weights, sink_weights, band_values, tops,
                            exact, sums,
                        )  # fmt: skip
                        for i in range(c):
                            s = length - 1 - g0 - i if bidirectional else 0
                            merge_into(
                                far, i, far_scale[i], later, s, later_scale[s], exact, i,
                                sums[i], tops[i], window_consts[0], outb, g0 + i,
                            )  # fmt: skip
                        continue
                    for i in range(c):
                        t = g0 + i
                        top = exact_rows(
                            qb, kb, vb, rb, rvb, keepb, sb, svb, visb, t, back, ahead,
                            window_consts, scratch, row[0],
                        )  # fmt: skip
                        s = length - 1 - t if bidirectional else 0
                        merge_into(
                            far, i, far_scale[i], later, s, later_scale[s], row, 0,
                            row[0, dv], top, window_consts[0], outb, t,
                        )  # fmt: skip


def _check(named: dict[str, Any]) -> np.dtype:
    for name, x in named.items():
        if not isinstance(x, np.ndarray):
            raise TypeError(
                f"{name} must be a numpy.ndarray; got {type(x).__module__}.{type(x).__name__}"
            )
    dtype = named["q"].dtype
    if dtype not in DTYPES:
        raise TypeError(f"q must have dtype float32 or float64; got {dtype}")
    for name, x in named.items():
        wanted = np.dtype(np.bool_) if name in ("keep", "visible") else dtype
        if x.dtype != wanted:
            raise TypeError(f"{name} must have dtype {wanted}; got {x.dtype}")
    return dtype


def _validated(
    named: dict[str, Any], expected: dict[str, tuple[int, ...]], scale: float, what: str
) -> None:
    for name, shape in expected.items():
        if tuple(named[name].shape) != shape:
            raise ValueError(
                f"{name} must have shape {shape} for {what}; got {tuple(named[name].shape)}"
            )
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be positive and finite; got {scale}")


def _shapes(q: np.ndarray, v: np.ndarray, sinks: np.ndarray) -> dict[str, tuple[int, ...]]:
    *batch, length, d = q.shape
    dv, count = v.shape[-1], sinks.shape[-2]
    return {
        "k": (*batch, length, d),
        "v": (*batch, length, dv),
        "sinks": (*batch, count, d),
        "sink_values": (*batch, count, dv),
        "visible": (*batch, length, count),
    }


def _check_projection(
    projection: np.ndarray, q: np.ndarray, m: int, hyperbolic: bool, kv_shape: Any
) -> None:
    rows = projection.shape[0] if projection.ndim == 2 else -1
    if projection.shape != (rows, q.shape[-1]) or m != rows * (2 if hyperbolic else 1):
        raise ValueError(
            f"projection {projection.shape} does not match q {q.shape} and kv {kv_shape}"
        )


def _launch(
    arrays: dict[str, np.ndarray], projection: np.ndarray, scale: float, hyperbolic: bool,
    kv: np.ndarray, mu: np.ndarray, later: tuple[np.ndarray, np.ndarray] | None, chunk_size: int,
    lag: int, back: int, ahead: int, fitted: dict[str, np.ndarray] | None = None,
) -> np.ndarray:  # fmt: skip
    """Run :func:`_forward` on arrays flattened to one batch axis; the outputs."""
    q, v = arrays["q"], arrays["v"]
    *batch, length, d = q.shape
    dv, dtype = v.shape[-1], q.dtype
    n = math.prod(batch)
    m = kv.shape[-2]

    def flat(name: str, tail: int) -> np.ndarray:
        x = arrays[name]
        return contiguous(x, (n, *x.shape[x.ndim - tail :]))

    consts = readonly(np.array([0.5 * scale, 0.5 * np.log(m)], dtype=dtype))
    # [3]: the far rows' denominator below which a row is rescued (``chunks.rescue_rows``):
    # what underflowed beneath it is below rounding against it.
    rescue = np.sqrt(np.finfo(dtype).tiny)
    window_consts = readonly(np.array([0.0, -np.inf, scale, rescue], dtype=dtype))
    scaled_projection = readonly(np.ascontiguousarray(np.sqrt(scale) * projection, dtype=dtype))
    out = np.empty((n, length, dv), dtype)
    chunk = chunk_length(_contract.check_chunk_size(chunk_size), length)
    span = back + ahead + 1
    work = m * (dv + 1) * (2 if later is not None else 1) + span * (d + dv)
    if later is None:
        later = np.empty((n, 0, dv + 1), dtype), np.empty((n, 0), dtype)
    parameters = fitted_operands(fitted, tuple(batch), dtype)
    with _machinery.single_threaded_blas():
        _forward.run(
            _machinery.choose_variant(n, length, work),
            flat("q", 2), flat("k", 2), flat("v", 2), flat("keep", 1), flat("recent", 2),
            flat("recent_values", 2), flat("sinks", 2), flat("sink_values", 2),
            flat("visible", 2), scaled_projection, consts, window_consts, bool(hyperbolic),
            *parameters,
            kv, mu, *later, chunk, lag, back, ahead, later[0].shape[1] > 0, out,
        )  # fmt: skip
    return out.reshape((*batch, length, dv))


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
    fitted: dict[str, Any] | None = None,
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
    fitted : dict of numpy.ndarray, optional
        A fitted map's parameters (:mod:`linattn.fitted`), broadcast to the batch axes:
        ``query_weight`` and ``key_weight`` ``(..., d, m/2)``, ``query_bias`` and
        ``key_bias`` ``(..., m/2)``, ``key_shift`` ``(...)`` (the key head's ``log g``).
        The far part's features are then ``[u, -u] - logsumexp([u, -u])`` (plus
        ``key_shift`` for keys), ``u = x W + b``, computed per block as random ones
        are; ``projection`` and ``hyperbolic`` are not used.

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
    *batch, length, d = q.shape
    dv = v.shape[-1]
    m = kv.shape[-2]
    if fitted is None:
        _check_projection(projection, q, m, hyperbolic, kv.shape)
    else:
        check_fitted(fitted, tuple(batch), d, m, dtype)
    expected = {
        **_shapes(q, v, sinks),
        "keep": (*batch, span + length),
        "recent": (*batch, span, d),
        "recent_values": (*batch, span, dv),
        "kv": (*batch, m, dv + 1),
        "log_shift": (*batch, m),
    }
    _validated(named, expected, scale, f"q {q.shape}, span {span} and values (..., {dv})")
    n = math.prod(batch)
    mu = np.array(log_shift, dtype=dtype).reshape((n, m))
    state = without_empty_rows(np.array(kv, dtype=dtype).reshape((n, m, dv + 1)), mu)
    out = _launch(
        named, projection, scale, hyperbolic, state, mu, None, chunk_size, span,
        span - 1, 0, fitted,
    )  # fmt: skip
    return out, state.reshape((*batch, m, dv + 1)), mu.reshape((*batch, m))


def bidirectional_forward(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    keep: np.ndarray,
    window: int,
    scale: float,
    sinks: np.ndarray,
    sink_values: np.ndarray,
    visible: np.ndarray,
    projection: np.ndarray,
    *,
    hyperbolic: bool,
    chunk_size: int,
    fitted: dict[str, Any] | None = None,
) -> np.ndarray:
    """Normalised bidirectional hybrid attention: exact window, sinks, far keys.

    Query ``t`` sees the keys ``|t - j| < window`` exactly (where ``keep``), the sinks it
    sees exactly, and the far keys ``j <= t - window`` and ``j >= t + window`` (where
    ``keep``) by random features: a reverse scan of the latter into per-query rows, then
    the forward scan, which merges all four partials.  Never one global state minus the
    window (that subtraction cancels catastrophically).

    Parameters
    ----------
    q, k, v : numpy.ndarray
        Queries and keys ``(..., T, d)`` and values ``(..., T, d_v)``, float32 or float64.
    keep : numpy.ndarray
        bool ``(..., T)``: which keys take part in the window and the far part.
    window : int
        ``w >= 1``.
    scale, sinks, sink_values, visible, projection, hyperbolic, chunk_size, fitted
        As in :func:`causal_forward`.

    Returns
    -------
    numpy.ndarray
        Outputs ``(..., T, d_v)``.

    Examples
    --------
    >>> import numpy as np
    >>> q = k = np.zeros((1, 3, 1)); v = np.array([[[1.0], [2.0], [6.0]]])
    >>> sinks = np.zeros((1, 0, 1)), np.zeros((1, 0, 1)), np.zeros((1, 3, 0), bool)
    >>> bidirectional_forward(q, k, v, np.ones((1, 3), bool), 1, 1.0, *sinks, np.eye(1),
    ...     hyperbolic=False, chunk_size=64)[0, :, 0]  # equal logits: plain averages
    array([3., 3., 3.])
    """
    window = int(window)
    named = {
        "q": q, "k": k, "v": v, "keep": keep, "sinks": sinks, "sink_values": sink_values,
        "visible": visible,
    }  # fmt: skip
    dtype = _check(named)
    if window < 1:
        raise ValueError(f"window must be a positive integer; got {window}")
    *batch, length, d = q.shape
    dv = v.shape[-1]
    if fitted is None:
        m = projection.shape[0] * (2 if hyperbolic else 1)
        _check_projection(projection, q, m, hyperbolic, (*batch, m, dv + 1))
    else:
        m = check_fitted(fitted, tuple(batch), d, None, dtype)
    expected = {**_shapes(q, v, sinks), "keep": (*batch, length)}
    _validated(named, expected, scale, f"q {q.shape} and values (..., {dv})")
    n = math.prod(batch)
    empty = np.zeros((n, m, dv + 1), dtype), np.full((n, m), -np.inf, dtype)
    later = np.zeros((n, m, dv + 1), dtype), np.full((n, m), -np.inf, dtype)
    arrays = {**named, "recent": np.empty((*batch, 0, d), dtype),
              "recent_values": np.empty((*batch, 0, dv), dtype)}  # fmt: skip
    return _launch(
        arrays, projection, scale, hyperbolic, *empty, later, chunk_size, window, window - 1,
        window - 1, fitted,
    )  # fmt: skip
