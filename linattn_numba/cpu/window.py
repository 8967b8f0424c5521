"""Numba CPU kernels for the window (banded) part of hybrid attention, forward and backward.

The contract is exactly that of ``linattn.hybrid.banded_partial``: query ``i`` sees
``keys[i + 1 .. i + span]`` where ``keep`` is True, with weights
``exp(scale * q_i . k_j - c_i)``, ``c_i`` the row's largest visible logit (``-inf``
for a row that sees no key, whose rows are zeros).  The result is the unnormalised
``[numerator | denominator]`` rows and ``c``.

Each query runs a direct loop over its ``span`` keys (a dot product per key, then
``p v_j`` added to its row), and an invisible key is *skipped*, so that nothing it
holds (a NaN or infinite key or value, a later token) can reach a row.  Measured
against blocks of ``max(span, 16)`` queries with two ``gemm`` calls each (logits of
the block against its keys, the band selected, weights times values; L = 16384,
8 heads, d = 64, float32, two shared cores, interleaved best of 5): 19 against 33 ms
at span 4, 33 against 77 ms at span 16, 132 against 133 ms at span 64: the products
compute twice the band and small ``gemm`` calls cost their overhead.  Batch x heads
are shared among threads (:mod:`linattn_numba._machinery`: serial for small work); no
BLAS is called.

The backward holds ``c`` constant (exact for normalised outputs, which share it
between numerator and denominator): for each visible pair ``p = exp(s q.k - c)``,
``dp = g_num . v + g_den``, ``dq += s dp p k``, ``dk += s dp p q``, ``dv += p g_num``.

Examples
--------
>>> import numpy as np
>>> from linattn_numba.cpu import window
>>> q = np.zeros((1, 2, 2)); keys = np.zeros((1, 3, 2))
>>> values = np.array([[[9.0], [1.0], [3.0]]]); keep = np.array([[True, True, False]])
>>> rows, c = window.banded_partial(q, keys, values, keep, 1, 1.0)
>>> rows[0]  # query 0 sees key 1; query 1 would see key 2, which is not kept
array([[1., 1.],
       [0., 0.]])
>>> c[0]
array([  0., -inf])
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from linattn_numba import _machinery
from linattn_numba.cpu.arrays import contiguous, readonly
from linattn_numba.cpu.scalars import fast_exp, finite_shift

__all__ = ["DTYPES", "banded_partial", "banded_partial_backward"]

_jit = _machinery.jit


DTYPES = ("float32", "float64")


_REASSOC = frozenset({"contract", "reassoc"})


@_jit(fastmath=_REASSOC)
def _dot(a, b, zero):
    acc = zero
    for r in range(a.shape[0]):
        acc += a[r] * b[r]
    return acc


@_jit()
def _row_logits(q, k, keep, i, span, consts, logits):
    """Logits of query ``i`` against its band (``logits[o]`` for key ``i + 1 + o``) and
    their maximum over the visible keys (``NaN`` if one is NaN, as ``max`` gives)."""
    top = consts[1]
    for o in range(span):
        j = i + 1 + o
        if keep[j]:
            logit = _dot(q[i], k[j], consts[0]) * consts[2]
            logits[o] = logit
            if logit > top or logit != logit:  # (once NaN, nothing is greater)
                top = logit
    return top


@_jit()
def _direct_rows(q, k, v, keep, span, consts, rows, tops, i0, i1, logits):
    """Queries ``i0 .. i1 - 1`` one by one, invisible keys skipped."""
    dv = v.shape[1]
    for i in range(i0, i1):
        top = _row_logits(q, k, keep, i, span, consts, logits)
        tops[i] = top
        shift = finite_shift(top, consts[0])
        for e in range(dv + 1):
            rows[i, e] = consts[0]
        for o in range(span):
            j = i + 1 + o
            if keep[j]:
                p = fast_exp(logits[o] - shift)
                for e in range(dv):
                    rows[i, e] += p * v[j, e]
                rows[i, dv] += p


@_jit()
def _head_forward(q, k, v, keep, span, consts, rows, tops):
    logits = np.empty(span, q.dtype)
    _direct_rows(q, k, v, keep, span, consts, rows, tops, 0, q.shape[0], logits)


@_machinery.Variants.over(shared=("consts",))
def _forward(q, k, v, keep, span, consts, rows, tops):
    for b in range(q.shape[0]):
        _head_forward(q[b], k[b], v[b], keep[b], span, consts, rows[b], tops[b])


@_jit()
def _head_backward(q, k, v, keep, span, consts, tops, g, dq, dk, dv_out):
    length, d, dv = q.shape[0], q.shape[1], v.shape[1]
    scale = consts[2]
    for i in range(length):
        shift = finite_shift(tops[i], consts[0])
        for o in range(span):
            j = i + 1 + o
            if keep[j]:
                p = fast_exp(_dot(q[i], k[j], consts[0]) * scale - shift)
                dp = _dot(g[i, :dv], v[j], consts[0]) + g[i, dv]
                ds = scale * dp * p
                for r in range(d):
                    dq[i, r] += ds * k[j, r]
                    dk[j, r] += ds * q[i, r]
                for e in range(dv):
                    dv_out[j, e] += p * g[i, e]


@_machinery.Variants.over(shared=("consts",))
def _backward(q, k, v, keep, span, consts, tops, g, dq, dk, dv_out):
    for b in range(q.shape[0]):
        _head_backward(
            q[b], k[b], v[b], keep[b], span, consts, tops[b], g[b], dq[b], dk[b], dv_out[b]
        )


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in x.shape)


def _check(
    q: Any, keys: Any, values: Any, keep: Any, span: object, scale: object, **more: Any
) -> tuple[tuple[int, ...], int, np.dtype]:
    """``(batch shape, T, dtype)`` of a call, or an error naming the argument that is off."""
    named = {"q": q, "keys": keys, "values": values, "keep": keep, **more}
    for name, x in named.items():
        if not isinstance(x, np.ndarray):
            raise TypeError(
                f"{name} must be a numpy.ndarray; got {type(x).__module__}.{type(x).__name__}"
            )
    if isinstance(span, bool) or not isinstance(span, int | np.integer) or span < 1:
        raise ValueError(f"span must be a positive integer; got {span!r}")
    if isinstance(scale, bool) or not isinstance(scale, int | float | np.floating):
        raise TypeError(f"scale must be a real number; got {scale!r}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite; got {scale}")
    dtype = q.dtype
    for name, x in named.items():
        if name == "keep":
            if x.dtype != np.bool_:
                raise TypeError(f"keep must have dtype bool; got {x.dtype}")
        elif x.dtype.name not in DTYPES or x.dtype != dtype:
            raise TypeError(
                f"{name} must have dtype float32 or float64, the same as q ({dtype}); "
                f"got {x.dtype}"
            )
    if q.ndim < 2 or q.shape[-1] < 1:
        raise ValueError(f"q must have shape (..., T, d) with d >= 1; got {_shape(q)}")
    *batch, length, d = _shape(q)
    if values.ndim < 2:
        raise ValueError(f"values must have shape (..., T + span, d_v); got {_shape(values)}")
    dv = int(values.shape[-1])
    band = length + int(span)
    expected = {
        "keys": (*batch, band, d),
        "values": (*batch, band, dv),
        "keep": (*batch, band),
        "log_scale": (*batch, length),
        "g_rows": (*batch, length, dv + 1),
    }
    for name, x in named.items():
        if name != "q" and _shape(x) != expected[name]:
            raise ValueError(
                f"{name} must have shape {expected[name]} for q {_shape(q)}, span {span} "
                f"and values (..., {dv}); got {_shape(x)}"
            )
    return tuple(batch), length, dtype


def _flat(x: np.ndarray, count: int) -> np.ndarray:
    """``x`` with its batch axes flattened, C-contiguous and read-only (a view where it
    already is contiguous)."""
    return contiguous(x, (count, *x.shape[len(x.shape) - 2 :]))


def _flat_keep(x: np.ndarray, count: int) -> np.ndarray:
    return contiguous(x, (count, x.shape[-1]))


def _flat_inputs(q: Any, keys: Any, values: Any, keep: Any, count: int) -> tuple[Any, ...]:
    return _flat(q, count), _flat(keys, count), _flat(values, count), _flat_keep(keep, count)


def _consts(dtype: np.dtype, scale: float) -> np.ndarray:
    """``[0, -inf, scale]`` in the compute dtype (so that no float64 enters float32 code)."""
    return readonly(np.array([0.0, -np.inf, scale], dtype=dtype))


def _variant(count: int, length: int, span: int, d: int, dv: int) -> str:
    return _machinery.choose_variant(count, length, span * (d + dv))


def banded_partial(
    q: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    keep: np.ndarray,
    span: int,
    scale: float,
) -> tuple[np.ndarray, np.ndarray]:
    """Query ``i`` against ``keys[i + 1 .. i + span]`` exactly: ``(rows, log_scale)``.

    Parameters
    ----------
    q : numpy.ndarray
        Queries ``(..., T, d)``, float32 or float64.
    keys, values : numpy.ndarray
        ``(..., T + span, d)`` and ``(..., T + span, d_v)``, the band's keys and values
        in position order (the caller pads them), the dtype of ``q``.
    keep : numpy.ndarray
        ``(..., T + span)`` bool: which keys take part.
    span : int
        Keys per query.
    scale : float
        Logits are ``scale * q . k``.

    Returns
    -------
    rows : numpy.ndarray
        ``(..., T, d_v + 1)``: ``[sum_j p_j v_j | sum_j p_j]``, ``p_j = exp(logit_j - c)``.
    log_scale : numpy.ndarray
        ``(..., T)``: ``c``, the row's largest visible logit; ``-inf`` where none is.

    Examples
    --------
    >>> import numpy as np
    >>> q = np.ones((1, 1, 1)); keys = np.array([[[0.0], [0.0], [1.0]]])
    >>> values = np.array([[[0.0], [2.0], [4.0]]]); keep = np.ones((1, 3), bool)
    >>> rows, c = banded_partial(q, keys, values, keep, 2, 1.0)
    >>> c, rows  # weights exp(-1) and exp(0) for keys 1 and 2
    (array([[1.]]), array([[[4.73575888, 1.36787944]]]))
    """
    batch, length, dtype = _check(q, keys, values, keep, span, scale)
    count, d, dv = math.prod(batch), q.shape[-1], values.shape[-1]
    rows = np.empty((count, length, dv + 1), dtype)
    tops = np.empty((count, length), dtype)
    _forward.run(
        _variant(count, length, int(span), d, dv),
        *_flat_inputs(q, keys, values, keep, count),
        int(span),
        _consts(dtype, float(scale)),
        rows,
        tops,
    )
    return rows.reshape((*batch, length, dv + 1)), tops.reshape((*batch, length))


def banded_partial_backward(
    q: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    keep: np.ndarray,
    span: int,
    scale: float,
    log_scale: np.ndarray,
    g_rows: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cotangents ``(dq, dkeys, dvalues)`` of :func:`banded_partial` for ``g_rows``.

    ``log_scale`` is the forward's, held constant (the normalised outputs do not
    depend on it).  Keys that are not kept get zero cotangents.

    Examples
    --------
    >>> import numpy as np
    >>> q = np.ones((1, 1, 1)); keys = np.zeros((1, 2, 1)); values = np.ones((1, 2, 1))
    >>> keep = np.ones((1, 2), bool)
    >>> rows, c = banded_partial(q, keys, values, keep, 1, 1.0)
    >>> dq, dk, dv = banded_partial_backward(q, keys, values, keep, 1, 1.0, c,
    ...                                      np.array([[[1.0, 0.0]]]))
    >>> dq[0, 0], dk[0, 1], dv[0, 1]  # d(exp(q k) v)/dq = k = 0, /dk = q, /dv = 1
    (array([0.]), array([1.]), array([1.]))
    """
    batch, length, dtype = _check(
        q, keys, values, keep, span, scale, log_scale=log_scale, g_rows=g_rows
    )
    count, d, dv = math.prod(batch), q.shape[-1], values.shape[-1]
    dq = np.zeros((count, length, d), dtype)
    dk = np.zeros((count, length + int(span), d), dtype)
    dvalues = np.zeros((count, length + int(span), dv), dtype)
    _backward.run(
        _variant(count, length, int(span), d, dv),
        *_flat_inputs(q, keys, values, keep, count),
        int(span),
        _consts(dtype, float(scale)),
        _flat_keep(log_scale, count),
        _flat(g_rows, count),
        dq,
        dk,
        dvalues,
    )
    return dq.reshape(q.shape), dk.reshape(keys.shape), dvalues.reshape(values.shape)
