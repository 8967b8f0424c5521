"""The kernel contract's argument checks, shared by the CPU and the CUDA target.

Both targets take ``(log_phi_q, log_phi_k, values_aug, kv, log_shift, chunk_size)``
(and the backward two cotangents) with shapes ``(*batch, L, m)``, ``(*batch, L, m)``,
``(*batch, L, d_v + 1)``, ``(*batch, m, d_v + 1)``, ``(*batch, m)``.  Everything here
runs before any compiled kernel sees the arrays, so that a bad call raises a Python
error naming the argument instead of reading out of bounds.  What differs between
the targets (which array type, which dtypes, which device) is passed in.

Examples
--------
>>> import numpy as np
>>> from linattn_numba import _contract
>>> lq = np.zeros((2, 5, 3)); va = np.ones((2, 5, 4))
>>> named = {"log_phi_q": lq, "log_phi_k": lq, "values_aug": va,
...          "kv": np.zeros((2, 3, 4)), "log_shift": np.zeros((2, 3))}
>>> _contract.check_shapes(named, chunk_size=8)
Sizes(batch_shape=(2,), length=5, m=3, width=4, chunk=8)
>>> _contract.check_chunk_size(0)
Traceback (most recent call last):
...
ValueError: chunk_size must be a positive integer; got 0
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "INPUTS",
    "ROLES",
    "Sizes",
    "check_arrays",
    "check_chunk_size",
    "check_dtypes",
    "check_shapes",
    "named",
]

#: The contract's array arguments, in order (``chunk_size`` follows them).
INPUTS = ("log_phi_q", "log_phi_k", "values_aug", "kv", "log_shift")

#: What each argument of the contract is: its shape is ``Sizes.shape(role)``.
ROLES = {
    "log_phi_q": "features",
    "log_phi_k": "features",
    "values_aug": "values",
    "kv": "state",
    "log_shift": "shift",
    "d_outputs_aug": "values",
    "d_kv": "state",  # (the CPU backward's name)
    "d_kv_out": "state",  # (the CUDA backward's name)
}


@dataclass(frozen=True)
class Sizes:
    """The sizes of one checked call: batch axes, ``L``, ``m``, ``d_v + 1``, chunk size."""

    batch_shape: tuple[int, ...]
    length: int
    m: int
    width: int  # d_v + 1
    chunk: int

    @property
    def batch(self) -> int:
        """The batch axes flattened into one."""
        return math.prod(self.batch_shape)

    def shape(self, role: str) -> tuple[int, ...]:
        """Shape of an argument of ``role``: ``"features"``, ``"values"``, ``"state"``
        or ``"shift"`` (see :data:`ROLES`)."""
        return (*self.batch_shape, *self._tail(role))

    def flat(self, role: str) -> tuple[int, ...]:
        """:meth:`shape` with the batch axes flattened into one (how kernels see it)."""
        return (self.batch, *self._tail(role))

    def _tail(self, role: str) -> tuple[int, ...]:
        return {
            "features": (self.length, self.m),
            "values": (self.length, self.width),
            "state": (self.m, self.width),
            "shift": (self.m,),
        }[role]


def named(arrays: Sequence[Any], cotangents: tuple[str, ...] = ()) -> dict[str, Any]:
    """``{name: array}`` for :data:`INPUTS` followed by the backward's ``cotangents``."""
    return dict(zip(INPUTS + cotangents, arrays, strict=True))


def check_chunk_size(chunk_size: object) -> int:
    """``chunk_size`` as an ``int``; ``TypeError`` unless an integer, ``ValueError`` if < 1."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int | np.integer):
        raise TypeError(f"chunk_size must be a positive integer; got {chunk_size!r}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer; got {chunk_size}")
    return int(chunk_size)


def check_arrays(named: Mapping[str, Any], is_array: Callable[[Any], bool], what: str) -> None:
    """``TypeError`` naming the first argument that is not ``what`` (by ``is_array``)."""
    for name, x in named.items():
        if not is_array(x):
            raise TypeError(f"{name} must be {what}; got {type(x).__module__}.{type(x).__name__}")


def dtype_name(x: Any) -> str:
    """``"float32"`` for NumPy's, CuPy's and torch's float32 alike."""
    return str(x.dtype).rsplit(".", 1)[-1]


def check_dtypes(named: Mapping[str, Any], allowed: tuple[str, ...], *, same: bool) -> str:
    """The dtype name of ``log_phi_q``; ``TypeError`` naming the first argument whose
    dtype is not in ``allowed`` (or, with ``same``, differs from ``log_phi_q``'s)."""
    first = dtype_name(named["log_phi_q"])
    for name, x in named.items():
        got = dtype_name(x)
        if got not in allowed or (same and got != first):
            also = f", the same as log_phi_q ({first})" if same else ""
            names = f"{', '.join(allowed[:-1])} or {allowed[-1]}" if allowed[1:] else allowed[0]
            raise TypeError(f"{name} must have dtype {names}{also}; got {got}")
    return first


def check_shapes(named: Mapping[str, Any], chunk_size: object) -> Sizes:
    """The call's :class:`Sizes`, or ``ValueError`` naming the argument whose shape is off.

    ``L`` may be 0 (nothing to attend: the state passes through); ``m`` and
    ``d_v + 1`` must be at least 1.
    """
    chunk = check_chunk_size(chunk_size)
    lq, va = named["log_phi_q"], named["values_aug"]
    if lq.ndim < 2 or int(lq.shape[-1]) < 1:
        raise ValueError(f"log_phi_q must have shape (*batch, L, m) with m >= 1; got {_shape(lq)}")
    *batch, length, m = _shape(lq)
    if va.ndim < 1 or int(va.shape[-1]) < 1:
        raise ValueError(f"values_aug must have shape (*batch, L, d_v + 1); got {_shape(va)}")
    sizes = Sizes(tuple(batch), length, m, int(va.shape[-1]), chunk)
    for name, x in named.items():
        expected = sizes.shape(ROLES[name])
        if _shape(x) != expected:
            raise ValueError(
                f"{name} must have shape {expected} to match log_phi_q {_shape(lq)} and "
                f"values_aug (..., {sizes.width}); got {_shape(x)}"
            )
    return sizes


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in x.shape)
