"""Scalar primitives of the CPU kernels: a vectorisable ``exp``, typed literals, shifts.

:func:`fast_exp` is within 2 ulp of the C library's ``exp`` (exact ``0``, ``inf`` and
``nan``) and vectorises where ``math.exp`` does not; :func:`typed` gives a literal the
dtype of an array so that float32 loops stay float32.  No policy lives here: these are
the building blocks of the passes in :mod:`linattn_numba.cpu`.

Examples
--------
>>> import numpy as np
>>> from linattn_numba.cpu import scalars
>>> float(scalars.fast_exp(np.float64(0.0)))
1.0
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

from linattn_numba import _machinery

__all__ = [
    "fast_exp",
    "finite_shift",
    "larger",
    "log_floor",
    "root_tiny",
    "safe_shift",
    "typed",
]

_jit = _machinery.jit


@intrinsic
def _pow2(typingctx: Any, n: Any) -> Any:
    """``2**n`` for an integer-valued float ``n`` in the normal exponent range (bit assembly)."""
    if n not in (types.float32, types.float64):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        (x,) = args
        if n == types.float32:
            int_type, bias, shift = ir.IntType(32), 127, 23
        else:
            int_type, bias, shift = ir.IntType(64), 1023, 52
        bits = builder.add(builder.fptosi(x, int_type), ir.Constant(int_type, bias))
        return builder.bitcast(builder.shl(bits, ir.Constant(int_type, shift)), x.type)

    return n(n), codegen


_POW2: Any = _pow2  # (typed loosely: mypy cannot see an intrinsic's signature)


def _exp32(x):
    # Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2, then Taylor to degree 7.
    xc = min(max(x, np.float32(-104.0)), np.float32(89.0))
    n = np.floor(xc * np.float32(1.4426950408889634) + np.float32(0.5))
    r = xc - n * np.float32(0.693359375)
    r = r - n * np.float32(-2.12194440e-4)
    p = np.float32(1.0 / 5040.0)
    p = p * r + np.float32(1.0 / 720.0)
    p = p * r + np.float32(1.0 / 120.0)
    p = p * r + np.float32(1.0 / 24.0)
    p = p * r + np.float32(1.0 / 6.0)
    p = p * r + np.float32(0.5)
    p = p * r + np.float32(1.0)
    p = p * r + np.float32(1.0)
    # 2**n in two factors so that results in the subnormal range come out right.
    half = np.floor(n * np.float32(0.5))
    y = p * _POW2(half) * _POW2(n - half)
    return y if x == x else x


def _exp64(x):
    xc = min(max(x, -746.0), 710.0)
    n = np.floor(xc * 1.4426950408889634 + 0.5)
    r = xc - n * 6.93147180369123816490e-01
    r = r - n * 1.90821492927058770002e-10
    p = 1.0 / 479001600.0
    p = p * r + 1.0 / 39916800.0
    p = p * r + 1.0 / 3628800.0
    p = p * r + 1.0 / 362880.0
    p = p * r + 1.0 / 40320.0
    p = p * r + 1.0 / 5040.0
    p = p * r + 1.0 / 720.0
    p = p * r + 1.0 / 120.0
    p = p * r + 1.0 / 24.0
    p = p * r + 1.0 / 6.0
    p = p * r + 0.5
    p = p * r + 1.0
    p = p * r + 1.0
    half = np.floor(n * 0.5)
    y = p * _POW2(half) * _POW2(n - half)
    return y if x == x else x


def fast_exp(x):
    """``exp(x)`` for float32/float64 scalars inside ``@njit`` code (vectorises in loops)."""
    return math.exp(x)


@overload(fast_exp)
def _fast_exp_overload(x):
    if x == types.float32:
        return _exp32
    if x == types.float64:
        return _exp64
    return None


def typed(value, like):
    """``value`` in the float type of the scalar ``like``, inside ``@njit`` code.

    A Python literal there is float64 (or int64), and float32 arithmetic with it is
    float64: one ``-np.inf`` in a branch made a float32 kernel's exponentials float64.
    """
    return value


@overload(typed)
def _typed_overload(value, like):
    if like == types.float32:
        return lambda value, like: np.float32(value)
    if like == types.float64:
        return lambda value, like: np.float64(value)
    return None


def log_floor(like):
    """The floor of a fitted map's log-features in ``like``'s float type, inside
    ``@njit`` code: ``-3000`` for float64, ``-420`` for float32.

    A product of two features one of which is at the floor is below the float range
    (``exp(-745)``, ``exp(-104)``) whatever the other and ``log g`` (up to ``g = 1e300``,
    ``3e38``), so the floor changes no output; it bounds the shifts the passes take
    from the keys' features, whose rounding (``eps |shift|``) enters every weight: with
    weights x1e16 (float64) or x1e7 (float32) the log-features reach ``-1e16`` and the
    one-pass hybrid kernels were off by 0.4.
    """
    return -3000.0


@overload(log_floor)
def _log_floor_overload(like):
    if like == types.float32:
        return lambda like: np.float32(-420.0)
    if like == types.float64:
        return lambda like: np.float64(-3000.0)
    return None


def root_tiny(like):
    """``sqrt`` of the smallest normal number of ``like``'s float type, inside ``@njit``
    code: a sum of positive terms below it may have lost terms to underflow that matter
    (what underflows is below rounding against a sum above it)."""
    return 1.4916681462400413e-154


@overload(root_tiny)
def _root_tiny_overload(like):
    if like == types.float32:
        return lambda like: np.float32(1.0842022e-19)
    if like == types.float64:
        return lambda like: np.float64(1.4916681462400413e-154)
    return None


@_jit()
def safe_shift(mu, ms):
    """``ms = mu`` where finite, else 0; returns whether the state holds any key."""
    has_state = False
    for r in range(mu.shape[0]):
        if np.isfinite(mu[r]):
            ms[r] = mu[r]
            has_state = True
        else:
            ms[r] = 0
    return has_state


@_jit()
def larger(value, top):
    """``value`` where it is larger than ``top`` (a NaN never is), else ``top``."""
    return value if value > top else top


@_jit()
def finite_shift(top, zero):
    """The exponent shift: the row's maximum where finite, else 0 (``safe_shift``)."""
    return top if np.isfinite(top) else zero
