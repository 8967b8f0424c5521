"""Grouped-query attention: keys and values with fewer heads than the queries, never copied.

Queries ``(..., H, L_q, d)`` meet keys and values ``(..., H_kv, L_k, d)`` with ``H_kv``
dividing ``H``: query head ``h`` reads key head ``h // (H / H_kv)``, as in Llama and
Mistral.  Splitting the query head axis into ``(H_kv, G)`` and giving the keys a unit
group axis makes it ordinary broadcasting: ``(..., H_kv, G, L_q, d)`` against
``(..., H_kv, 1, L_k, d)``.  Both reshapes are views (splitting an axis never copies),
so the key features are computed once per key head, not once per query head.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from linattn._xp import Array, namespace_of

__all__ = ["group_mask", "grouped"]

Ungroup = Callable[[Array], Array]


def grouped(
    q: Array, k: Array, v: Array, key_mask: Array | None = None, /
) -> tuple[Array, Array, Array, Array | None, Ungroup]:
    """Reshape grouped-query inputs into broadcasting ones, and the way back for outputs.

    Parameters
    ----------
    q : array, shape ``(..., H, L_q, d)``
    k : array, shape ``(..., H_kv, L_k, d)``
    v : array, shape ``(..., H_kv, L_k, d_v)``
    key_mask : boolean array, shape ``(..., L_k)``, optional
        Broadcasting against the keys' batch axes ``(..., H_kv)`` or the queries'
        ``(..., H)`` (a per-query-head mask).

    Returns
    -------
    q, k, v, key_mask, ungroup
        ``q`` as ``(..., H_kv, H / H_kv, L_q, d)``, ``k`` and ``v`` with a unit axis
        before their length, ``key_mask`` to match, and ``ungroup`` turning an output
        ``(..., H_kv, H / H_kv, L_q, d_v)`` back into ``(..., H, L_q, d_v)``.  Inputs
        that need no grouping (``H_kv`` equal to ``H``, or 1, which broadcasts) come
        back unchanged with ``ungroup`` the identity.  A state returned for grouped
        inputs keeps the grouped batch shape ``(..., H_kv, H / H_kv)``; pass it back as
        it is.

    Raises
    ------
    ValueError
        If ``H_kv`` does not divide ``H``, or keys and values differ in head count.

    Examples
    --------
    >>> import numpy as np
    >>> import linattn as la
    >>> from linattn._gqa import grouped
    >>> rng = np.random.default_rng(0)
    >>> q = rng.normal(size=(2, 8, 16, 4))  # 8 query heads
    >>> k, v = (rng.normal(size=(2, 2, 16, 4)) for _ in range(2))  # 2 key/value heads
    >>> gq, gk, gv, mask, ungroup = grouped(q, k, v)
    >>> gq.shape, gk.shape
    ((2, 2, 4, 16, 4), (2, 2, 1, 16, 4))
    >>> fm = la.FeatureMap(4, 8, kind="hyperbolic", seed=0)
    >>> ungroup(la.linear_attention(gq, gk, gv, fm)).shape
    (2, 8, 16, 4)
    """
    xp = namespace_of({"q": q, "k": k, "v": v, "key_mask": key_mask}, optional=("key_mask",))
    if q.ndim < 3 or k.ndim < 3 or v.ndim < 3:
        return q, k, v, key_mask, _identity  # no head axis: nothing to group
    heads, kv_heads = int(q.shape[-3]), int(k.shape[-3])
    if int(v.shape[-3]) != kv_heads:
        raise ValueError(
            f"k and v must have the same number of heads (axis -3); got k {tuple(k.shape)} "
            f"and v {tuple(v.shape)}"
        )
    if kv_heads in (heads, 1):
        return q, k, v, key_mask, _identity  # plain broadcasting already serves it
    if heads % kv_heads:
        raise ValueError(
            f"the key/value head count must divide the query head count (grouped-query "
            f"attention): expected k.shape[-3] to divide q.shape[-3] = {heads}; got "
            f"{kv_heads} (q {tuple(q.shape)}, k {tuple(k.shape)})"
        )
    group = heads // kv_heads
    lead = tuple(q.shape[:-3])
    q = xp.reshape(q, (*lead, kv_heads, group, *q.shape[-2:]))
    k, v = xp.expand_dims(k, axis=-3), xp.expand_dims(v, axis=-3)
    if key_mask is not None:
        key_mask = _grouped_mask(xp, key_mask, heads, kv_heads, group)

    def ungroup(out: Array) -> Array:
        return xp.reshape(out, (*out.shape[:-4], heads, *out.shape[-2:]))

    return q, k, v, key_mask, ungroup


def _grouped_mask(xp: Any, key_mask: Array, heads: int, kv_heads: int, group: int) -> Array:
    """A ``(..., heads?, L_k)`` mask on the grouped batch axes ``(..., H_kv, G)``."""
    if key_mask.ndim < 2:
        return key_mask  # (L_k,): broadcasts against anything
    mask_heads = int(key_mask.shape[-2])
    if mask_heads == heads and heads != 1:
        return xp.reshape(key_mask, (*key_mask.shape[:-2], kv_heads, group, key_mask.shape[-1]))
    if mask_heads in (kv_heads, 1):
        return xp.expand_dims(key_mask, axis=-2)
    raise ValueError(
        f"key_mask's head axis (axis -2) must be 1, the key/value head count {kv_heads} or "
        f"the query head count {heads}; got key_mask shape {tuple(key_mask.shape)}"
    )


def group_mask(mask: Array, heads: int, kv_heads: int) -> Array:
    """A mask shaped like ``key_mask`` (for the query heads) on the grouped batch axes."""
    xp = namespace_of({"mask": mask})
    return _grouped_mask(xp, mask, heads, kv_heads, heads // kv_heads)


def _identity(out: Array) -> Array:
    return out
