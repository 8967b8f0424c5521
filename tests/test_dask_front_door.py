"""``linear_attention`` on Dask arrays: the NumPy results from a graph over the inputs'
sequence chunks, whose size does not depend on ``L / chunk_size``, built without computing.

Runs when the ``dask`` backend is selected (``LINATTN_TEST_BACKENDS``, see conftest).  The
threaded scheduler's default is kept out: results are computed with ``scheduler="sync"``.
"""

from __future__ import annotations

import numpy as np
import pytest

import linattn as la

pytestmark = pytest.mark.needs("dask")

dask = pytest.importorskip("dask")
da = pytest.importorskip("dask.array")

from linattn.distributed import dask_linear_attention  # noqa: E402

B, H, D, DV, M = 2, 3, 8, 6, 16
FLOAT64 = {"rtol": 1e-10, "atol": 1e-12}
FM = la.FeatureMap(D, M, seed=3)
# L = 100 in chunks of 32: a ragged last chunk.
LENGTH, CHUNK = 100, 32


def _inputs(length: int = LENGTH, seed: int = 0, *, masked: bool = True) -> dict[str, np.ndarray]:
    """Queries per head; keys, values and mask shared by the heads (broadcast), padded
    keys poisoned with NaN and inf, a sequence without keys and a masked first chunk."""
    rng = np.random.default_rng(seed)
    k = 0.5 * rng.normal(size=(B, 1, length, D))
    v = rng.normal(size=(B, 1, length, DV))
    mask = rng.random((B, 1, length)) > 0.25
    mask[0, 0, :40] = False  # whole chunks without a key: empty chunk states
    mask[1, 0, :] = False  # a sequence without any key: zeros
    q = 0.5 * rng.normal(size=(B, H, length, D))
    if not masked:
        return {"q": q, "k": k, "v": v}
    k[~mask], v[~mask] = np.nan, np.inf
    return {"q": q, "k": k, "v": v, "key_mask": mask}


def _lazy(x: np.ndarray, chunk: int = CHUNK, *, axis: int = -2) -> da.Array:
    """The sequence axis in chunks of ``chunk`` tokens, one batch entry per block."""
    chunks = list(x.shape)
    chunks[axis] = chunk
    if x.ndim > 2:
        chunks[0] = 1
    return da.from_array(x, chunks=tuple(chunks))


def _lazy_all(arrays: dict[str, np.ndarray], chunk: int = CHUNK) -> dict[str, da.Array]:
    return {
        name: _lazy(x, chunk, axis=-1 if name == "key_mask" else -2) for name, x in arrays.items()
    }


def _call(function, arrays, fm=FM, **options):
    options = {"key_mask": arrays.get("key_mask"), **options}
    return function(arrays["q"], arrays["k"], arrays["v"], fm, **options)


def _assert_same_state(actual: la.LinearAttentionState, expected: la.LinearAttentionState):
    assert isinstance(actual.kv, da.Array)
    assert isinstance(actual.log_shift, da.Array)
    assert actual.feature_map == expected.feature_map
    assert actual.num_tokens == expected.num_tokens
    kv, log_shift = dask.compute(actual.kv, actual.log_shift, scheduler="sync")
    np.testing.assert_allclose(kv, expected.kv, **FLOAT64)
    np.testing.assert_allclose(log_shift, expected.log_shift, **FLOAT64)  # -inf included


@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_equals_numpy(causal, masked):
    arrays = _inputs(masked=masked)
    expected = _call(la.linear_attention, arrays, causal=causal)
    out = _call(dask_linear_attention, _lazy_all(arrays), causal=causal)
    assert isinstance(out, da.Array)
    actual = out.compute(scheduler="sync")
    assert actual.dtype == np.float64
    np.testing.assert_allclose(actual, expected, **FLOAT64)


@pytest.mark.parametrize("lazy_state", [False, True], ids=["numpy-state", "dask-state"])
def test_continues_a_state_and_returns_the_numpy_state(lazy_state):
    """Prefix and continuation: the incoming state (NumPy, or lazy from an earlier call)
    enters the scan; the returned state equals NumPy's.  The prefix state has batch
    ``(H,)`` only, broadcast against the continuation's ``(B, H)``."""
    arrays = _inputs()
    prefix = {name: x[0, :, 40:70] for name, x in _inputs(seed=1).items()}
    expected_prefix, numpy_state = _call(
        la.linear_attention, prefix, causal=True, return_state=True
    )
    state = numpy_state
    if lazy_state:
        lazy_prefix = {
            name: _lazy(x, 10, axis=-1 if name == "key_mask" else -2) for name, x in prefix.items()
        }
        prefix_out, state = _call(
            dask_linear_attention, lazy_prefix, causal=True, return_state=True
        )
        np.testing.assert_allclose(
            prefix_out.compute(scheduler="sync"), expected_prefix, **FLOAT64
        )
        _assert_same_state(state, numpy_state)
    expected, expected_state = _call(
        la.linear_attention, arrays, causal=True, state=numpy_state, return_state=True
    )
    out, new_state = _call(
        dask_linear_attention, _lazy_all(arrays), causal=True, state=state, return_state=True
    )
    assert out.chunks[:3] == ((1, 1), (H,), (32, 32, 32, 4))
    np.testing.assert_allclose(out.compute(scheduler="sync"), expected, **FLOAT64)
    assert new_state.kv.chunks[:2] == ((1, 1), (H,))
    _assert_same_state(new_state, expected_state)


@pytest.mark.parametrize("chunk", [100, 7], ids=["one-chunk", "fifteen-chunks"])
def test_return_state_without_incoming_state(chunk):
    arrays = _inputs()
    expected, expected_state = _call(la.linear_attention, arrays, causal=True, return_state=True)
    out, state = _call(
        dask_linear_attention, _lazy_all(arrays, chunk), causal=True, return_state=True
    )
    np.testing.assert_allclose(out.compute(scheduler="sync"), expected, **FLOAT64)
    _assert_same_state(state, expected_state)


def test_uncalibrated_map_is_calibrated_from_the_call_for_bidirectional_attention():
    arrays = _inputs()
    oprf = la.FeatureMap(D, M, kind="hyperbolic_oprf", rebalance=True, seed=1)
    expected = _call(la.linear_attention, arrays, oprf)
    out = _call(dask_linear_attention, _lazy_all(arrays), oprf)
    np.testing.assert_allclose(out.compute(scheduler="sync"), expected, **FLOAT64)


def test_dtypes_promote_like_numpy():
    arrays = _inputs(masked=False)
    arrays["q"] = arrays["q"].astype(np.float32)  # float32 with float64: float64
    expected = _call(la.linear_attention, arrays, causal=True)
    out = _call(dask_linear_attention, _lazy_all(arrays), causal=True)
    assert out.dtype == np.float64
    np.testing.assert_allclose(out.compute(scheduler="sync"), expected, **FLOAT64)
    single = {n: x.astype(np.float32) for n, x in arrays.items()}
    for causal in (False, True):
        expected = _call(la.linear_attention, single, causal=causal)
        out = _call(dask_linear_attention, _lazy_all(single), causal=causal)
        actual = out.compute(scheduler="sync")
        assert out.dtype == actual.dtype == np.float32
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_output_is_chunked_like_q_and_keys_follow_the_rule(causal):
    """Output chunks are q's (leading and sequence axes); causal attention gives the keys
    q's sequence chunks, bidirectional attention keeps the keys' own (one chunk state
    per key chunk)."""
    arrays = _inputs()
    q = da.from_array(arrays["q"], chunks=(1, 2, 25, D))
    k, v = (da.from_array(arrays[n], chunks=(2, 1, 40, -1)) for n in "kv")
    mask = da.from_array(arrays["key_mask"], chunks=(1, 1, 50))
    out = dask_linear_attention(q, k, v, FM, causal=causal, key_mask=mask)
    assert out.chunks == (q.chunks[0], q.chunks[1], q.chunks[2], (DV,))
    states = [
        key
        for key in dict(out.__dask_graph__())
        if isinstance(key, tuple) and str(key[0]).startswith("linattn-chunk-state")
    ]
    per_batch_block = len(states) // (out.numblocks[0] * out.numblocks[1])
    assert per_batch_block == (q.numblocks[2] if causal else k.numblocks[2])
    expected = _call(la.linear_attention, arrays, causal=causal)
    np.testing.assert_allclose(out.compute(scheduler="sync"), expected, **FLOAT64)


def _long(length: int, chunk: int) -> da.Array:
    """A lazy ``(1, 4, length, 64)`` input in sequence chunks of ``chunk`` (never computed)."""
    rng = da.random.default_rng(0)
    return rng.standard_normal((1, 4, length, 64), chunks=(1, 4, chunk, 64))


def _task_count(length: int, chunk: int, **options) -> int:
    x = _long(length, chunk)
    out = dask_linear_attention(x, x, x, la.FeatureMap(64, 64, seed=0), **options)
    outputs = out if isinstance(out, tuple) else (out,)
    if isinstance(out, tuple):
        outputs = (out[0], out[1].kv, out[1].log_shift)
    return len({key for x in outputs for key in dict(x.__dask_graph__())})


@pytest.mark.parametrize(
    "options",
    [{"causal": False}, {"causal": True}, {"causal": True, "return_state": True}],
    ids=["bidirectional", "causal", "causal-return-state"],
)
def test_task_count_grows_with_sequence_chunks_not_with_length(options):
    """L = 65536 in chunks of 8192: under 300 tasks, the same for any ``chunk_size``
    and for any L with the same number of chunks, and linear in the number of chunks
    (the array-API loop builds about 150 tasks per ``chunk_size`` tokens)."""
    tasks = _task_count(65536, 8192, chunk_size=32, **options)
    assert tasks < 300
    assert _task_count(65536, 8192, chunk_size=256, **options) == tasks
    assert _task_count(2048, 256, chunk_size=32, **options) == tasks
    fewer, more = (_task_count(65536, chunk, **options) for chunk in (16384, 4096))
    assert more - tasks == 2 * (tasks - fewer)


class _CountingScheduler:
    """A Dask scheduler (``get``) that counts how often it is asked to compute."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, graph, keys, **kwargs):
        self.calls += 1
        return dask.get(graph, keys, **kwargs)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_building_the_graph_computes_nothing(causal):
    arrays = _lazy_all(_inputs())
    counting = _CountingScheduler()
    with dask.config.set(scheduler=counting):
        out = _call(dask_linear_attention, arrays, causal=causal)
        if causal:
            _, state = _call(dask_linear_attention, arrays, causal=True, return_state=True)
            numpy_state = la.LinearAttentionState(
                kv=np.zeros((M, DV + 1)), log_shift=np.full(M, -np.inf), feature_map=FM.fingerprint
            )
            for incoming in (state, numpy_state):
                _call(dask_linear_attention, arrays, causal=True, state=incoming)
        assert counting.calls == 0
        out.compute()
    assert counting.calls == 1


def _check_error(options, error, match):
    """linear_attention's check, with its message, from dask_linear_attention."""
    numpy_inputs = _inputs(32)
    with pytest.raises(error, match=match):
        _call(la.linear_attention, numpy_inputs, **options)
    with pytest.raises(error, match=match):
        _call(dask_linear_attention, _lazy_all(numpy_inputs, 16), **options)


STATE = la.LinearAttentionState(
    kv=np.zeros((M, DV + 1)), log_shift=np.zeros(M), feature_map=FM.fingerprint
)


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"causal": 1}, TypeError, "causal must be True or False"),
        ({"return_state": 1, "causal": True}, TypeError, "return_state must be True or False"),
        ({"return_state": True}, ValueError, "state and return_state need causal=True"),
        ({"state": STATE}, ValueError, "state and return_state need causal=True"),
        ({"state": "state", "causal": True}, TypeError, "state must be a LinearAttentionState"),
        ({"chunk_size": 0}, ValueError, "chunk_size must be a positive integer"),
        ({"backend": "cuda"}, ValueError, "backend must be one of"),
        (
            {
                "causal": True,
                "state": la.LinearAttentionState(
                    kv=np.zeros((M, DV + 1), np.float32),
                    log_shift=np.zeros(M, np.float32),
                    feature_map=FM.fingerprint,
                ),
            },
            TypeError,
            "state must hold float64 arrays",
        ),
        (
            {
                "causal": True,
                "state": la.LinearAttentionState(
                    kv=np.zeros((M, DV + 1)), log_shift=np.zeros(M), feature_map="other"
                ),
            },
            ValueError,
            "state was made by another feature map",
        ),
    ],
)
def test_checks_and_messages_are_linear_attentions(options, error, match):
    _check_error(options, error, match)


def test_causal_needs_a_calibrated_map_and_feature_map_is_checked():
    numpy_inputs, lazy = _inputs(32), _lazy_all(_inputs(32), 16)
    oprf = la.FeatureMap(D, M, kind="oprf")
    for function, arrays in ((la.linear_attention, numpy_inputs), (dask_linear_attention, lazy)):
        with pytest.raises(ValueError, match="causal attention needs the 'oprf' feature map"):
            _call(function, arrays, oprf, causal=True)
        with pytest.raises(TypeError, match=r"feature_map must be a linattn\.FeatureMap"):
            _call(function, arrays, "features")
    with pytest.raises(TypeError, match="all arrays must come from one array library"):
        dask_linear_attention(lazy["q"], numpy_inputs["k"], lazy["v"], FM)


def test_linear_attention_on_dask_keeps_the_sequence_chunks():
    """The front door: Dask inputs get dask_linear_attention's graph (chunks like q, the
    same tasks whatever chunk_size), and a NumPy state continues a Dask sequence."""
    arrays = _inputs(512)
    lazy = _lazy_all(arrays, 128)
    for causal in (False, True):
        outs = [
            _call(la.linear_attention, lazy, causal=causal, chunk_size=size) for size in (16, 128)
        ]
        assert outs[0].chunks == (*lazy["q"].chunks[:3], (DV,))
        reference = _call(dask_linear_attention, lazy, causal=causal, chunk_size=16)
        assert [len(out.__dask_graph__()) for out in outs] == [len(reference.__dask_graph__())] * 2
        expected = _call(la.linear_attention, arrays, causal=causal)
        np.testing.assert_allclose(outs[0].compute(scheduler="sync"), expected, **FLOAT64)
    expected, _ = _call(la.linear_attention, arrays, causal=True, state=STATE, return_state=True)
    out, state = _call(la.linear_attention, lazy, causal=True, state=STATE, return_state=True)
    assert isinstance(state.kv, da.Array)
    np.testing.assert_allclose(out.compute(scheduler="sync"), expected, **FLOAT64)


def test_calibrate_computes_dask_inputs_once():
    arrays = _lazy_all(_inputs())
    counting = _CountingScheduler()
    oprf = la.FeatureMap(D, M, kind="hyperbolic_oprf", rebalance=True, seed=1)
    with dask.config.set(scheduler=counting):
        oprf.calibrate(arrays["q"], arrays["k"], key_mask=arrays["key_mask"])
    assert counting.calls <= 1
