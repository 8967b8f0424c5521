"""Checked calls of the fused passes: flattened, contiguous operands in the compute dtype.

:class:`FusedCall` (the bidirectional pass) and :class:`CausalFusedCall` (the fused causal
pass, its forward and backward) check every argument before any compiled code runs, and
name the argument, what was expected and what was given.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from linattn_numba import _contract, _machinery
from linattn_numba.cpu.arrays import (
    chunk_length,
    contiguous,
    fresh,
    readonly,
    without_empty_rows,
)

__all__ = ["FITTED", "CausalFusedCall", "FusedCall", "check_fitted", "fitted_operands"]

#: A fitted map's parameters as the kernels take them (``linattn.fitted.kernel_parameters``).
FITTED = ("query_weight", "key_weight", "query_bias", "key_bias", "key_shift")


def check_fitted(
    fitted: Any, batch: tuple[int, ...], d: int, m: int | None, dtype: np.dtype
) -> int:
    """Check ``fitted``'s arrays (NumPy, ``dtype``, shapes ``batch`` + the parameter's),
    naming the one at fault; the number of features ``m`` (given, or ``None``: twice
    ``query_weight``'s columns)."""
    if not isinstance(fitted, dict) or set(fitted) != set(FITTED):
        raise TypeError(f"fitted must be a dict with keys {FITTED}; got {fitted!r:.80}")
    for name in FITTED:
        x = fitted[name]
        if not isinstance(x, np.ndarray):
            raise TypeError(
                f"fitted[{name!r}] must be a numpy.ndarray; got "
                f"{type(x).__module__}.{type(x).__name__}"
            )
        if x.dtype != dtype:
            raise TypeError(f"fitted[{name!r}] must have dtype {dtype}; got {x.dtype}")
    if m is None:
        weight = fitted["query_weight"]
        m = 2 * int(weight.shape[-1]) if weight.ndim else 0
    half = m // 2
    tails = {"query_weight": (d, half), "key_weight": (d, half), "query_bias": (half,),
             "key_bias": (half,), "key_shift": ()}  # fmt: skip
    for name, tail in tails.items():
        if m % 2 or tuple(fitted[name].shape) != (*batch, *tail):
            raise ValueError(
                f"fitted[{name!r}] must have shape {(*batch, *tail)} for m = {m} features; "
                f"got {tuple(fitted[name].shape)}"
            )
    return m


def fitted_operands(
    fitted: dict[str, np.ndarray] | None, batch: tuple[int, ...], dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The kernels' ``(weights, biases, key_shift)``, flat ``(n, 2, d, m/2)``, ``(n, 2,
    m/2)`` and ``(n,)`` (queries' first, keys' second), from checked ``fitted``; empty
    arrays for a random map (``fitted=None``).  All read-only, as every kernel input is
    (:func:`linattn_numba.cpu.arrays.readonly`): a random and a fitted map's calls are
    then one specialisation of each kernel, compiled once for both."""
    n = math.prod(batch)
    if fitted is None:
        return (readonly(np.empty((n, 2, 0, 0), dtype)), readonly(np.empty((n, 2, 0), dtype)),
                readonly(np.empty((n,), dtype)))  # fmt: skip
    stacked = (
        np.stack([fitted["query_weight"], fitted["key_weight"]], axis=-3),
        np.stack([fitted["query_bias"], fitted["key_bias"]], axis=-2),
        fitted["key_shift"],
    )
    weights, biases, shift = (contiguous(x, (n, *x.shape[len(batch) :]), dtype) for x in stacked)
    return weights, biases, shift


class FusedCall:
    """One checked call: flattened, contiguous operands in the compute dtype."""

    def __init__(
        self,
        q: Any,
        k: Any,
        v: Any,
        projection: Any,
        hyperbolic: object,
        scale: object,
        key_mask: Any,
        fitted: Any = None,
    ) -> None:
        arrays = {"q": q, "k": k, "v": v, "projection": projection}
        if key_mask is not None:
            arrays["key_mask"] = key_mask
        for name, x in arrays.items():
            if not isinstance(x, np.ndarray):
                raise TypeError(
                    f"{name} must be a numpy.ndarray; got {type(x).__module__}.{type(x).__name__}"
                )
        for name in ("q", "k", "v", "projection"):
            if not np.issubdtype(arrays[name].dtype, np.floating):
                raise TypeError(f"{name} must have a floating dtype; got {arrays[name].dtype}")
        if key_mask is not None and key_mask.dtype != np.bool_:
            raise TypeError(f"key_mask must have dtype bool; got {key_mask.dtype}")
        if not isinstance(hyperbolic, bool | np.bool_):
            raise TypeError(f"hyperbolic must be True or False; got {hyperbolic!r}")
        if isinstance(scale, bool) or not isinstance(scale, int | float | np.floating):
            raise TypeError(f"scale must be a positive float; got {scale!r}")
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"scale must be a positive float; got {scale!r}")
        for name in ("q", "k", "v"):
            if arrays[name].ndim < 2:
                raise ValueError(
                    f"{name} must have shape (*batch, L, d); got {arrays[name].shape}"
                )
        if projection.ndim != 2 or projection.shape[1] != q.shape[-1]:
            raise ValueError(
                f"projection must have shape (rows, {q.shape[-1]}) to match q {q.shape}; "
                f"got {projection.shape}"
            )
        if k.shape[-1] != q.shape[-1]:
            raise ValueError(f"k must have shape (..., {q.shape[-1]}) like q; got {k.shape}")
        length, key_length = q.shape[-2], k.shape[-2]
        if v.shape[-2] != key_length:
            raise ValueError(
                f"v must have shape (..., {key_length}, d_v) to match k {k.shape}; got {v.shape}"
            )
        if key_mask is not None and (key_mask.ndim < 1 or key_mask.shape[-1] != key_length):
            raise ValueError(
                f"key_mask must have shape (..., {key_length}) to match k {k.shape}; "
                f"got {key_mask.shape}"
            )
        shapes = [q.shape[:-2], k.shape[:-2], v.shape[:-2]]
        shapes += [] if key_mask is None else [key_mask.shape[:-1]]
        try:
            batch = np.broadcast_shapes(*shapes)
        except ValueError:
            raise ValueError(
                "the batch axes of q, k, v (and key_mask) must broadcast; got "
                f"q {q.shape}, k {k.shape}, v {v.shape}"
                + ("" if key_mask is None else f", key_mask {key_mask.shape}")
            ) from None
        self.dtype = np.dtype(np.float64) if q.dtype == np.float64 else np.dtype(np.float32)
        self.batch, self.n = batch, math.prod(batch)
        self.length, self.dv, self.d = length, v.shape[-1], q.shape[-1]
        self.m = projection.shape[0] * (2 if hyperbolic else 1)
        if fitted is not None:  # a fitted map's features (its parameters) instead
            self.m = check_fitted(fitted, batch, self.d, None, self.dtype)
        #: ``(weights, biases, key_shift)`` of :func:`fitted_operands` (empty: none)
        self.fitted = fitted_operands(fitted, batch, self.dtype)
        self.hyperbolic = bool(hyperbolic)

        def flat(x: np.ndarray, tail: tuple[int, ...], dtype: Any) -> np.ndarray:
            return contiguous(np.broadcast_to(x, (*batch, *tail)), (self.n, *tail), dtype)

        self.q = flat(q, (length, self.d), self.dtype)
        self.k = flat(k, (key_length, self.d), self.dtype)
        self.v = flat(v, (key_length, self.dv), self.dtype)
        mask = np.ones(key_length, bool) if key_mask is None else key_mask
        self.mask = flat(mask, (key_length,), None)
        self.consts = readonly(np.array([0.5 * scale, 0.5 * np.log(self.m)], dtype=self.dtype))
        self.projection = readonly(
            np.ascontiguousarray(np.sqrt(scale) * projection, dtype=self.dtype)
        )
        tokens = max(length, key_length)
        self.variant = _machinery.choose_variant(self.n, tokens, self.m * (self.dv + 1))

    def operands(self) -> tuple[Any, ...]:
        return (self.q, self.k, self.v, self.mask, self.projection, self.consts, self.hyperbolic)

    def sinks(self, sinks: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The checked, flattened ``(keys, values, visible)`` of exact keys (none: empty)."""
        if sinks is None:
            return (
                readonly(np.zeros((self.n, 0, self.d), self.dtype)),
                readonly(np.zeros((self.n, 0, self.dv), self.dtype)),
                readonly(np.zeros((self.n, self.length, 0), np.bool_)),
            )
        if not isinstance(sinks, tuple) or len(sinks) != 3:
            raise TypeError(f"sinks must be a tuple (keys, values, visible); got {sinks!r}")
        keys, values, visible = sinks
        for name, x in (("sink keys", keys), ("sink values", values), ("visible", visible)):
            if not isinstance(x, np.ndarray):
                raise TypeError(
                    f"{name} must be a numpy.ndarray; got {type(x).__module__}.{type(x).__name__}"
                )
        if visible.dtype != np.bool_:
            raise TypeError(f"visible must have dtype bool; got {visible.dtype}")
        count = keys.shape[-2] if keys.ndim >= 2 else -1
        expected = {
            "sink keys": (keys, (count, self.d)),
            "sink values": (values, (count, self.dv)),
            "visible": (visible, (self.length, count)),
        }
        for name, (x, tail) in expected.items():
            if x.ndim < 2 or tuple(x.shape[-2:]) != tail:
                raise ValueError(f"{name} must have shape (*batch, {tail[0]}, {tail[1]}); "
                                 f"got {x.shape}")  # fmt: skip
        return (
            self.shaped(keys, count, self.d),
            self.shaped(values, count, self.dv),
            contiguous(np.broadcast_to(visible, (*self.batch, self.length, count)),
                  (self.n, self.length, count), None),
        )  # fmt: skip

    def shaped(self, x: np.ndarray, *tail: int) -> np.ndarray:
        """A checked flat array ``(n, *tail)`` in the compute dtype, C-contiguous."""
        return contiguous(np.broadcast_to(x, (*self.batch, *tail)), (self.n, *tail), self.dtype)

    def check(self, name: str, x: Any, tail: tuple[int, ...]) -> np.ndarray:
        if not isinstance(x, np.ndarray):
            raise TypeError(
                f"{name} must be a numpy.ndarray; got {type(x).__module__}.{type(x).__name__}"
            )
        expected = (*self.batch, *tail)
        if tuple(x.shape) != expected:
            raise ValueError(f"{name} must have shape {expected}; got {tuple(x.shape)}")
        return self.shaped(x, *tail)


class CausalFusedCall(FusedCall):
    """:class:`linattn_numba.cpu.calls.FusedCall` for the causal pass: queries and keys of
    one length, and the incoming state ``(kv, log_shift)`` (fresh flat copies)."""

    def __init__(
        self,
        q: Any,
        k: Any,
        v: Any,
        projection: Any,
        hyperbolic: object,
        scale: object,
        key_mask: Any,
        kv: Any,
        log_shift: Any,
        chunk_size: object,
    ) -> None:
        super().__init__(q, k, v, projection, hyperbolic, scale, key_mask)
        if k.shape[-2] != q.shape[-2]:
            raise ValueError(
                f"k must have shape (..., {q.shape[-2]}, d) like q (causal attention); "
                f"got {k.shape}"
            )
        self.chunk = chunk_length(_contract.check_chunk_size(chunk_size), self.length)
        m, width = self.m, self.dv + 1
        for name, x, tail in (("kv", kv, (m, width)), ("log_shift", log_shift, (m,))):
            if not isinstance(x, np.ndarray):
                raise TypeError(
                    f"{name} must be a numpy.ndarray; got {type(x).__module__}.{type(x).__name__}"
                )
            if not np.issubdtype(x.dtype, np.floating):
                raise TypeError(f"{name} must have a floating dtype; got {x.dtype}")
            lead = x.shape[: x.ndim - len(tail)]
            fits = x.ndim >= len(tail) and x.shape[x.ndim - len(tail) :] == tail
            if not (fits and _broadcasts(lead, self.batch)):
                raise ValueError(
                    f"{name} must have shape (*batch, {', '.join(map(str, tail))}) with batch "
                    f"axes that broadcast to {self.batch}; got {x.shape}"
                )
        self.mu = fresh(np.broadcast_to(log_shift, (*self.batch, m)), (self.n, m), self.dtype)
        state = np.broadcast_to(kv, (*self.batch, m, width))
        self.kv = without_empty_rows(fresh(state, (self.n, m, width), self.dtype), self.mu)
        self.variant = _machinery.choose_variant(self.n, self.length, m * width)

    def shaped_results(self, *arrays: np.ndarray) -> tuple[np.ndarray, ...]:
        return tuple(x.reshape((*self.batch, *x.shape[1:])) for x in arrays)


def _broadcasts(shape: tuple[int, ...], batch: tuple[int, ...]) -> bool:
    try:
        return np.broadcast_shapes(shape, batch) == tuple(batch)
    except ValueError:
        return False
