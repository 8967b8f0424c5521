"""Batch- and sequence-parallel linear attention on Dask arrays.

Two ways to spread linear attention over a Dask cluster (``docs/algorithm.md``, section 7):

* :func:`batch_parallel_attention` -- data parallelism.  Whole sequences are the unit
  of work: the leading (batch, head) axes keep their chunks, each block runs
  :func:`linattn.linear_attention` on the worker (with the compiled kernel where one
  serves the block's array type), and no block talks to another.
* :func:`sequence_parallel_attention` -- sequence (context) parallelism for sequences
  longer than one worker holds.  Each sequence chunk reduces its keys to the
  stabilised state ``(S, mu)`` of :mod:`linattn.state`, of size ``m x (d_v + 1)``
  whatever the chunk length; the states meet in a task graph built from the
  associative :func:`linattn.combine` -- a tree reduction (bidirectional) or
  an exclusive scan (causal) -- and every chunk then computes its outputs from the
  state of everything before it (causal) or of all keys (bidirectional).

Work per task is ``O(chunk (m + d) d)`` and traffic ``O(n_chunks m d)``: no task ever
holds more than one chunk of the sequence, and in the causal case the key side runs
at most ``lookahead`` chunks ahead of the outputs, so the chunks waiting in memory
do not grow with ``L`` either.  Both functions are lazy (they only build
a graph) and run on any Dask scheduler, the default threads one or a
``dask.distributed.Client``.

On the wire a state travels packed as one array ``[S | mu]`` of shape
``(..., 1, m, d_v + 2)``, and the feature map as one graph key shared by all tasks.

This module is not imported by :mod:`linattn`; it needs ``dask[array]``.
"""

from __future__ import annotations

from typing import Any

from linattn import _dask_graph as graph
from linattn._call import Call
from linattn._plan import run_call
from linattn._xp import Array
from linattn.features import FeatureMap
from linattn.state import LinearAttentionState

__all__ = ["batch_parallel_attention", "dask_linear_attention", "sequence_parallel_attention"]

DEFAULT_LOOKAHEAD = graph.DEFAULT_LOOKAHEAD


def batch_parallel_attention(
    q: Array,
    k: Array,
    v: Array,
    /,
    feature_map: FeatureMap,
    *,
    causal: bool = False,
    key_mask: Array | None = None,
    chunk_size: int | None = None,
    backend: str | None = None,
) -> Array:
    """Linear attention with whole sequences as the unit of work (data parallelism).

    The leading axes keep the chunks of ``q`` (after broadcasting against ``k``, ``v``
    and ``key_mask``); the sequence and feature axes are gathered into one chunk, so
    each task holds whole sequences of its block of the batch and calls
    :func:`linattn.linear_attention` on them.

    Parameters
    ----------
    q : dask array, shape ``(..., L_q, d)``
    k : dask array, shape ``(..., L_k, d)``
    v : dask array, shape ``(..., L_k, d_v)``
        Leading dimensions broadcast.  Other arrays (NumPy, CuPy) are wrapped with
        ``dask.array.asarray``.  Inputs are promoted to one floating dtype.
    feature_map : FeatureMap
        The features; ``feature_map.head_dim`` must equal ``d``.
    causal, key_mask, chunk_size, backend
        As for :func:`linattn.linear_attention`; ``backend`` chooses who runs each
        block on the workers.

    Returns
    -------
    dask array, shape ``(..., L_q, d_v)``
        Lazy; chunked like ``q`` along the leading axes.

    Examples
    --------
    >>> import dask.array as da
    >>> import numpy as np
    >>> import linattn as la
    >>> from linattn.distributed import batch_parallel_attention
    >>> x = np.random.default_rng(0).normal(size=(4, 32, 8))
    >>> q = da.from_array(x, chunks=(1, 32, 8))  # one sequence per task
    >>> fm = la.FeatureMap(8, 16, seed=0)
    >>> out = batch_parallel_attention(q, q, q, fm, causal=True)
    >>> out.chunks
    ((1, 1, 1, 1), (32,), (8,))
    >>> bool(np.allclose(out.compute(), la.linear_attention(x, x, x, fm, causal=True)))
    True
    """
    inputs = graph.prepare(q, k, v, key_mask, feature_map, causal, chunk_size, backend)
    whole = {-2: -1, -1: -1}
    q, k, v = (a.rechunk(whole) for a in (inputs.q, inputs.k, inputs.v))
    mask = None if inputs.key_mask is None else inputs.key_mask.rechunk({-1: -1})
    batch = graph.batch_index(inputs.info)
    args = [q, (*batch, "i", "d"), k, (*batch, "j", "d"), v, (*batch, "j", "e")]
    if mask is not None:
        args += [mask, (*batch, "j")]
    return graph.blockwise(
        graph.attention_block,
        (*batch, "i", "e"),
        *args,
        name="linattn-batch-parallel",
        meta_like=q,
        dtype=inputs.info.dtype,
        feature_map=inputs.spec,
        causal=causal,
        chunk_size=chunk_size,
        backend=backend,
        sub_call=run_call,
    )


def sequence_parallel_attention(
    q: Array,
    k: Array,
    v: Array,
    /,
    feature_map: FeatureMap,
    *,
    causal: bool = False,
    key_mask: Array | None = None,
    sequence_chunks: int | None = None,
    lookahead: int = DEFAULT_LOOKAHEAD,
    chunk_size: int | None = None,
    backend: str | None = None,
) -> Array:
    """Linear attention with the sequence axis split across tasks (sequence parallelism).

    Each sequence chunk reduces its keys to a state ``(S, mu)`` of size
    ``m x (d_v + 1)``.  Bidirectional: the chunk states are combined by a tree
    reduction and the total is broadcast to every query chunk.  Causal: an exclusive
    scan over the chunk states (a running combine) gives each chunk the state of all
    tokens before it, from which it computes its outputs with
    ``linear_attention(..., state=...)``.
    Both use the stabilised, associative :func:`linattn.combine`, so the
    result equals the in-memory computation up to rounding.

    Parameters
    ----------
    q, k, v, feature_map, causal, key_mask
        As for :func:`batch_parallel_attention`.
    sequence_chunks : int, optional
        Tokens per sequence chunk (one task each).  Default: the chunks ``q`` (and,
        bidirectional, ``k``) already have along the sequence axis; causal
        attention gives ``k``, ``v`` and ``key_mask`` the sequence chunks of ``q``.
    lookahead : int, default 8
        Causal only: how many sequence chunks the key side (chunk states) may run
        ahead of the outputs.  Chunks of ``k`` and ``v`` wait in memory from their
        state to their outputs, so this bounds memory independently of ``L``; give
        it at least the number of worker threads to keep them all busy.
    chunk_size, backend
        As for :func:`linattn.linear_attention`, inside each sequence chunk.

    Returns
    -------
    dask array, shape ``(..., L_q, d_v)``
        Lazy; chunked like ``q`` along the leading and sequence axes.

    Examples
    --------
    >>> import dask.array as da
    >>> import numpy as np
    >>> import linattn as la
    >>> from linattn.distributed import sequence_parallel_attention
    >>> x = np.random.default_rng(0).normal(size=(2, 1000, 8))
    >>> q = da.from_array(x, chunks=(2, 300, 8))  # four sequence chunks
    >>> fm = la.FeatureMap(8, 16, seed=0)
    >>> out = sequence_parallel_attention(q, q, q, fm, causal=True)
    >>> out.chunks
    ((2,), (300, 300, 300, 100), (8,))
    >>> expected = la.linear_attention(x, x, x, fm, causal=True)
    >>> bool(np.abs(out.compute() - expected).max() < 1e-12)
    True
    """
    graph.check_positive("lookahead", lookahead)
    inputs = graph.prepare(
        q, k, v, key_mask, feature_map, causal, chunk_size, backend, sequence_chunks
    )
    if causal:
        options: dict[str, Any] = {
            "chunk_size": chunk_size,
            "backend": backend,
            "sub_call": run_call,
        }
        return graph.causal_pipeline(inputs, int(lookahead), **options)[0]
    return graph.bidirectional_graph(inputs)


def dask_linear_attention(
    q: Array,
    k: Array,
    v: Array,
    /,
    feature_map: FeatureMap,
    *,
    causal: bool = False,
    key_mask: Array | None = None,
    state: LinearAttentionState | None = None,
    return_state: bool = False,
    chunk_size: int | None = None,
    backend: str | None = None,
) -> Any:
    """:func:`linattn.linear_attention` for Dask arrays, as a graph over their sequence chunks.

    What ``linear_attention`` does with Dask inputs: the same arguments, checks and
    results (up to rounding), but the graph grows with the number of sequence chunks
    of the inputs, not with ``L / chunk_size``.  Causal attention is the sequence-
    parallel scan of :func:`sequence_parallel_attention` (chunk states, their running
    combine, starting from ``state`` if given, and each chunk's outputs from the state
    before it); bidirectional attention reduces the key chunks' states to one and reads
    it out in every query chunk.  Inside each chunk, ``linear_attention`` runs on the
    chunk's own arrays (with the compiled kernel where one serves them).

    Parameters
    ----------
    q, k, v : dask arrays
        As for :func:`linattn.linear_attention` (all three Dask arrays).
    feature_map, causal, key_mask, return_state, chunk_size, backend
        As for :func:`linattn.linear_attention`.  ``key_mask`` is a Dask array; an
        uncalibrated feature map (bidirectional only) is calibrated on ``q`` and ``k``
        before the graph is built, which computes their statistics.
    state : LinearAttentionState, optional
        Continue a causal sequence; its arrays may be NumPy or Dask arrays.

    Returns
    -------
    dask array, shape ``(..., L_q, d_v)``, or ``(dask array, LinearAttentionState)``
        Lazy, in the inputs' (promoted) dtype, chunked like ``q`` along the leading and
        sequence axes (the value axis in one chunk).  Causal attention gives ``k``,
        ``v`` and ``key_mask`` the sequence chunks of ``q``; bidirectional attention
        keeps those of ``k``.  The state's ``kv`` and ``log_shift`` are Dask arrays.

    Examples
    --------
    >>> import dask.array as da
    >>> import numpy as np
    >>> import linattn as la
    >>> from linattn.distributed import dask_linear_attention
    >>> x = np.random.default_rng(0).normal(size=(2, 1000, 8))
    >>> q = da.from_array(x, chunks=(1, 250, 8))
    >>> fm = la.FeatureMap(8, 16, seed=0)
    >>> out, state = dask_linear_attention(q, q, q, fm, causal=True, return_state=True)
    >>> out.chunks
    ((1, 1), (250, 250, 250, 250), (8,))
    >>> expected, last = la.linear_attention(x, x, x, fm, causal=True, return_state=True)
    >>> bool(np.abs(out.compute() - expected).max() < 1e-12)
    True
    >>> bool(np.allclose(state.kv.compute(), last.kv, rtol=1e-12)), state.num_tokens
    (True, 1000)
    """
    call = Call(q, k, v, feature_map, causal, key_mask, state, return_state, chunk_size, backend)
    return graph.dask_linear_attention(call, run_call)
