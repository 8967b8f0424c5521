"""The decoding fast path (``linattn._decode``) and its kernel (``linattn_numba.cpu.decode``).

Its results must equal the general path's (``linear_attention`` with ``state=``) bit
for bit (the same products on the same features); anything it does not serve must fall
through to the general path (the plan chooses another executor), which gives the errors.
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest

import linattn as la
from linattn import _decode, _plan
from linattn._call import normalise_call

kernel = pytest.importorskip("linattn_numba.cpu.decode")

HEAD_DIM, FEATURES, VALUE_DIM = 8, 32, 5


def _setup(kind: str, dtype: str, empty: bool = False, seed: int = 0):
    """A map, a state after a 20-token prefix (all keys masked when ``empty``), a rng."""
    rng = np.random.default_rng(seed)
    fm = la.FeatureMap(HEAD_DIM, FEATURES, kind=kind, seed=seed)
    q, k = (rng.normal(size=(2, 3, 20, HEAD_DIM)).astype(dtype) for _ in range(2))
    v = rng.normal(size=(2, 3, 20, VALUE_DIM)).astype(dtype)
    mask = np.zeros((2, 3, 20), bool) if empty else None
    _, state = la.linear_attention(
        q, k, v, fm, causal=True, key_mask=mask, return_state=True, chunk_size=8
    )
    return fm, state, rng


def _tokens(rng: np.random.Generator, length: int, dtype: str) -> list[np.ndarray]:
    q, k = (rng.normal(size=(2, 3, length, HEAD_DIM)).astype(dtype) for _ in range(2))
    return [q, k, rng.normal(size=(2, 3, length, VALUE_DIM)).astype(dtype)]


def _decode_or_none(q, k, v, fm, **options):
    """The decoding executor's result where the plan chooses it for a call, else None."""
    call = normalise_call(q, k, v, fm, **options)
    if _plan.plan_call(call).executor != "decode":
        return None
    return _plan.execute(call)


def _both(fm, state, tokens, key_mask=None, chunk_size=64):
    options = {"causal": True, "key_mask": key_mask, "state": state, "chunk_size": chunk_size}
    fast = _decode_or_none(*tokens, fm, return_state=True, backend=None, **options)
    assert fast is not None, "the fast path should serve this call"
    with mock.patch.object(_decode, "why_not", return_value="forced"):  # the general path
        general = la.linear_attention(*tokens, fm, return_state=True, **options)
    return fast, general


def _rounding(dtype: str, values: np.ndarray) -> float:
    """|error| bound of one output: numerator and denominator each sum m terms in
    another order (relative error m eps of the sum of |weights| |v|, at most max |v|)."""
    return 2 * FEATURES * float(np.finfo(dtype).eps) * float(np.max(np.abs(values)))


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("kind", ["positive", "hyperbolic"])
@pytest.mark.parametrize("empty", [False, True])
@pytest.mark.parametrize("length", [1, 2, 7, 16])
def test_equals_the_general_path(dtype: str, kind: str, empty: bool, length: int) -> None:
    fm, state, rng = _setup(kind, dtype, empty)
    tokens = _tokens(rng, length, dtype)
    mask = rng.random((2, 3, length)) > 0.3
    for key_mask, chunk_size in ((None, 64), (mask, 3)):
        (out, after), (expected, reference) = _both(fm, state, tokens, key_mask, chunk_size)
        assert out.dtype == expected.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(out, expected)
        np.testing.assert_array_equal(after.kv, reference.kv)
        np.testing.assert_array_equal(after.log_shift, reference.log_shift)
        assert after.num_tokens == reference.num_tokens == 20 + length
        assert after.feature_map == reference.feature_map


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_token_by_token_equals_the_whole_sequence(dtype: str) -> None:
    fm, state, rng = _setup("positive", dtype)
    tokens = _tokens(rng, 12, dtype)
    whole = la.linear_attention(*tokens, fm, causal=True, state=state, chunk_size=64)
    outputs = []
    for t in range(12):
        step = [x[..., t : t + 1, :] for x in tokens]  # (strided views)
        out, state = _decode_or_none(
            *step, fm, causal=True, key_mask=None, state=state, return_state=True,
            chunk_size=64, backend=None,
        )  # fmt: skip
        outputs.append(out)
    # Token by token stabilises each token on its own: equal to rounding (a few terms
    # per output, each of relative error m eps, accumulated over 12 steps).
    bound = 12 * _rounding(dtype, tokens[2])
    np.testing.assert_allclose(np.concatenate(outputs, axis=-2), whole, rtol=0, atol=bound)


def test_the_state_passed_in_is_not_changed() -> None:
    fm, state, rng = _setup("positive", "float32")
    kv, log_shift = state.kv.copy(), state.log_shift.copy()
    for length in (1, 4):
        _both(fm, state, _tokens(rng, length, "float32"))
        np.testing.assert_array_equal(state.kv, kv)
        np.testing.assert_array_equal(state.log_shift, log_shift)


@pytest.mark.parametrize("length", [1, 3])
def test_empty_rows_are_read_as_zeros(length: int) -> None:
    """A row whose shift is -inf has seen no key: whatever it stores (NaN) is no part
    of the output or of the new state, as on the general path."""
    fm, state, rng = _setup("positive", "float64")
    kv, log_shift = state.kv.copy(), state.log_shift.copy()
    log_shift[..., :4] = -np.inf
    kv[..., :4, :] = np.nan
    dirty = la.LinearAttentionState(kv, log_shift, state.feature_map, state.num_tokens)
    (out, after), (expected, reference) = _both(fm, dirty, _tokens(rng, length, "float64"))
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(after.kv))
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(after.kv, reference.kv)


def test_runs_the_kernel_serial_for_one_token() -> None:
    fm, state, rng = _setup("positive", "float32")
    before = kernel._decode.launches["serial"]
    _both(fm, state, _tokens(rng, 1, "float32"))
    assert kernel._decode.launches["serial"] == before + 1


def _fallbacks():
    """Calls the fast path leaves to the general path (name, changes to the arguments)."""
    return {
        "17 tokens": {"length": 17},
        "bidirectional": {"causal": False},
        "array_api backend": {"backend": "array_api"},
        "mixed dtypes": {"v_dtype": "float64"},
        "float16": {"dtype": "float16"},
        "broadcast batch": {"q_batch": (1, 3)},
        "broadcast key_mask": {"mask_shape": (3, 1)},
        "wrong head_dim": {"head_dim": HEAD_DIM + 1},
        "other map": {"seed": 5},
        "bool chunk_size": {"chunk_size": True},
        "zero chunk_size": {"chunk_size": 0},
        "uncalibrated rebalanced map": {"rebalance": True},
        "trigonometric map": {"kind": "trigonometric"},
        "list input": {"as_list": True},
    }


@pytest.mark.parametrize("name", list(_fallbacks()))
def test_falls_through_to_the_general_path(name: str) -> None:
    change = _fallbacks()[name]
    fm, state, rng = _setup("positive", "float32")
    dtype = change.get("dtype", "float32")
    length = change.get("length", 1)
    q, k, v = _tokens(rng, length, "float32")
    q = np.ascontiguousarray(q[: change.get("q_batch", (2, 3))[0]], dtype=dtype)
    k, v = k.astype(dtype), v.astype(change.get("v_dtype", dtype))
    if "head_dim" in change:
        q = k = rng.normal(size=(2, 3, length, change["head_dim"])).astype(dtype)
    mask = np.ones(change["mask_shape"], bool) if "mask_shape" in change else None
    if "seed" in change or "rebalance" in change or "kind" in change:
        fm = la.FeatureMap(
            HEAD_DIM, FEATURES, kind=change.get("kind", "positive"),
            rebalance=change.get("rebalance", False), seed=change.get("seed", 0),
        )  # fmt: skip
    if change.get("as_list"):
        q = q.tolist()
    result = _decode_or_none(
        q, k, v, fm, causal=change.get("causal", True), key_mask=mask, state=state,
        return_state=True, chunk_size=change.get("chunk_size", 64),
        backend=change.get("backend"),
    )  # fmt: skip
    assert result is None


def test_the_environment_variable_chooses_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    fm, state, rng = _setup("positive", "float32")
    tokens = _tokens(rng, 1, "float32")
    options = {"causal": True, "key_mask": None, "state": state, "return_state": False}
    monkeypatch.setenv("LINATTN_BACKEND", "array_api")
    assert _decode_or_none(*tokens, fm, chunk_size=64, backend=None, **options) is None
    out = _decode_or_none(*tokens, fm, chunk_size=64, backend="numba", **options)
    assert isinstance(out, np.ndarray) and out.shape == (2, 3, 1, VALUE_DIM)
