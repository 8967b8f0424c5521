"""How the parts run: the one-pass compiled kernels for the combinations they take
(chosen by :mod:`linattn._plan`), every part's partial rows merged otherwise, and the
adjoint of the merge (:func:`parts_vjp`).
"""

from __future__ import annotations

import math
from typing import Any

from linattn import _dispatch, fitted
from linattn._adjoints import normalise_vjp
from linattn._xp import Array, Namespace, safe_shift
from linattn.hybrid.merge import merge
from linattn.hybrid.parts import ExactKeysPart, FarPart, Part, WindowPart, no_keys, zero_rows

__all__ = [
    "fused_bidirectional_parts",
    "fused_causal_parts",
    "fused_global_parts",
    "hybrid_rows",
    "parts_vjp",
]


def _sink_arrays(
    xp: Namespace, sinks: list[ExactKeysPart], part: FarPart, batch: tuple[int, ...]
) -> tuple[Array, Array, Array]:
    """The sink keys, values and ``visible`` of the one-pass kernels, broadcast to
    ``batch`` (no sinks: empty arrays)."""
    if sinks:
        (sink,) = sinks
        arrays = (sink.keys, sink.values, sink.visible)
    else:
        d, dv, length = part.q.shape[-1], part.v.shape[-1], part.q.shape[-2]
        arrays = (
            zero_rows(xp, (*batch, 0, d), part.q),
            zero_rows(xp, (*batch, 0, dv), part.q),
            no_keys(xp, (*batch, length, 0), None),
        )
    return tuple(xp.broadcast_to(x, (*batch, *x.shape[-2:])) for x in arrays)


def fused_causal_parts(xp: Namespace, found: list[Part]) -> tuple[Array, dict[str, Any]]:
    """Causal window, sinks and fused far keys in one pass (:mod:`linattn_numba.cpu.hybrid`):
    the far part, at most one window and one sink part (``linattn._plan`` chose it)."""
    (part,) = [p for p in found if isinstance(p, FarPart)]
    window = [p for p in found if isinstance(p, WindowPart)]
    sinks = [p for p in found if isinstance(p, ExactKeysPart)]
    kernel = _dispatch.hybrid_kernel_for(part.q, part.plan.backend)
    batch = tuple(part.q.shape[:-2])
    dv = part.v.shape[-1]
    if window:
        (band,) = window
        (recent, recent_values), keep, span = band.before, band.keep, band.span
    else:  # no window: no cache, the far keys are the call's own
        keep, span = part.operands(xp)[3], 0
        recent, recent_values = (
            zero_rows(xp, (*batch, 0, x.shape[-1]), x) for x in (part.k, part.v)
        )
    projection, hyperbolic, fitted_arrays = _far_map_arrays(xp, part, batch)
    m = part.feature_map.num_features
    out, kv, log_shift = kernel.causal_forward(
        part.q,
        *(xp.broadcast_to(x, (*batch, *x.shape[-2:])) for x in (part.k, part.v)),
        xp.broadcast_to(keep, (*batch, keep.shape[-1])),
        *(xp.broadcast_to(x, (*batch, *x.shape[-2:])) for x in (recent, recent_values)),
        span,
        part.feature_map.scale,
        *_sink_arrays(xp, sinks, part, batch),
        projection,
        hyperbolic=hyperbolic,
        kv=xp.broadcast_to(part.kv, (*batch, m, dv + 1)),
        log_shift=xp.broadcast_to(part.log_shift, (*batch, m)),
        chunk_size=part.chunk_size,
        fitted=fitted_arrays,
    )
    return out, {"kv": kv, "log_shift": log_shift}


def fused_bidirectional_parts(xp: Namespace, found: list[Part]) -> Array:
    """Bidirectional window, sinks and both fused far parts in one pass
    (:func:`linattn_numba.cpu.hybrid.bidirectional_forward`; ``linattn._plan`` chose it)."""
    part = next(p for p in found if isinstance(p, FarPart))
    sinks = [p for p in found if isinstance(p, ExactKeysPart)]
    kernel = _dispatch.hybrid_kernel_for(part.q, part.plan.backend)
    batch = tuple(part.q.shape[:-2])
    length = part.q.shape[-2]
    projection, hyperbolic, fitted_arrays = _far_map_arrays(xp, part, batch)
    return kernel.bidirectional_forward(
        part.q,
        *(xp.broadcast_to(x, (*batch, *x.shape[-2:])) for x in (part.k, part.v)),
        xp.broadcast_to(part.keep, (*batch, length)),
        part.lag,
        part.feature_map.scale,
        *_sink_arrays(xp, sinks, part, batch),
        projection,
        hyperbolic=hyperbolic,
        chunk_size=part.chunk_size,
        fitted=fitted_arrays,
    )


def _far_map_arrays(
    xp: Namespace, part: FarPart, batch: tuple[int, ...]
) -> tuple[Array, bool, dict[str, Array] | None]:
    """``(projection, hyperbolic, fitted)`` of the one-pass kernels' far part: a random
    map's projection, or a fitted map's parameters broadcast to ``batch`` (in the
    queries' dtype; the kernels compute its features per block) and an empty projection.
    """
    fm = part.feature_map
    if fm.parameters is None:
        return (*_dispatch.fused_map_arrays(fm), None)
    shape = (*batch, *part.q.shape[-2:])
    arrays = fitted.kernel_parameters(fm.parameters, shape, zero=-math.inf)
    fitted_arrays = {name: xp.astype(xp.asarray(x), part.q.dtype) for name, x in arrays.items()}
    return zero_rows(xp, (0, part.q.shape[-1]), part.q), False, fitted_arrays


def fused_global_parts(xp: Namespace, found: list[Part]) -> Array:
    """Bidirectional sinks (or ``exact_key_mask``'s keys) without a window, and the far
    keys as one global state, in the fused bidirectional pass, which merges the exact
    keys per query (:func:`linattn._dispatch.fused_global`; ``linattn._plan`` chose it)."""
    (part,) = [p for p in found if isinstance(p, FarPart)]
    sinks = [p for p in found if isinstance(p, ExactKeysPart)]
    batch = tuple(part.q.shape[:-2])
    sink_arrays = _sink_arrays(xp, sinks, part, batch)
    return _dispatch.fused_global(part.q, part.k, part.v, part.feature_map, part.keep, sink_arrays)


def hybrid_rows(xp: Namespace, found: list[Part]) -> tuple[Array, dict[str, Any]]:
    """Merged rows of all parts, and the far part's state (``kv``, ``log_shift``)."""
    partials, state = [], {}
    for part in found:
        if isinstance(part, FarPart) and part.causal and not part.reverse:
            partial, kv, log_shift = part.run(xp)
            state = {"kv": kv, "log_shift": log_shift}
        else:
            partial = part.rows(xp)
        partials.append(partial)
    return merge(xp, partials), state


def parts_vjp(
    xp: Namespace, found: list[Part], grad: Array, parameters: dict[str, Any] | None = None
) -> tuple[Array | None, Array | None, Array | None]:
    """Cotangents ``(dq, dk, dv)`` of the broadcast inputs from that of the output;
    a fitted map's parameter cotangents are added to ``parameters`` where given.

    The merge's scales and every part's stabilisers are held constant: the output is
    invariant to them (numerator and denominator share them), so this is exact.
    """
    partials = [part.rows_for_backward(xp) for part in found]
    g_rows = normalise_vjp(xp, merge(xp, partials), grad)
    top = partials[0][1]
    for _, scale in partials[1:]:
        top = xp.maximum(top, scale)
    top = safe_shift(xp, top)
    totals: list[Array | None] = [None, None, None]
    for part, partial in zip(found, partials, strict=True):
        scale = partial[1]
        g_part = xp.exp(scale - top)[..., None] * g_rows
        if parameters is not None and isinstance(part, FarPart):
            grads = part.backward(xp, g_part, partial, parameters=parameters)
        else:
            grads = part.backward(xp, g_part, partial)
        for i, g in enumerate(grads):
            if g is not None:
                totals[i] = g if totals[i] is None else totals[i] + g
    return totals[0], totals[1], totals[2]
