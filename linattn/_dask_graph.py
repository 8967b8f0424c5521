"""The Dask graphs of :mod:`linattn.distributed`: chunk states, their tree reduction and
exclusive scan, and every chunk's outputs (``docs/algorithm.md``, section 7).

Each chunk's attention is a sub-call through the plan (``sub_call``, given by the
caller: :func:`linattn._plan.run_call`), so this module sits below the plan and the
front door.  It needs ``dask[array]``; the public functions are in
:mod:`linattn.distributed`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from itertools import product
from typing import Any

import numpy as np

from linattn import _dispatch, fitted
from linattn._call import Call, check_state, drop_masked_keys, normalise_call, state_arrays
from linattn._checks import (
    AttentionInputs,
    check_attention_inputs,
    check_chunk_size,
    check_state_options,
    check_statistics_for_causal,
)
from linattn._dispatch import DEFAULT_CHUNK_SIZE
from linattn._xp import Array, Namespace, array_namespace, compute_dtype, constant, is_array
from linattn.causal import normalise, readout
from linattn.features import FeatureMap
from linattn.state import LinearAttentionState, absorb_keys, combine, empty_state

__all__ = [
    "DEFAULT_LOOKAHEAD",
    "attention_block",
    "batch_index",
    "bidirectional_graph",
    "blockwise",
    "causal_pipeline",
    "check_positive",
    "dask_linear_attention",
    "prepare",
]

#: Causal: how many sequence chunks the key side may run ahead of the outputs.
DEFAULT_LOOKAHEAD = 8


def dask_linear_attention(call: Call, sub_call: Any) -> Any:
    """:func:`linattn.distributed.dask_linear_attention` of one normalised call;
    ``sub_call`` runs one chunk's attention (:func:`linattn._plan.run_call`)."""
    q, k, v, feature_map, causal, key_mask, state, return_state, chunk_size, backend = call[:10]
    if not isinstance(feature_map, FeatureMap):
        raise TypeError(
            f"feature_map must be a linattn.FeatureMap; got {type(feature_map).__name__}"
        )
    extra = {}
    if state is not None:
        state_arrays(state)  # a TypeError unless it is a LinearAttentionState
        # A NumPy state (e.g. from an in-memory prefill) joins the graph as one chunk.
        state = replace(state, kv=_as_dask(state.kv), log_shift=_as_dask(state.log_shift))
        extra = state_arrays(state)
    info = check_attention_inputs(
        q, k, v, key_mask=key_mask, causal=causal, head_dim=feature_map.head_dim, extra=extra
    )
    check_chunk_size(chunk_size, DEFAULT_CHUNK_SIZE)  # (None: each block call's own)
    _dispatch.resolve_backend(backend)
    check_state_options(causal, state, return_state)
    work = compute_dtype(np, np.dtype(info.dtype))
    if state is not None:
        info = replace(info, batch_shape=check_state(state, feature_map, info, work))
    check_statistics_for_causal(feature_map.kind, feature_map.needs_calibration, causal)
    if feature_map.needs_calibration:  # in self-attention the key mask marks padded queries
        same = q.shape[-2] == k.shape[-2]
        feature_map = feature_map.calibrate(
            q, k, key_mask=key_mask, query_mask=key_mask if same else None
        )
    # Computed in the state's dtype, like linear_attention; the outputs are cast back.
    inputs = _layout(q, k, v, key_mask, info, feature_map, causal=causal, dtype=work)
    options: dict[str, Any] = {"chunk_size": chunk_size, "backend": backend, "sub_call": sub_call}
    if not causal:
        return bidirectional_graph(inputs).astype(info.dtype)
    initial = None if state is None else _packed_state(inputs, state)
    out, final = causal_pipeline(
        inputs, DEFAULT_LOOKAHEAD, initial=initial, return_state=return_state, **options
    )
    out = out.astype(info.dtype)
    if not return_state:
        return out
    previous = 0 if state is None else state.num_tokens
    return out, LinearAttentionState(
        kv=final[..., :-1],
        log_shift=final[..., -1],
        feature_map=feature_map.fingerprint,
        num_tokens=previous + info.key_length,
    )


def _as_dask(x: Any) -> Any:
    import dask.array as da

    return da.from_array(x, chunks=-1) if isinstance(x, np.ndarray) else x


def _packed_state(inputs: _Inputs, state: LinearAttentionState) -> Any:
    """The incoming state as one packed ``[S | mu]`` block per batch block of ``q``."""
    import dask.array as da

    nb = len(inputs.info.batch_shape)
    packed = da.concatenate([state.kv, state.log_shift[..., None]], axis=-1)
    packed = da.broadcast_to(packed, (*inputs.info.batch_shape, *packed.shape[-2:]))
    return packed[..., None, :, :].rechunk(
        {**dict(enumerate(inputs.q.chunks[:nb])), nb: -1, nb + 1: -1, nb + 2: -1}
    )


def bidirectional_graph(inputs: _Inputs) -> Any:
    """Chunk states of the keys, their tree reduction, and every query chunk's readout."""
    batch = batch_index(inputs.info)
    key_args = [inputs.k, (*batch, "j", "d"), inputs.v, (*batch, "j", "e")]
    if inputs.key_mask is not None:
        key_args += [inputs.key_mask, (*batch, "j")]
    states = _chunk_states(inputs, key_args)
    total = _tree_reduce(
        [_sequence_block(states, len(batch), j) for j in range(states.numblocks[len(batch)])]
    )
    return blockwise(
        _bidirectional_block,
        (*batch, "i", "e"),
        inputs.q,
        (*batch, "i", "d"),
        total[(..., 0, slice(None), slice(None))],
        (*batch, "m", "f"),
        name="linattn-broadcast-outputs",
        meta_like=inputs.q,
        dtype=inputs.q.dtype,
        new_axes={"e": inputs.info.value_dim},
        align_arrays=False,
        feature_map=inputs.spec,
    )


def causal_pipeline(
    inputs: _Inputs,
    lookahead: int,
    *,
    initial: Any = None,
    return_state: bool = False,
    **options: Any,
) -> tuple[Any, Any]:
    """Chunk states, their running combine, and each chunk's outputs from its incoming state.

    A task graph of our own, per batch block and sequence chunk ``j``:

    * ``chunk-state j``: the packed state of chunk ``j``'s keys;
    * ``incoming-state j``: the state of chunks ``< j`` -- ``initial`` (or empty), then
      the running combine ``incoming(j) = incoming(j - 1) + state(j - 1)``,
      ``O(m d)`` each;
    * ``chunk-outputs j``: ``linear_attention(..., state=incoming(j))`` on chunk ``j``;
    * ``outputs-done j``: a token; ``chunk-state j + lookahead`` waits for it.

    The heavy work, ``O(chunk (m + d) d)`` per chunk, runs in parallel.  Without the
    tokens, schedulers finish the cheap key side first and hold every chunk of ``k``
    and ``v`` until its outputs run, so memory would grow with ``L``.

    Returns the outputs and, with ``return_state``, the packed state after the last
    chunk, ``incoming(n)``, shape ``(..., m, d_v + 2)`` (else ``None``).
    """
    import dask.array as da
    from dask.array.utils import meta_from_array
    from dask.base import tokenize
    from dask.highlevelgraph import HighLevelGraph

    q, k, v, mask = inputs.q, inputs.k, inputs.v, inputs.key_mask
    nb = len(inputs.info.batch_shape)
    n = q.numblocks[nb]
    spec = inputs.spec.key
    masked = mask is not None
    token = tokenize(q, k, v, mask, spec, lookahead, initial, return_state, options)
    state_name, incoming_name, outputs_name, done_name, final_name = (
        f"linattn-{part}-{token}"
        for part in ("chunk-state", "incoming-state", "chunk-outputs", "outputs-done", "final")
    )
    graph: dict[Any, Any] = {}
    final: dict[Any, Any] = {}
    for b in product(*(range(nblocks) for nblocks in q.numblocks[:nb])):

        def incoming(j: int, b: tuple[int, ...] = b) -> tuple[Any, ...]:
            """The key holding the state of chunks ``< j``: no task for what exists."""
            if j == 0 and initial is not None:
                return (initial.name, *b, 0, 0, 0)
            if j == 1 and initial is None:
                return (state_name, *b, 0)  # empty + state(0) is state(0)
            return (incoming_name, *b, j)

        if initial is None:
            graph[incoming(0)] = (_empty_packed, (state_name, *b, 0))
        for j in range(n):
            keys = [(k.name, *b, j, 0), (v.name, *b, j, 0)]
            if masked:
                keys.append((mask.name, *b, j))
            wait = [(done_name, *b, j - lookahead)] if j >= lookahead else []
            graph[(state_name, *b, j)] = (_state_task, spec, masked, *keys, *wait)
            block = (outputs_name, *b, j, 0)
            graph[block] = (_outputs_task, spec, options, (q.name, *b, j, 0), *keys, incoming(j))
            graph[(done_name, *b, j)] = (_done, block)
        for j in range(1, n + 1 if return_state else n):
            if incoming(j)[0] == incoming_name:
                graph[incoming(j)] = (_combine_packed, incoming(j - 1), (state_name, *b, j - 1))
        if return_state:
            final[(final_name, *b, 0, 0)] = (_unpack_block, incoming(n))
    dependencies = [x for x in (q, k, v, mask, inputs.spec, initial) if x is not None]
    out: Any = da.Array(  # Any: dask's own annotations do not make it a DaskCollection
        HighLevelGraph.from_collections(outputs_name, graph, dependencies=dependencies),
        outputs_name,
        chunks=(*q.chunks[:-1], (inputs.info.value_dim,)),
        meta=meta_from_array(q, ndim=q.ndim, dtype=q.dtype),
    )
    if not return_state:
        return out, None
    width = inputs.info.value_dim + 2
    return out, da.Array(
        HighLevelGraph.from_collections(final_name, final, dependencies=[out]),
        final_name,
        chunks=(*q.chunks[:nb], (inputs.num_features,), (width,)),
        meta=meta_from_array(q, ndim=nb + 2, dtype=q.dtype),
    )


def _chunk_states(inputs: _Inputs, key_args: list[Any]) -> Any:
    """One packed state ``[S | mu]`` per (batch block, sequence chunk) of keys."""
    batch = batch_index(inputs.info)
    return blockwise(
        _chunk_state,
        (*batch, "j", "m", "f"),
        *key_args,
        name="linattn-chunk-state",
        meta_like=inputs.k,
        dtype=inputs.work_dtype,
        new_axes={"m": inputs.num_features, "f": inputs.info.value_dim + 2},
        adjust_chunks={"j": 1},
        feature_map=inputs.spec,
        masked=inputs.key_mask is not None,
    )


def _sequence_block(x: Any, nb: int, j: int) -> Any:
    """Sequence chunk ``j`` of ``x`` (all batch blocks): no copy, just the block keys."""
    return x.blocks[(slice(None),) * nb + (j,)]


# -- input preparation -----------------------------------------------------------------


@dataclass(frozen=True)
class _Inputs:
    q: Any
    k: Any
    v: Any
    key_mask: Any
    info: AttentionInputs
    work_dtype: Any
    spec: Any  # a Delayed holding the FeatureMap: one graph key shared by all tasks
    num_features: int


def prepare(
    q: Array,
    k: Array,
    v: Array,
    key_mask: Array | None,
    feature_map: FeatureMap,
    causal: bool,
    chunk_size: int | None,
    backend: str | None,
    sequence_chunks: int | None = None,
) -> _Inputs:
    """Check everything, then broadcast, promote and chunk the inputs consistently."""
    import dask.array as da

    if not isinstance(feature_map, FeatureMap):
        raise TypeError(
            f"feature_map must be a linattn.FeatureMap; got {type(feature_map).__name__}"
        )
    if feature_map.needs_calibration:
        # Statistics over the whole batch and sequence would be one more pass over the
        # inputs (and, causal, would let later tokens change earlier outputs).
        raise ValueError(
            f"distributed attention needs the {feature_map.kind!r} feature map's query/key "
            "statistics fixed in advance: expected a map from feature_map.calibrate(q, k) "
            "(e.g. on a sample) or with_statistics(...), got an uncalibrated one"
        )
    named = {"q": q, "k": k, "v": v, "key_mask": key_mask}
    arrays = {}
    for name, x in named.items():
        if x is None:
            if name == "key_mask":  # the one optional array
                continue
            raise TypeError(
                f"{name} must be an array (a Dask array or one Dask can wrap); got None"
            )
        if not is_array(x):
            raise TypeError(
                f"{name} must be a Dask array (or an array Dask can wrap); got {type(x).__name__}"
            )
        x = x if isinstance(x, da.Array) else da.asarray(x)
        if any(math.isnan(n) for n in x.shape):
            raise ValueError(
                f"{name} must have known chunk sizes; got shape {x.shape} "
                "(call compute_chunk_sizes() first)"
            )
        arrays[name] = x
    info = check_attention_inputs(
        arrays["q"],
        arrays["k"],
        arrays["v"],
        key_mask=arrays.get("key_mask"),
        causal=causal,
        head_dim=feature_map.head_dim,
    )
    check_chunk_size(chunk_size, DEFAULT_CHUNK_SIZE)  # (None: each block call's own)
    _dispatch.resolve_backend(backend)
    if sequence_chunks is not None:
        check_positive("sequence_chunks", sequence_chunks, " or None")

    return _layout(
        arrays["q"],
        arrays["k"],
        arrays["v"],
        arrays.get("key_mask"),
        info,
        feature_map,
        causal=causal,
        dtype=info.dtype,
        sequence_chunks=sequence_chunks,
    )


def _layout(
    q: Any,
    k: Any,
    v: Any,
    key_mask: Any,
    info: AttentionInputs,
    feature_map: FeatureMap,
    *,
    causal: bool,
    dtype: Any,
    sequence_chunks: int | None = None,
) -> _Inputs:
    """Checked Dask inputs broadcast to ``info.batch_shape``, cast to ``dtype`` and chunked
    consistently."""
    import dask.array as da
    from dask.delayed import delayed

    batch = info.batch_shape

    def full(x: Any, tail: tuple[int, ...]) -> Any:
        return da.broadcast_to(x, (*batch, *tail))

    q, k, v = (full(x.astype(dtype), x.shape[-2:]) for x in (q, k, v))
    mask = None if key_mask is None else full(key_mask, (info.key_length,))
    nb = len(batch)
    # Feature axes in one chunk; batch axes chunked like q; sequence axes as asked
    # (causal: keys like queries; bidirectional: values and mask like keys).
    sequence = {} if sequence_chunks is None else {nb: int(sequence_chunks)}
    # A fitted map's per-head parameters meet the head axes whole: each block's call
    # holds the map, so one block must hold every head (the other batch axes may split).
    heads = {nb - 1 - i: -1 for i in range(min(fitted.head_axes(feature_map.parameters), nb))}
    q = q.rechunk({**sequence, **heads, nb + 1: -1})
    like_q = dict(enumerate(q.chunks[:nb]))
    k = k.rechunk({**like_q, **({nb: q.chunks[nb]} if causal else sequence), nb + 1: -1})
    v = v.rechunk({**like_q, nb: k.chunks[nb], nb + 1: -1})
    if mask is not None:
        mask = mask.rechunk({**like_q, nb: k.chunks[nb]})
    # Padding may hold anything (NaN, inf): a masked key's zero weight times a NaN or inf
    # value is still NaN in its chunk state, and inf keys make NaN features; zero both.
    k, v = drop_masked_keys(array_namespace(k), k, v, mask)
    spec = delayed(feature_map, name=f"linattn-feature-map-{feature_map.fingerprint}")
    work = compute_dtype(np, np.dtype(info.dtype))
    return _Inputs(q, k, v, mask, info, work, spec, feature_map.num_features)


def check_positive(name: str, value: object, alternative: str = "") -> None:
    """``value`` is a positive integer (not a bool); ``ValueError`` naming ``name`` if not."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{name} must be a positive integer{alternative}; got {value!r}")


def batch_index(info: AttentionInputs) -> tuple[str, ...]:
    """Blockwise index letters for the leading axes (``j`` ... ``m`` are taken)."""
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    if len(info.batch_shape) > len(letters):
        raise ValueError(
            f"q, k and v may have at most {len(letters)} leading dimensions; "
            f"got {len(info.batch_shape)}"
        )
    return tuple(letters[: len(info.batch_shape)])


def blockwise(
    func: Any,
    out_ind: tuple[str, ...],
    *args: Any,
    name: str,
    meta_like: Any,
    dtype: Any,
    **kwargs: Any,
) -> Any:
    """``dask.array.blockwise`` with our defaults: whole contracted blocks, explicit meta."""
    import dask.array as da
    from dask.array.utils import meta_from_array

    options = {
        key: kwargs.pop(key)
        for key in ("new_axes", "adjust_chunks", "align_arrays")
        if key in kwargs
    }
    return da.blockwise(
        func,
        "".join(out_ind),
        *[a if i % 2 == 0 else "".join(a) for i, a in enumerate(args)],
        token=name,
        concatenate=True,
        meta=meta_from_array(meta_like, ndim=len(out_ind), dtype=dtype),
        **options,
        **kwargs,
    )


# -- the state graph -------------------------------------------------------------------


def _tree_reduce(states: list[Any]) -> Any:
    """Combine all chunk states pairwise, ``log2(n)`` levels deep."""
    while len(states) > 1:
        paired = [_combine(states[i], states[i + 1]) for i in range(0, len(states) - 1, 2)]
        states = paired + states[len(states) - len(states) % 2 :]
    return states[0]


def _combine(first: Any, second: Any) -> Any:
    return _map_state(_combine_packed, first, second, name="linattn-combine")


def _map_state(func: Any, *states: Any, name: str) -> Any:
    import dask.array as da

    return da.map_blocks(func, *states, dtype=states[0].dtype, token=name)


# -- what the workers run --------------------------------------------------------------


def attention_block(
    q: Array, k: Array, v: Array, *mask: Array, feature_map: Any, causal: bool, **options: Any
) -> Array:
    """:func:`linattn.linear_attention` on one block; ``mask`` holds the key mask, if any."""
    key_mask = mask[0] if mask else None
    sub_call = options.pop("sub_call")
    call = normalise_call(q, k, v, feature_map, causal=causal, key_mask=key_mask, **options)
    return sub_call(call)[0]


def _chunk_state(k: Array, v: Array, *rest: Array, feature_map: Any, masked: bool) -> Array:
    """The packed state ``[S | mu]`` of one chunk of keys, shape ``(..., 1, m, d_v + 2)``.

    ``rest`` holds the key mask (if ``masked``), then tokens of tasks to wait for.
    """
    fm = feature_map
    xp = array_namespace(k)
    # (no exact parts on this graph: a fitted map's far weight cancels)
    log_phi_k, sign_k = fm.far_cancelled().signed_log_features(k, role="key")
    if masked:
        log_phi_k = xp.where(rest[0][..., None], log_phi_k, constant(xp, -math.inf, log_phi_k))
    values = xp.astype(v, log_phi_k.dtype)
    values_aug = xp.concat([values, xp.ones_like(values[..., :1])], axis=-1)
    kv, log_shift = empty_state(
        xp, tuple(k.shape[:-2]), fm.num_features, int(v.shape[-1]), log_phi_k
    )
    kv, log_shift = absorb_keys(xp, kv, log_shift, log_phi_k, sign_k, values_aug)
    return _pack(xp, kv, log_shift)[..., None, :, :]


def _bidirectional_block(q: Array, total: Array, *, feature_map: Any) -> Array:
    """Outputs of one query chunk from the state of all keys."""
    fm = feature_map
    xp = array_namespace(q)
    kv, log_shift = _unpack(total)
    log_phi_q, sign_q = fm.signed_log_features(q, role="query")
    return xp.astype(
        normalise(xp, readout(xp, kv, log_shift, log_phi_q, sign_q)), q.dtype, copy=False
    )


def _causal_block(
    q: Array, k: Array, v: Array, *rest: Array, feature_map: Any, **options: Any
) -> Array:
    """Outputs of one sequence chunk, continuing from the state of all earlier chunks.

    ``rest`` holds the key mask (if any), then the packed incoming state.
    """
    kv, log_shift = _unpack(rest[-1][..., 0, :, :])
    state = LinearAttentionState(kv=kv, log_shift=log_shift, feature_map=feature_map.fingerprint)
    return attention_block(
        q, k, v, *rest[:-1], feature_map=feature_map, causal=True, state=state, **options
    )


def _state_task(feature_map: Any, masked: bool, *arrays: Array) -> Array:
    return _chunk_state(*arrays, feature_map=feature_map, masked=masked)


def _outputs_task(feature_map: Any, options: dict[str, Any], *arrays: Array) -> Array:
    return _causal_block(*arrays, feature_map=feature_map, **options)


def _done(block: Array) -> None:
    """A token for a finished block: what waits on it needs no data."""


def _combine_packed(first: Array, second: Array) -> Array:
    xp = array_namespace(first)
    return _pack(xp, *combine(xp, _unpack(first), _unpack(second)))


def _empty_packed(like: Array) -> Array:
    xp = array_namespace(like)
    kv, log_shift = _unpack(like)
    return _pack(xp, xp.zeros_like(kv), xp.full_like(log_shift, -math.inf))


def _unpack_block(packed: Array) -> Array:
    """``(..., 1, m, d_v + 2)`` to ``(..., m, d_v + 2)``: a packed block without its chunk axis."""
    return packed[..., 0, :, :]


def _pack(xp: Namespace, kv: Array, log_shift: Array) -> Array:
    return xp.concat([kv, log_shift[..., None]], axis=-1)


def _unpack(packed: Array) -> tuple[Array, Array]:
    return packed[..., :-1], packed[..., -1]
