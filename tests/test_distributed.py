"""Batch- and sequence-parallel attention on Dask: equal to the in-memory result, lazy, and
unchanged when a worker dies mid-computation.

Runs when the ``dask`` backend is selected (``LINATTN_TEST_BACKENDS``, see conftest).  One
``distributed.LocalCluster`` with two worker processes serves the whole module.
"""

from __future__ import annotations

import functools
import os
import signal
import time

import numpy as np
import pytest

import linattn as la
from linattn.features import kind_spec

pytestmark = pytest.mark.needs("dask")

dask = pytest.importorskip("dask")
da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")

from linattn.distributed import (  # noqa: E402
    batch_parallel_attention,
    sequence_parallel_attention,
)

B, H, D, DV, M = 2, 3, 8, 6, 16
FLOAT64 = {"rtol": 1e-10, "atol": 1e-12}
FM = la.FeatureMap(D, M, seed=3)
# lookahead=2 < the number of chunks: the causal key side is held back.
PARALLEL = {
    "batch": batch_parallel_attention,
    "sequence": functools.partial(sequence_parallel_attention, lookahead=2),
}
# Sequence chunkings that divide L = 96 and that do not (L = 100).
CHUNKINGS = {"divides": (96, 32), "ragged": (100, 32)}


@pytest.fixture(scope="module")
def client():
    with (
        distributed.LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            processes=True,
            memory_limit="1GiB",
            dashboard_address=":0",
        ) as cluster,
        distributed.Client(cluster, set_as_default=False) as client,
    ):
        yield client


def _inputs(length: int, seed: int = 0) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    q = 0.5 * rng.normal(size=(B, H, length, D))
    k = 0.5 * rng.normal(size=(B, H, length, D))
    v = rng.normal(size=(B, H, length, DV))
    mask = rng.random((B, H, length)) > 0.25
    mask[0, 0, : length // 2] = False  # whole chunks without a key: empty states
    mask[1, 2, :] = False  # a sequence without any key: zeros
    return q, k, v, mask


def _lazy(x: np.ndarray, sequence_chunk: int) -> da.Array:
    """Batch in blocks of one sequence, the sequence in chunks of ``sequence_chunk``."""
    return da.from_array(x, chunks=(1, 2, sequence_chunk, *x.shape[3:]))


@pytest.mark.parametrize("chunking", sorted(CHUNKINGS))
@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("parallel", sorted(PARALLEL))
def test_equals_in_memory_on_cluster(client, parallel, causal, masked, chunking):
    length, chunk = CHUNKINGS[chunking]
    q, k, v, mask = _inputs(length)
    mask = mask if masked else None
    expected = la.linear_attention(q, k, v, FM, causal=causal, key_mask=mask)
    lazy = [_lazy(x, chunk) for x in (q, k, v)]
    out = PARALLEL[parallel](
        *lazy, FM, causal=causal, key_mask=None if mask is None else _lazy(mask, chunk)
    )
    assert isinstance(out, da.Array)
    if parallel == "sequence":
        assert out.chunks[2] == lazy[0].chunks[2]
    actual = client.compute(out).result()
    assert isinstance(actual, np.ndarray)
    assert actual.dtype == np.float64
    np.testing.assert_allclose(actual, expected, **FLOAT64)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_sequence_parallel_broadcasts_and_rechunks(client, causal):
    """Keys shared across heads, a mask per batch entry, and ``sequence_chunks``."""
    q, k, v, mask = _inputs(90, seed=1)
    k, v, mask = k[:, :1], v[:, :1], mask[:, :1]
    expected = la.linear_attention(q, k, v, FM, causal=causal, key_mask=mask)
    out = sequence_parallel_attention(
        da.from_array(q, chunks=(1, 3, 45, D)),
        da.from_array(k, chunks=(2, 1, 30, D)),
        v,  # a NumPy array: wrapped as one chunk, then chunked like q
        FM,
        causal=causal,
        key_mask=da.from_array(mask),
        sequence_chunks=20,
    )
    assert out.chunks[2] == (20, 20, 20, 20, 10)
    np.testing.assert_allclose(client.compute(out).result(), expected, **FLOAT64)


def test_bidirectional_queries_and_keys_of_different_lengths(client):
    q = _inputs(70, seed=2)[0]
    _, k, v, mask = _inputs(100, seed=3)
    expected = la.linear_attention(q, k, v, FM, key_mask=mask)
    out = sequence_parallel_attention(
        _lazy(q, 25), _lazy(k, 32), _lazy(v, 32), FM, key_mask=_lazy(mask, 40)
    )
    assert out.chunks[2] == (25, 25, 20)
    np.testing.assert_allclose(client.compute(out).result(), expected, **FLOAT64)


@pytest.mark.parametrize("kind", sorted(la.KINDS))
def test_every_feature_kind_travels_to_the_workers(client, kind):
    """The feature map is pickled to the worker processes with all its state
    (OPRF ``A`` and rebalancing scales included)."""
    q, k, v, mask = _inputs(64, seed=8)
    random = kind_spec(kind).random
    fm = la.FeatureMap(D, M if random else D, kind=kind, seed=2, rebalance=kind == "positive")
    if fm.needs_calibration:
        fm = fm.calibrate(q, k)
    expected = la.linear_attention(q, k, v, fm, causal=True, key_mask=mask)
    out = sequence_parallel_attention(
        *(_lazy(x, 16) for x in (q, k, v)), fm, causal=True, key_mask=_lazy(mask, 16)
    )
    np.testing.assert_allclose(client.compute(out).result(), expected, **FLOAT64)


@pytest.mark.parametrize("scheduler", ["sync", "threads"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_default_schedulers_signed_features_and_float32(scheduler, causal):
    """Trigonometric (signed) features in float64, and float32 inputs, without a cluster."""
    q, k, v, mask = _inputs(100, seed=4)
    trig = la.FeatureMap(D, M, kind="trigonometric", seed=1)
    expected = la.linear_attention(q, k, v, trig, causal=causal, key_mask=mask)
    out = sequence_parallel_attention(
        *(_lazy(x, 32) for x in (q, k, v)), trig, causal=causal, key_mask=_lazy(mask, 32)
    )
    np.testing.assert_allclose(out.compute(scheduler=scheduler), expected, **FLOAT64)

    q32, k32, v32 = (x.astype(np.float32) for x in (q, k, v))
    expected = la.linear_attention(q32, k32, v32, FM, causal=causal, key_mask=mask)
    for parallel in PARALLEL.values():
        out = parallel(*(_lazy(x, 32) for x in (q32, k32, v32)), FM, causal=causal, key_mask=mask)
        actual = out.compute(scheduler=scheduler)
        assert actual.dtype == np.float32
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)


def _gate(event: str):
    """A block function that waits for ``event`` without holding a worker thread.

    Made here, not at module level, so that it is pickled by value: the workers
    cannot import this test module.
    """

    def gate(block: np.ndarray) -> np.ndarray:
        distributed.secede()
        distributed.Event(event).wait()
        distributed.rejoin()
        return block

    return gate


def test_worker_killed_mid_computation_does_not_change_the_result(client):
    length, chunk = 256, 32
    q, k, v, mask = _inputs(length, seed=5)
    expected = la.linear_attention(q, k, v, FM, causal=True, key_mask=mask)
    event = f"linattn-gate-{time.monotonic_ns()}"
    gated_q = _lazy(q, chunk).map_blocks(_gate(event), dtype=q.dtype)
    out = sequence_parallel_attention(
        gated_q, _lazy(k, chunk), _lazy(v, chunk), FM, causal=True, key_mask=_lazy(mask, chunk)
    )
    pids = client.run(os.getpid)
    victim = sorted(pids)[0]
    future = client.compute(out)
    # Wait until the victim holds chunk states the outputs still need.
    deadline = time.monotonic() + 60
    while not any("linattn-chunk-state" in str(key) for key in client.has_what()[victim]):
        assert time.monotonic() < deadline, "the victim never received a chunk state"
        time.sleep(0.05)
    assert not future.done()
    os.kill(pids[victim], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while victim in client.scheduler_info()["workers"]:
        assert time.monotonic() < deadline, "the scheduler never noticed the dead worker"
        time.sleep(0.05)
    distributed.Event(event, client=client).set()
    np.testing.assert_allclose(future.result(timeout=120), expected, **FLOAT64)
    client.wait_for_workers(2, timeout=60)


def _forbidden(*args, **kwargs):
    raise AssertionError("computation was triggered while building the graph")


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_building_the_graph_computes_nothing(causal):
    q, k, v, mask = (_lazy(x, 32) for x in _inputs(100, seed=6))
    with dask.config.set(scheduler=_forbidden):
        outs = [
            parallel(q, k, v, FM, causal=causal, key_mask=mask) for parallel in PARALLEL.values()
        ]
        outs.append(la.linear_attention(q, k, v, FM, causal=causal, key_mask=mask))
        outs.append(la.softmax_attention(q, k, v, causal=causal, key_mask=mask))
        for out in outs:
            assert isinstance(out, da.Array)
            assert out.shape == (B, H, 100, DV)
            assert out.dtype == np.float64
        with pytest.raises(AssertionError, match="triggered"):
            outs[0].compute()


def test_causal_task_graph_reads_one_chunk_per_task_and_throttles_the_key_side():
    """Every task reads one sequence chunk of the inputs (or states); chunk states wait
    for the outputs ``lookahead`` chunks back."""
    from dask.core import get_dependencies

    q, k, v = (_lazy(x, 10) for x in _inputs(100, seed=7)[:3])
    out = sequence_parallel_attention(q, k, v, FM, causal=True, lookahead=3)
    assert out.chunks == ((1, 1), (2, 1), (10,) * 10, (DV,))
    graph = dict(out.__dask_graph__())
    inputs = {q.name, k.name, v.name}
    tasks = {}
    for key in graph:
        if isinstance(key, tuple) and key[0].startswith("linattn-"):
            tasks.setdefault(key[0].rsplit("-", 1)[0], []).append(key)
    assert {name: len(keys) for name, keys in tasks.items()} == {
        "linattn-chunk-state": 40,
        "linattn-incoming-state": 36,  # the empty state, then n - 2 running combines
        "linattn-chunk-outputs": 40,
        "linattn-outputs-done": 40,
    }
    for key in tasks["linattn-chunk-state"] + tasks["linattn-chunk-outputs"]:
        chunk = key[3]
        deps = get_dependencies(graph, key)
        assert {d[3] for d in deps if d[0] in inputs} == {chunk}
        if key[0].startswith("linattn-chunk-state"):
            waits = [d for d in deps if d[0].startswith("linattn-outputs-done")]
            assert waits == ([(waits[0][0], *key[1:3], chunk - 3)] if chunk >= 3 else [])


def test_bad_input_is_named():
    q = _lazy(_inputs(32)[0], 16)
    with pytest.raises(TypeError, match=r"feature_map must be a linattn\.FeatureMap"):
        sequence_parallel_attention(q, q, q, "features")
    with pytest.raises(TypeError, match="k must be a Dask array"):
        sequence_parallel_attention(q, [[1.0]], q, FM)
    with pytest.raises(ValueError, match="sequence_chunks must be a positive integer"):
        sequence_parallel_attention(q, q, q, FM, sequence_chunks=0)
    with pytest.raises(ValueError, match="lookahead must be a positive integer"):
        sequence_parallel_attention(q, q, q, FM, causal=True, lookahead=0)
    with pytest.raises(ValueError, match="head dimension 8"):
        batch_parallel_attention(q[..., :4], q[..., :4], q, FM)
    with pytest.raises(TypeError, match="key_mask must be a boolean array"):
        batch_parallel_attention(q, q, q, FM, key_mask=q[..., 0])
    with pytest.raises(ValueError, match="statistics fixed in advance"):
        batch_parallel_attention(q, q, q, la.FeatureMap(D, M, kind="oprf"))
    with pytest.raises(ValueError, match="chunk_size must be a positive integer"):
        batch_parallel_attention(q, q, q, FM, chunk_size=0)
    rows = q[0, 0]
    unknown = rows[rows[:, 0] > 0]
    with pytest.raises(ValueError, match="q must have known chunk sizes"):
        sequence_parallel_attention(unknown, unknown, unknown, FM)


@pytest.mark.parametrize("poison", [np.nan, np.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("poisoned", ["k", "v", "kv"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("parallel", sorted(PARALLEL))
def test_padding_may_hold_nan_and_inf(parallel, causal, poisoned, poison):
    """Masked keys (tokens 12-17, inside the second of four sequence chunks) whose keys
    or values hold NaN or inf give the outputs of the same call with ordinary padding."""
    q, k, v, _ = _inputs(40, seed=9)
    mask = np.ones((B, H, 40), dtype=bool)
    mask[..., 12:18] = False
    expected = la.linear_attention(q, k, v, FM, causal=causal, key_mask=mask)
    k, v = k.copy(), v.copy()
    for name in poisoned:
        {"k": k, "v": v}[name][..., 12:18, :] = poison
    out = PARALLEL[parallel](
        *(_lazy(x, 10) for x in (q, k, v)), FM, causal=causal, key_mask=_lazy(mask, 10)
    )
    actual = out.compute(scheduler="sync")
    assert np.isfinite(actual).all()
    np.testing.assert_allclose(actual, expected, **FLOAT64)


@pytest.mark.parametrize("parallel", sorted(PARALLEL))
@pytest.mark.parametrize("missing", ["q", "k", "v"])
def test_none_for_an_array_is_named(parallel, missing):
    arrays = {name: _lazy(x, 16) for name, x in zip("qkv", _inputs(32)[:3], strict=True)}
    arrays[missing] = None
    with pytest.raises(TypeError, match=rf"^{missing} must be an array .*; got None$"):
        PARALLEL[parallel](*arrays.values(), FM)


@pytest.mark.parametrize("shape", [(B, H, 31), (B, H, 32, 1), (40,)], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("parallel", sorted(PARALLEL))
def test_key_mask_of_the_wrong_length_is_named(parallel, causal, shape):
    q = _lazy(_inputs(32)[0], 16)
    mask = da.ones(shape, dtype=bool)
    expected = rf"key_mask must have shape \(\.\.\., 32\) .*; got shape \({shape[0]},"
    with pytest.raises(ValueError, match=expected):
        PARALLEL[parallel](q, q, q, FM, causal=causal, key_mask=mask)


@pytest.mark.parametrize("parallel", sorted(PARALLEL))
def test_key_mask_whose_batch_does_not_broadcast_is_named(parallel):
    q = _lazy(_inputs(32)[0], 16)
    mask = da.ones((B, H + 1, 32), dtype=bool)
    with pytest.raises(ValueError, match=rf"must broadcast .*key_mask \({B}, {H + 1}\)"):
        PARALLEL[parallel](q, q, q, FM, key_mask=mask)
