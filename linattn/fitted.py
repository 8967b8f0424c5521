"""Fitted feature maps: Hedgehog features with per-head parameters and a far-part weight.

A fitted map (``kind="hedgehog"``) is not a random draw but parameters fitted to a
layer's exact attention (:mod:`linattn.transfer`):

    u = x W + b,    log phi(x) = [u, -u] - logsumexp([u, -u])

(Zhang et al., "The Hedgehog & the Porcupine", ICLR 2024, with the bias of fla's
``HedgehogFeatureMap``): ``m`` positive features from a ``d x m/2`` matrix ``W``.
Queries and keys have their own ``W`` and ``b`` (or share them: ``tied``), and each may
hold one per head: ``(H, d, m/2)`` against inputs ``(..., H, L, d)``; with grouped-query
attention the key parameters belong to the key heads.

The **far weight** ``g >= 0`` (one per key head, or one for all) multiplies every key's
features: in the hybrid (``window=``, ``sink_keys=``, ``exact_key_mask=``) the output is
``(N_near + g N_far) / (D_near + g D_far)`` with exact softmax weights near and
``phi(q) . phi(k)`` far; ``g = 0`` is exactly the exact parts alone, ``g = 1`` the plain
hybrid.  Carried by the key features, it reaches every path, state and decoding step
that key features reach; without exact parts it cancels.  (The features are
normalised, ``sum_j phi_j = 1``, so their scale against ``exp(s q.k)`` is exactly what
``g`` sets: there is no second scale to fit.)

Everything here is written against the array API; the parameters are host (NumPy)
arrays moved to the input's namespace and device on use, like a random projection.
The math is in ``docs/algorithm.md`` (section "Fitted feature maps").
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from linattn._xp import (
    Array,
    Namespace,
    array_device,
    constant,
    from_host,
    is_array,
    log_softmax,
    require,
    to_host,
)

__all__ = [
    "LOG_FLOOR",
    "ZERO_FAR_LOG",
    "FittedParameters",
    "add_cotangents",
    "check_parameters",
    "check_values",
    "describe",
    "head_axes",
    "initial_parameters",
    "input_vjp",
    "log_features",
    "parameter_vjp",
    "projection",
]

#: ``log g`` used for ``g = 0``: ``exp(-1e4)`` is 0 in every float type, so the far keys
#: drop out exactly, while every stabiliser (a maximum over log-features) stays finite.
ZERO_FAR_LOG = -1.0e4


class FittedParameters(NamedTuple):
    """A fitted map's parameters: read-only float64 host arrays.

    ``*_weight`` has shape ``(d, m/2)`` or ``(H, d, m/2)``, ``*_bias`` ``(m/2,)`` or
    ``(H, m/2)`` (the weight's head axis), ``far_weight`` ``()`` or ``(H_kv,)`` (the key
    heads).  Tied maps hold the same arrays for queries and keys.
    """

    query_weight: np.ndarray
    query_bias: np.ndarray
    key_weight: np.ndarray
    key_bias: np.ndarray
    far_weight: np.ndarray

    @property
    def tied(self) -> bool:
        """Queries and keys share one ``W`` and ``b``."""
        return self.key_weight is self.query_weight and self.key_bias is self.query_bias

    @property
    def head_dim(self) -> int:
        return int(self.query_weight.shape[-2])

    @property
    def num_features(self) -> int:
        return 2 * int(self.query_weight.shape[-1])

    def role(self, role: object) -> tuple[np.ndarray, np.ndarray]:
        """``(W, b)`` of ``"query"`` or ``"key"``."""
        if role == "query":
            return self.query_weight, self.query_bias
        if role == "key":
            return self.key_weight, self.key_bias
        raise ValueError(
            f"role must be 'query' or 'key' for a fitted (hedgehog) map with separate query "
            f"and key parameters; got {role!r}"
        )

    def arrays(self) -> dict[str, np.ndarray]:
        """The arrays by name (keys' omitted when tied)."""
        names = ["query_weight", "query_bias", "far_weight"]
        if not self.tied:
            names[2:2] = ["key_weight", "key_bias"]
        return {name: getattr(self, name) for name in names}


def check_values(xp: Namespace, name: str, value: Array) -> None:
    """The rules on a parameter's values, in its own array library (no host copy unless
    it is wrong): finite, and ``far_weight`` non-negative.  ``ValueError`` naming it.

    Examples
    --------
    >>> import numpy as np
    >>> check_values(np, "far_weight", np.array([0.5, -1.0]))
    Traceback (most recent call last):
    ...
    ValueError: far_weight must be non-negative; got [0.5, -1.0]
    """
    require(xp, xp.all(xp.isfinite(value)), f"{name} must be finite; got NaN or infinite values")
    if name == "far_weight":
        require(xp, xp.all(value >= 0), "far_weight must be non-negative", lambda: value)


def _host(name: str, value: Any) -> np.ndarray:
    host = to_host(value) if is_array(value) else np.asarray(value)
    if host.dtype.kind not in "iuf":
        raise TypeError(f"{name} must hold real numbers; got dtype {host.dtype}")
    host = np.array(host, dtype=np.float64, copy=True)
    check_values(np, name, host)
    host.setflags(write=False)
    return host


def check_parameters(
    query_weight: Any,
    query_bias: Any = None,
    key_weight: Any = None,
    key_bias: Any = None,
    far_weight: Any = None,
    *,
    tied: bool = False,
) -> FittedParameters:
    """Validated, frozen :class:`FittedParameters`; ``ValueError`` naming the argument.

    Missing biases are zeros, a missing far weight is 1, missing key parameters are the
    query's when ``tied`` (else an error).

    Examples
    --------
    >>> import numpy as np
    >>> p = check_parameters(np.eye(4), tied=True)
    >>> p.num_features, p.tied, float(p.far_weight)
    (8, True, 1.0)
    """
    if not isinstance(tied, bool):
        raise TypeError(f"tied must be True or False; got {tied!r}")
    wq = _host("query_weight", query_weight)
    if wq.ndim not in (2, 3) or 0 in wq.shape:
        raise ValueError(
            "query_weight must have shape (head_dim, num_features / 2) or "
            f"(heads, head_dim, num_features / 2); got {wq.shape}"
        )
    bq = _bias("query_bias", query_bias, wq)
    if tied:
        if key_weight is not None or key_bias is not None:
            raise ValueError("key_weight and key_bias must be None with tied=True")
        wk, bk = wq, bq
    else:
        if key_weight is None:
            raise ValueError("key_weight is required unless tied=True")
        wk = _host("key_weight", key_weight)
        if wk.ndim not in (2, 3) or wk.shape[-2:] != wq.shape[-2:]:
            raise ValueError(
                f"key_weight must have shape {wq.shape[-2:]} or (key_heads, "
                f"{wq.shape[-2]}, {wq.shape[-1]}) to match query_weight; got {wk.shape}"
            )
        if wk.ndim == 3 and wq.ndim == 3 and wq.shape[0] % wk.shape[0]:
            raise ValueError(
                f"key_weight's heads must divide query_weight's ({wq.shape[0]}, grouped-"
                f"query attention); got {wk.shape[0]}"
            )
        bk = _bias("key_bias", key_bias, wk)
    key_heads = (wk.shape[0],) if wk.ndim == 3 else ()
    g = _host("far_weight", 1.0 if far_weight is None else far_weight)
    if g.shape not in ((), key_heads):
        raise ValueError(
            f"far_weight must be a number or have shape {key_heads} (one per key head); "
            f"got shape {g.shape}"
        )
    return FittedParameters(wq, bq, wk, bk, g)


def _bias(name: str, bias: Any, weight: np.ndarray) -> np.ndarray:
    shape = weight.shape[:-2] + weight.shape[-1:]
    if bias is None:
        return _host(name, np.zeros(shape))
    host = _host(name, bias)
    if host.shape != shape:
        raise ValueError(f"{name} must have shape {shape} to match its weight; got {host.shape}")
    return host


def initial_parameters(
    head_dim: int,
    num_features: int,
    *,
    heads: int | None = None,
    key_heads: int | None = None,
    tied: bool = False,
    seed: int = 0,
) -> FittedParameters:
    """Hedgehog's start: ``W`` the identity (column ``j`` is ``e_(j mod d)``) plus
    ``0.01`` Gaussian noise from ``seed``, ``b = 0``, ``g = 1``.

    Examples
    --------
    >>> p = initial_parameters(4, 8, heads=2)
    >>> p.query_weight.shape, p.far_weight.shape
    ((2, 4, 4), (2,))
    """
    if num_features % 2 or num_features < 2:
        raise ValueError(f"num_features must be a positive even number; got {num_features}")
    rng = np.random.default_rng(seed)
    half = num_features // 2
    eye = np.zeros((head_dim, half))
    eye[np.arange(half) % head_dim, np.arange(half)] = 1.0

    def weight(count: int | None) -> np.ndarray:
        shape = (head_dim, half) if count is None else (count, head_dim, half)
        return eye + 0.01 * rng.standard_normal(shape)

    key_heads = heads if key_heads is None else key_heads
    wq = weight(heads)
    wk = None if tied else weight(key_heads)
    g = np.ones(()) if key_heads is None else np.ones(key_heads)
    return check_parameters(wq, None, wk, None, g, tied=tied)


# -- the map on arrays ---------------------------------------------------------------


def _per_head(param: np.ndarray, x: Array, name: str, vector: bool) -> np.ndarray:
    """``param`` shaped to broadcast against ``x (..., L, d)``.

    ``param``'s leading head axes (none, ``(H,)``, or grouped-query attention's
    ``(H_kv, G)`` and ``(H_kv, 1)``, see :func:`grouped`) meet the axes of ``x`` just
    before ``(L, d)``, each equal or 1.  ``vector``: one trailing axis (biases, log far
    weights), which gets a unit ``L`` axis; else two (weights).
    """
    trailing = 1 if vector else 2
    heads = tuple(param.shape[: param.ndim - trailing])
    if not heads:
        return param
    shape = tuple(x.shape)
    met = shape[-2 - len(heads) : -2] if len(shape) >= 2 + len(heads) else None
    if met is None or any(h not in (1, s) for h, s in zip(heads, met, strict=True)):
        expected = ", ".join(str(h) for h in heads)
        raise ValueError(
            f"a fitted map whose {name} has heads ({expected}) needs inputs "
            f"(..., {expected}, L, d); got shape {shape}"
        )
    return param.reshape((*heads, 1, param.shape[-1])) if vector else param


def grouped(p: FittedParameters, group: int, key_heads: int | None = None) -> FittedParameters:
    """``p`` for grouped-query inputs ``(..., H_kv, G, L, d)`` and ``(..., H_kv, 1, L, d)``.

    Query parameters ``(H, ...)`` become ``(H_kv, G, ...)``, key ones ``(H_kv, 1, ...)``.
    With ``key_heads`` (``H_kv``) given, per-head parameters must have ``H = G H_kv``
    query heads and ``H_kv`` key heads (``ValueError`` naming the parameter otherwise):
    a split of other counts could broadcast, silently giving heads others' parameters.
    """
    if key_heads is not None:
        heads = group * key_heads
        expected = {
            "query_weight": (p.query_weight, 2, heads, "query"),
            "key_weight": (p.key_weight, 2, key_heads, "key/value"),
            "far_weight": (p.far_weight, 0, key_heads, "key/value"),
        }
        for name, (a, trailing, count, kind) in expected.items():
            if a.ndim > trailing and a.shape[0] != count:
                raise ValueError(
                    f"a fitted map whose {name} has {a.shape[0]} heads cannot serve "
                    f"grouped-query inputs with {heads} query and {key_heads} key/value "
                    f"heads: {name} needs one per {kind} head ({count})"
                )

    def split(a: np.ndarray, trailing: int, size: int) -> np.ndarray:
        if a.ndim == trailing:
            return a
        # A copy, not a view: torch.compile cannot hold a view of a host array.
        out = np.array(a.reshape((a.shape[0] // size, size, *a.shape[1:])))
        out.setflags(write=False)
        return out

    return FittedParameters(
        split(p.query_weight, 2, group),
        split(p.query_bias, 1, group),
        split(p.key_weight, 2, 1),
        split(p.key_bias, 1, 1),
        p.far_weight if p.far_weight.ndim == 0 else split(p.far_weight, 0, 1),
    )


def head_axes(p: FittedParameters | None) -> int:
    """How many batch axes just before ``(L, d)`` the parameters meet: 0 (shared), 1
    (per head) or 2 (grouped-query ``(H_kv, G)``, see :func:`grouped`).

    Examples
    --------
    >>> import numpy as np
    >>> head_axes(check_parameters(np.ones((3, 4, 2)), tied=True))
    1
    """
    if p is None:
        return 0
    return max(p.query_weight.ndim - 2, p.key_weight.ndim - 2, p.far_weight.ndim)


def _moved(xp: Namespace, host: np.ndarray, x: Array) -> Array:
    return from_host(xp, host, dtype=x.dtype, device=array_device(x))


def projection(xp: Namespace, p: FittedParameters, x: Array, role: object) -> Array:
    """``u = x W + b`` of ``role``'s parameters, shape ``(..., L, m/2)``."""
    w, b = p.role(role)
    w = _moved(xp, _per_head(w, x, f"{role}_weight", vector=False), x)
    b = _moved(xp, _per_head(b, x, f"{role}_bias", vector=True), x)
    return xp.matmul(x, w) + b


def pairs_projection(xp: Namespace, p: FittedParameters, x: Array, role: object) -> Array:
    """``[u, -u]`` of :func:`projection` in one product (by ``[W, -W]``, ``[b, -b]``),
    shape ``(..., L, m)``: the map's logits, ``phi = softmax([u, -u])``."""
    w, b = p.role(role)
    w = _per_head(np.concatenate([w, -w], axis=-1), x, f"{role}_weight", vector=False)
    b = _per_head(np.concatenate([b, -b], axis=-1), x, f"{role}_bias", vector=True)
    return xp.matmul(x, _moved(xp, w, x)) + _moved(xp, b, x)


def log_far_weight(p: FittedParameters, zero: float = ZERO_FAR_LOG) -> np.ndarray:
    """``log g``, ``zero`` for ``g = 0`` (:data:`ZERO_FAR_LOG`: finite, for the paths
    that add it to key log-features; ``-inf`` for those that keep the far part apart)."""
    g = p.far_weight
    return np.where(g > 0, np.log(np.where(g > 0, g, 1.0)), zero)


def far_log_shift(
    xp: Namespace, p: FittedParameters, x: Array, *, zero: float = ZERO_FAR_LOG
) -> Array | float:
    """``log g`` (:func:`log_far_weight`) shaped to add to key log-features ``(..., L,
    m)``."""
    lg = log_far_weight(p, zero)
    if lg.ndim == 0:
        return float(lg)
    shaped = _per_head(lg[..., None], x, "far_weight", vector=True)
    return _moved(xp, shaped, x)


def far_keys_on(xp: Namespace, p: FittedParameters, x: Array) -> Array:
    """Which key heads have far keys (``g > 0``), shaped to broadcast against a key mask
    of keys ``x`` (``(..., L)``; the head axis where ``x`` has it, 0-d for a shared ``g``).

    A head with ``g = 0`` is the exact parts alone: its far keys are *absent*, not
    weighted by ``exp(ZERO_FAR_LOG)``, which a row without near keys would normalise
    back to the far keys' mean.  (No branch on the values: inside ``torch.compile`` the
    parameters are traced, and reading them would split the graph.)
    """
    on = p.far_weight > 0
    if on.ndim:
        on = _per_head(on[..., None], x, "far_weight", vector=True)[..., 0]
    return from_host(xp, on, dtype=xp.bool, device=array_device(x))


def kernel_parameters(
    p: FittedParameters, shape: tuple[int, ...], *, zero: float = ZERO_FAR_LOG
) -> dict[str, np.ndarray]:
    """The parameters as the compiled hybrid kernels take them, for inputs of ``shape``
    ``(..., L, d)``: each broadcast to the batch axes ``shape[:-2]`` (weights ``(..., d,
    m/2)``, biases ``(..., m/2)``, ``key_shift`` ``(...)``, the key heads' ``log g``,
    ``zero`` for ``g = 0``: ``-inf`` for the hybrid kernels, where the far keys of such
    a head are absent, as :func:`far_keys_on` has them); heads that do not meet
    ``shape`` raise as :func:`log_features` does."""
    like = np.broadcast_to(np.empty((), dtype=bool), shape)
    batch = tuple(shape[:-2])
    out: dict[str, np.ndarray] = {}
    for role in ("query", "key"):
        w, b = p.role(role)
        w = _per_head(w, like, f"{role}_weight", vector=False)
        b = _per_head(b, like, f"{role}_bias", vector=True)  # (heads..., 1, m/2) or (m/2,)
        out[f"{role}_weight"] = np.broadcast_to(w, (*batch, *w.shape[-2:]))
        b = b.reshape((*tuple(b.shape)[:-2], b.shape[-1]))  # the unit L axis dropped
        out[f"{role}_bias"] = np.broadcast_to(b, (*batch, b.shape[-1]))
    shift = _per_head(log_far_weight(p, zero)[..., None], like, "far_weight", vector=True)
    out["key_shift"] = np.broadcast_to(shift.reshape(tuple(shift.shape)[:-2]), batch)
    return out


def log_softmax_pairs(xp: Namespace, u: Array) -> Array:
    """``[u, -u] - logsumexp([u, -u])`` over the last axis."""
    return log_softmax(xp, xp.concat([u, -u], axis=-1))


def log_softmax_pairs_vjp(xp: Namespace, log_phi: Array, d_log: Array) -> Array:
    """``d_u`` from the cotangent of :func:`log_softmax_pairs` (given its value)."""
    d_z = d_log - xp.exp(log_phi) * xp.sum(d_log, axis=-1, keepdims=True)
    half = d_z.shape[-1] // 2
    return d_z[..., :half] - d_z[..., half:]


#: The floor of the log-features by compute dtype (the compiled passes' too:
#: ``linattn_numba.cpu.scalars.log_floor``).  A product of two features one of which is
#: at the floor is below the float range whatever the other and ``log g``, so no output
#: changes but a query's whose every term is below it (``docs/numerics.md``, Limits);
#: it bounds the shifts the scans take from the keys' features, whose rounding
#: (``eps |shift|``) enters every weight: at weights x1e8 (float64) the features reach
#: ``-1e8`` and the array-API scan was off by 0.37 without it.
LOG_FLOOR = {"float64": -3000.0, "float32": -420.0}


def log_features(xp: Namespace, p: FittedParameters, x: Array, role: object) -> Array:
    """Log-features of ``role``, ``(..., L, m)``: the map's, floored at
    :data:`LOG_FLOOR` (NaN stays NaN); keys' then include ``log g``."""
    log_phi = log_softmax_pairs(xp, projection(xp, p, x, role))
    floor = LOG_FLOOR["float64" if log_phi.dtype == xp.float64 else "float32"]
    log_phi = xp.maximum(log_phi, constant(xp, floor, log_phi))
    if role == "key":  # (after the floor: g = 0's ZERO_FAR_LOG still drops the far keys)
        log_phi = log_phi + far_log_shift(xp, p, x)
    return log_phi


def input_vjp(xp: Namespace, p: FittedParameters, x: Array, d_log: Array, role: object) -> Array:
    """``dx`` from the cotangent of :func:`log_features`."""
    log_phi = log_softmax_pairs(xp, projection(xp, p, x, role))
    d_u = log_softmax_pairs_vjp(xp, log_phi, d_log)
    w = _moved(xp, _per_head(p.role(role)[0], x, f"{role}_weight", vector=False), x)
    return xp.matmul(d_u, xp.matrix_transpose(w))


def parameter_vjp(
    xp: Namespace, p: FittedParameters, x: Array, d_log: Array, role: object
) -> dict[str, np.ndarray]:
    """Host cotangents of ``role``'s parameters (and, for keys, of ``far_weight``).

    Summed over every batch axis of ``x`` that the parameters broadcast over; returned as
    float64 NumPy arrays of the parameters' shapes.
    """
    w, b = p.role(role)
    log_phi = log_softmax_pairs(xp, projection(xp, p, x, role))
    d_u = log_softmax_pairs_vjp(xp, log_phi, d_log)
    d_w = xp.matmul(xp.matrix_transpose(x), d_u)  # (..., d, n)
    d_b = xp.sum(d_u, axis=-2)  # (..., n)
    out = {
        f"{role}_weight": _sum_to(to_host(d_w), w.shape),
        f"{role}_bias": _sum_to(to_host(d_b), b.shape),
    }
    if role == "key":
        d_log_g = _sum_to(to_host(xp.sum(xp.sum(d_log, axis=-1), axis=-1)), p.far_weight.shape)
        g = p.far_weight
        # d/dg of log g is 1/g; g = 0 is a constant (the head chose the exact parts).
        out["far_weight"] = np.where(g > 0, d_log_g / np.where(g > 0, g, 1.0), 0.0)
    return out


def add_cotangents(total: dict[str, np.ndarray], new: dict[str, np.ndarray]) -> None:
    """Add parameter cotangents ``new`` into ``total`` (in place, by name)."""
    for name, value in new.items():
        total[name] = total[name] + value if name in total else value


def _sum_to(host: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Sum a broadcast cotangent down to ``shape``: over the leading axes the parameter
    lacks, and over the axes where it has 1 and the cotangent more (grouped-query
    attention's key parameters ``(H_kv, 1, ...)`` against cotangents of every query
    head of a group, ``(..., H_kv, G, ...)``)."""
    summed = np.asarray(host, dtype=np.float64)
    extra = summed.ndim - len(shape)
    if extra > 0:
        summed = summed.sum(axis=tuple(range(extra)))
    ones = tuple(i for i, n in enumerate(shape) if n == 1 and summed.shape[i] != 1)
    if ones:
        summed = summed.sum(axis=ones, keepdims=True)
    return summed.reshape(shape)


def describe(p: FittedParameters) -> str:
    """A short text for ``repr``: heads, tying and the far weight."""
    heads = p.query_weight.shape[0] if p.query_weight.ndim == 3 else None
    key_heads = p.key_weight.shape[0] if p.key_weight.ndim == 3 else None
    g = p.far_weight
    g_text = f"{float(g):.4g}" if g.ndim == 0 else f"{g.size} per key head"
    return f"heads={heads}, key_heads={key_heads}, tied={p.tied}, far_weight={g_text}"
