"""Explicit vector-Jacobian product of linear attention, for users without autodiff.

``linear_attention_vjp`` returns ``(dq, dk, dv)`` for a cotangent of the normalised
output.  Causal attention runs the compiled backward kernel where one serves the
arrays (NumPy, positive features) and otherwise the batched backward below, written
in the array API: the state before every chunk from the forward scan, their
cotangents from a reverse scan, every chunk's gradients at once; no state is ever
rebuilt by subtraction (``docs/algorithm.md``, section 13).  Bidirectional attention
uses closed-form products.

Every stabiliser (per-feature maxima, per-row and per-key shifts) is held constant:
numerator and denominator share it, so the gradient of the normalised output is
exact.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from linattn import _dispatch
from linattn._adjoints import bidirectional_vjp, causal_vjp, normalise_vjp, sum_to
from linattn._call import (
    Call,
    attention_operands,
    call_statistics,
    drop_masked_keys,
    exact_parts_vjp,
    grouped_inputs,
)
from linattn._checks import check_attention_inputs, check_chunk_size
from linattn._dispatch import Backend
from linattn._gqa import group_mask
from linattn._plan import backward_of, chosen
from linattn._xp import Array, compute_dtype, float_dtype, namespace_of
from linattn.features import FeatureMap
from linattn.fitted import add_cotangents
from linattn.state import empty_state

__all__ = ["linear_attention_vjp"]


def linear_attention_vjp(
    q: Array,
    k: Array,
    v: Array,
    feature_map: FeatureMap,
    grad_output: Array,
    /,
    *,
    causal: bool = False,
    key_mask: Array | None = None,
    chunk_size: int | None = None,
    backend: Backend | None = None,
    window: int | None = None,
    sink_keys: int = 0,
    exact_key_mask: Array | None = None,
    scale: float | None = None,
    parameters: bool = False,
) -> tuple[Any, ...]:
    """Gradients of ``sum(grad_output * linear_attention(q, k, v, feature_map, ...))``.

    Parameters
    ----------
    q, k, v : arrays
        As for :func:`linattn.linear_attention`.
    feature_map : FeatureMap or None
        Any kind; the projection is held fixed (no gradient).  ``None`` with exact parts
        (exact sparse attention), as for :func:`linattn.linear_attention`.
    grad_output : array, shape ``(..., L_q, d_v)``
        Cotangent of the output, with the output's (broadcast) shape.
    causal, key_mask, chunk_size, backend, window, sink_keys, exact_key_mask, scale
        As for :func:`linattn.linear_attention` (no state: a whole sequence); a backward
        pass's ``chunk_size`` is 64 by default on every path.
    parameters : bool, default False
        Also return the cotangents of a fitted map's parameters (``kind="hedgehog"``,
        :mod:`linattn.fitted`) as a fourth item: a dict of float64 NumPy arrays by the
        names of :meth:`linattn.FeatureMap.fitted` (``query_weight``, ``query_bias``,
        ``key_weight``, ``key_bias`` unless tied, ``far_weight``), in the parameters'
        shapes.

    Returns
    -------
    (dq, dk, dv) : arrays
        Shaped and typed like ``q``, ``k`` and ``v`` (broadcast dimensions summed);
        with ``parameters=True``, ``(dq, dk, dv, d_parameters)``.

    Examples
    --------
    >>> import numpy as np
    >>> import linattn as la
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (0.5 * rng.normal(size=(2, 16, 8)) for _ in range(3))
    >>> fm = la.FeatureMap(8, 32, seed=0)
    >>> g = rng.normal(size=(2, 16, 8))
    >>> dq, dk, dv = la.linear_attention_vjp(q, k, v, fm, g, causal=True)
    >>> dq.shape, dk.shape, dv.shape
    ((2, 16, 8), (2, 16, 8), (2, 16, 8))
    >>> eps = 1e-6; v2 = v.copy(); v2[0, 3, 1] += eps
    >>> f = lambda v: (g * la.linear_attention(q, k, v, fm, causal=True)).sum()
    >>> bool(abs((f(v2) - f(v)) / eps - dv[0, 3, 1]) < 1e-5)
    True
    """
    if not isinstance(parameters, bool):
        raise TypeError(f"parameters must be True or False; got {parameters!r}")
    sink: dict[str, np.ndarray] | None = None
    if parameters:
        fitted_parameters = getattr(feature_map, "parameters", None)
        if fitted_parameters is None:
            kind = getattr(feature_map, "kind", None)
            raise ValueError(
                f"parameters=True needs a fitted feature map (kind='hedgehog'); got kind={kind!r}"
            )
        sink = {}
    grads = _vjp(
        q,
        k,
        v,
        feature_map,
        grad_output,
        sink,
        causal=causal,
        key_mask=key_mask,
        chunk_size=chunk_size,
        backend=backend,
        window=window,
        sink_keys=sink_keys,
        exact_key_mask=exact_key_mask,
        scale=scale,
    )
    if sink is None:
        return grads
    assert fitted_parameters is not None
    arrays = fitted_parameters.arrays()
    return (*grads, {name: sink.get(name, np.zeros_like(a)) for name, a in arrays.items()})


def _vjp(
    q: Array,
    k: Array,
    v: Array,
    feature_map: FeatureMap,
    grad_output: Array,
    sink: dict[str, np.ndarray] | None,
    /,
    *,
    causal: bool = False,
    key_mask: Array | None = None,
    chunk_size: int | None = None,
    backend: Backend | None = None,
    window: int | None = None,
    sink_keys: int = 0,
    exact_key_mask: Array | None = None,
    scale: float | None = None,
) -> tuple[Array, Array, Array]:
    """:func:`linear_attention_vjp`; a fitted map's parameter cotangents are added to
    ``sink`` where given."""
    if grad_output is None:
        raise TypeError("grad_output must be an array shaped like the output; got None")
    chunk_size = check_chunk_size(chunk_size, _dispatch.DEFAULT_CHUNK_SIZE)
    grouped_q, grouped_k, grouped_v, grouped_mask, ungroup = grouped_inputs(q, k, v, key_mask)
    if ungroup is not None:
        # Grouped-query attention as linear_attention runs it: broadcasting views, the
        # map's per-head parameters split the same way, broadcast gradients summed.
        heads, kv_heads = int(q.shape[-3]), int(k.shape[-3])
        if exact_key_mask is not None and exact_key_mask.ndim >= 2:
            exact_key_mask = group_mask(exact_key_mask, heads, kv_heads)
        ungrouped_parameters = getattr(feature_map, "parameters", None)
        ungrouped_parameters = (
            {} if ungrouped_parameters is None else ungrouped_parameters._asdict()
        )
        if isinstance(feature_map, FeatureMap):
            feature_map = feature_map.grouped(heads // kv_heads, kv_heads)
        shape = tuple(getattr(grad_output, "shape", ()))
        if len(shape) == q.ndim and shape[-3] == heads:
            xp = namespace_of({"grad_output": grad_output})
            grad_output = xp.reshape(grad_output, (*shape[:-3], kv_heads, -1, *shape[-2:]))
        grouped_sink: dict[str, np.ndarray] | None = None if sink is None else {}
        dq, dk, d_values = _vjp(
            grouped_q,
            grouped_k,
            grouped_v,
            feature_map,
            grad_output,
            grouped_sink,
            causal=causal,
            key_mask=grouped_mask,
            chunk_size=chunk_size,
            backend=backend,
            window=window,
            sink_keys=sink_keys,
            exact_key_mask=exact_key_mask,
            scale=scale,
        )
        if sink is not None and grouped_sink is not None:
            # The grouped split is a reshape: its cotangents reshape back.
            shapes = {name: a.shape for name, a in ungrouped_parameters.items()}
            add_cotangents(
                sink, {name: g.reshape(shapes[name]) for name, g in grouped_sink.items()}
            )
        xp = namespace_of({"dk": dk})
        return ungroup(dq), xp.reshape(dk, tuple(k.shape)), xp.reshape(d_values, tuple(v.shape))
    if window is not None or sink_keys != 0 or exact_key_mask is not None:
        return _exact_parts_vjp(
            q,
            k,
            v,
            feature_map,
            grad_output,
            parameters=sink,
            causal=causal,
            key_mask=key_mask,
            chunk_size=chunk_size,
            backend=backend,
            window=window,
            sink_keys=sink_keys,
            exact_key_mask=exact_key_mask,
            scale=scale,
        )
    if not isinstance(feature_map, FeatureMap):
        raise TypeError(
            f"feature_map must be a linattn.FeatureMap; got {type(feature_map).__name__}"
        )
    info = check_attention_inputs(
        q,
        k,
        v,
        key_mask=key_mask,
        causal=causal,
        head_dim=feature_map.head_dim,
        extra={"grad_output": grad_output},
    )
    # The executor linear_attention would run chooses the adjoint (the plan decides once).
    call = Call(q, k, v, feature_map, causal, key_mask, chunk_size=chunk_size, backend=backend)
    executor, plan = chosen(call)
    xp = info.xp
    float_dtype(xp, "grad_output", grad_output)
    batch, lq, dv = info.batch_shape, info.query_length, info.value_dim
    if tuple(grad_output.shape) != (*batch, lq, dv):
        raise ValueError(
            f"grad_output must have the output's shape {(*batch, lq, dv)}; got "
            f"{tuple(grad_output.shape)}"
        )
    work = compute_dtype(xp, info.dtype)
    inputs = q, k, v
    q, k, v = (xp.astype(x, work, copy=False) for x in inputs)  # one compute dtype
    k, v = drop_masked_keys(xp, k, v, key_mask)
    m = feature_map.num_features
    # The same statistics linear_attention uses; constants for gradients there too.
    statistics = call_statistics(xp, feature_map, q, k, key_mask, causal=causal)
    # The executor's own backward where it has one (the fused passes: no L x m array;
    # they compute random features only, so a fitted map's adjoint runs on log-features).
    own = backward_of(executor, call)
    if own is not None:
        dq, dk, d_values = own(
            q, k, v, feature_map, key_mask, xp.astype(grad_output, work, copy=False),
            chunk_size=chunk_size,
        )  # fmt: skip
        q, k, v = inputs  # gradients in the callers' dtypes
        return (
            sum_to(xp, dq, tuple(q.shape), q.dtype),
            sum_to(xp, dk, tuple(k.shape), k.dtype),
            sum_to(xp, d_values, tuple(v.shape), v.dtype),
        )
    log_phi_q, sign_q, log_phi_k, sign_k, values_aug = attention_operands(
        q, k, v, feature_map, info, batch, key_mask, work, statistics
    )
    kv, log_shift = empty_state(xp, batch, m, dv, log_phi_q)

    operands = (log_phi_q, sign_q, log_phi_k, sign_k, values_aug)
    outputs_aug, _, _ = _dispatch.attend(
        xp, operands, kv, log_shift, causal=causal, chunk_size=chunk_size, plan=plan
    )
    d_outputs_aug = normalise_vjp(xp, outputs_aug, xp.astype(grad_output, work, copy=False))

    if not causal:
        d_lq, d_lk, d_va = bidirectional_vjp(
            xp, log_phi_q, sign_q, log_phi_k, sign_k, values_aug, d_outputs_aug
        )
    else:
        if plan.backward is None and _dispatch.resolve_backend(backend) == "numba":
            raise ValueError(
                f"backend='numba' cannot serve these arrays ({type(q).__module__}."
                f"{type(q).__name__}): the compiled backward serves NumPy arrays with "
                "positive features only"
            )
        if plan.backward is not None:
            d_lq, d_lk, d_va, _ = plan.backward(
                log_phi_q,
                log_phi_k,
                values_aug,
                kv,
                log_shift,
                chunk_size,
                d_outputs_aug,
                xp.zeros_like(kv),
            )
        else:
            d_lq, d_lk, d_va = causal_vjp(
                xp, log_phi_q, sign_q, log_phi_k, sign_k, values_aug, d_outputs_aug, chunk_size
            )
    dq = feature_map.log_features_vjp(q, d_lq, role="query", statistics=statistics)
    dk = feature_map.log_features_vjp(k, d_lk, role="key", statistics=statistics)
    if sink is not None:
        add_cotangents(sink, feature_map.log_features_parameter_vjp(q, d_lq, role="query"))
        add_cotangents(sink, feature_map.log_features_parameter_vjp(k, d_lk, role="key"))
    d_values = d_va[..., :dv]
    q, k, v = inputs  # gradients in the callers' dtypes
    return (
        sum_to(xp, dq, tuple(q.shape), q.dtype),
        sum_to(xp, dk, tuple(k.shape), k.dtype),
        sum_to(xp, d_values, tuple(v.shape), v.dtype),
    )


def _exact_parts_vjp(
    q: Array,
    k: Array,
    v: Array,
    feature_map: FeatureMap | None,
    grad_output: Array,
    *,
    backend: Backend | None,
    parameters: dict[str, np.ndarray] | None = None,
    **options: Any,
) -> tuple[Array, Array, Array]:
    """The VJP of hybrid attention: each part's adjoint
    (:func:`linattn.hybrid.paths.parts_vjp`)."""
    if feature_map is not None and not isinstance(feature_map, FeatureMap):
        raise TypeError(
            f"feature_map must be a linattn.FeatureMap or None; got {type(feature_map).__name__}"
        )
    # The far keys' scan as linear_attention's plan runs it (the portable parts on Dask).
    _, plan = chosen(Call(q, k, v, feature_map, backend=backend, **options))
    return exact_parts_vjp(
        q, k, v, feature_map, grad_output, plan=plan, parameters=parameters, **options
    )
