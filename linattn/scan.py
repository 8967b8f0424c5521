"""Scans of chunk states with the associative :func:`linattn.combine`, without a loop over L.

Causal attention computes every chunk's own state ``(S_n, mu_n)`` at once and then
needs, for each chunk, the combination of all states before it.  That is a prefix
scan with an associative operator, which needs no loop over the sequence:

* JAX: :func:`jax.lax.scan` (the framework's own: one traced step whatever ``N``);
* every other namespace: a Hillis-Steele scan written in the array API, ``ceil(log2 N)``
  steps of one shifted :func:`~linattn.combine` each.

Either way the prefix of chunk ``n`` combines the states of chunks ``<= n`` only, in an
order fixed by ``n`` alone: later tokens cannot change it, bit for bit
(``docs/algorithm.md``, section 9).
"""

from __future__ import annotations

import math
from typing import Any

from linattn._xp import Array, Namespace, array_device, is_jax_namespace
from linattn.state import combine

__all__ = ["exclusive", "inclusive_scan"]


def inclusive_scan(
    xp: Namespace, kv: Array, log_shift: Array, *, reverse: bool = False
) -> tuple[Array, Array]:
    """``(S, mu)`` of chunks ``0..n`` (or ``n..N-1`` with ``reverse``) for every ``n``.

    Parameters
    ----------
    kv : array, shape ``(..., N, m, w)``
    log_shift : array, shape ``(..., N, m)``
        The chunk states, chunk axis third (``kv``) and second (``log_shift``) from last.
    reverse : bool, default False
        Scan from the last chunk backwards (suffix combinations).

    Examples
    --------
    >>> import numpy as np
    >>> kv = np.ones((3, 1, 1)); mu = np.zeros((3, 1))
    >>> s, m = inclusive_scan(np, kv, mu)
    >>> (np.exp(m)[..., None] * s).ravel()  # 1, 1 + 1, 1 + 1 + 1
    array([1., 2., 3.])
    """
    if is_jax_namespace(xp):
        return _jax_scan(xp, kv, log_shift, reverse)
    n = kv.shape[-3]
    if reverse:
        kv, log_shift = xp.flip(kv, axis=-3), xp.flip(log_shift, axis=-2)
    offset = 1
    while offset < n:
        # Step s: chunk n absorbs the combination ending at n - 2^s (identity before 0).
        earlier = (
            _shifted(xp, kv, offset, axis=-3, fill=0.0),
            _shifted(xp, log_shift, offset, axis=-2, fill=-math.inf),
        )
        kv, log_shift = combine(xp, earlier, (kv, log_shift))
        offset *= 2
    if reverse:
        kv, log_shift = xp.flip(kv, axis=-3), xp.flip(log_shift, axis=-2)
    return kv, log_shift


def exclusive(xp: Namespace, kv: Array, log_shift: Array) -> tuple[Array, Array]:
    """Shift an inclusive scan by one chunk: the combination of chunks ``< n``."""
    return (
        _shifted(xp, kv, 1, axis=-3, fill=0.0),
        _shifted(xp, log_shift, 1, axis=-2, fill=-math.inf),
    )


def _shifted(xp: Namespace, x: Array, offset: int, *, axis: int, fill: float) -> Array:
    """``x`` moved ``offset`` places along ``axis``, the first places filled with ``fill``."""
    n = x.shape[axis]
    head_shape = list(x.shape)
    head_shape[axis] = min(offset, n)
    head = xp.full(tuple(head_shape), fill, dtype=x.dtype, device=array_device(x))
    if offset >= n:
        return head
    index = [slice(None)] * x.ndim
    index[axis] = slice(0, n - offset)
    return xp.concat([head, x[tuple(index)]], axis=axis)


def _jax_scan(xp: Namespace, kv: Array, log_shift: Array, reverse: bool) -> tuple[Array, Array]:
    """``jax.lax.scan`` over the chunk axis: one traced step, whatever the length.

    Measured on the CPU (B=1, H=2, d=64, m=256): the same 166 forward and 435 gradient
    jaxpr equations at L = 256, 4096 and 65536, ``jit`` compile 0.6 s and 1.6 s, run
    time within 10 % of ``jax.lax.associative_scan``, whose equations grow with
    ``log L`` and whose gradient took 8.4 s to compile at L = 65536.
    """
    import jax

    kv_first = xp.moveaxis(kv, -3, 0)  # scan the chunk axis: put it first
    shift_first = xp.moveaxis(log_shift, -2, 0)

    def step(carry: tuple[Array, Array], chunk: tuple[Array, Array]) -> tuple[Any, Any]:
        carry = combine(xp, carry, chunk)
        return carry, carry

    empty = (xp.zeros_like(kv_first[0, ...]), xp.full_like(shift_first[0, ...], -math.inf))
    _, (kv_first, shift_first) = jax.lax.scan(
        step, empty, (kv_first, shift_first), reverse=reverse
    )
    return xp.moveaxis(kv_first, 0, -3), xp.moveaxis(shift_first, 0, -2)
