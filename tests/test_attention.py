"""Every public attention function on every backend against NumPy float64 references."""

from __future__ import annotations

import dataclasses
import itertools
import re

import numpy as np
import pytest
from conftest import Backend, assert_close, linear_attention_for
from reference import linear_reference, softmax_reference

import linattn as la

RNG = np.random.default_rng(1234)
# Broadcasting leading axes: q has a batch axis of 2, k/v a head axis of 3.
Q = 0.5 * RNG.normal(size=(2, 1, 13, 8))
K = 0.5 * RNG.normal(size=(1, 3, 13, 8))
V = RNG.normal(size=(1, 3, 13, 6))
MASK = RNG.random(size=(2, 1, 13)) > 0.3
KINDS = ["positive", "hyperbolic", "trigonometric", "random_relu", "elu", "relu"]


def _map(kind: str, d: int = 8, m: int = 16, seed: int = 0) -> la.FeatureMap:
    return la.FeatureMap(d, d if kind in ("elu", "relu") else m, kind=kind, seed=seed)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_softmax_attention(backend: Backend, causal: bool, masked: bool) -> None:
    mask = MASK if masked else None
    out = la.softmax_attention(
        backend.asarray(Q),
        backend.asarray(K),
        backend.asarray(V),
        causal=causal,
        key_mask=None if mask is None else backend.asarray(mask),
    )
    expected = softmax_reference(Q, K, V, causal=causal, key_mask=mask)
    assert_close(backend, out, expected, rtol=1e-12, atol=1e-14, dtype="float64")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_linear_attention_matches_reference(
    backend: Backend, kind: str, causal: bool, masked: bool
) -> None:
    fm = _map(kind)
    mask = MASK if masked else None
    out = la.linear_attention(
        backend.asarray(Q),
        backend.asarray(K),
        backend.asarray(V),
        fm,
        causal=causal,
        key_mask=None if mask is None else backend.asarray(mask),
        chunk_size=4,
    )
    expected = linear_reference(Q, K, V, fm, causal=causal, key_mask=mask)
    # Trigonometric denominators can be small: compare at the conditioning they allow.
    rtol = 1e-7 if kind == "trigonometric" else 1e-10
    assert_close(backend, out, expected, rtol=rtol, atol=1e-12, dtype="float64")


def test_queries_and_keys_of_different_lengths(backend: Backend) -> None:
    fm = _map("positive")
    q = Q[..., :5, :]
    out = la.linear_attention(backend.asarray(q), backend.asarray(K), backend.asarray(V), fm)
    assert_close(backend, out, linear_reference(q, K, V, fm), rtol=1e-10, dtype="float64")


@pytest.mark.parametrize("causal", [False, True])
def test_float32(backend: Backend, causal: bool) -> None:
    fm = _map("hyperbolic")
    out = la.linear_attention(
        *(backend.asarray(a, dtype="float32") for a in (Q, K, V)), fm, causal=causal
    )
    expected = linear_reference(Q, K, V, fm, causal=causal)
    # float32 rounding (eps 6e-8) grown by sums over m features and L keys.
    assert_close(backend, out, expected, rtol=2e-5, atol=2e-6, dtype="float32")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_in_and_out(backend: Backend, dtype: str) -> None:
    xp = backend.xp
    if not hasattr(xp, dtype):
        pytest.skip(f"{backend.name} has no {dtype}")
    fm = _map("positive")
    args = [backend.asarray(a, dtype=dtype) for a in (Q, K, V)]
    rounded = [backend.to_numpy(a) for a in args]
    out = la.linear_attention(*args, fm, causal=True)
    assert out.dtype == getattr(xp, dtype)
    expected = linear_reference(*rounded, fm, causal=True)
    # The state is float32; only the final rounding to the half type remains.
    eps = 2.0**-8 if dtype == "bfloat16" else 2.0**-11
    np.testing.assert_allclose(backend.to_numpy(out), expected, rtol=2 * eps, atol=2 * eps)


@pytest.mark.parametrize(
    ("causal", "options", "default_map"),
    [
        (True, {"kind": "positive"}, {"kind": "positive"}),
        (True, {}, {"kind": "hyperbolic"}),
        (False, {}, {"kind": "hyperbolic_oprf", "rebalance": True}),
    ],
)
def test_favor_attention_is_linear_attention_with_a_fresh_map(
    backend: Backend, causal: bool, options: dict, default_map: dict
) -> None:
    args = [backend.asarray(a) for a in (Q, K, V)]
    out = la.favor_attention(*args, num_features=32, causal=causal, seed=5, **options)
    fm = la.FeatureMap(8, 32, seed=5, **default_map)
    expected = linear_reference(Q, K, V, fm, causal=causal)
    assert_close(backend, out, expected, rtol=1e-10, dtype="float64")


def test_whole_equals_pieces_equals_tokens(backend: Backend) -> None:
    fm = _map("positive", m=32)
    q, k, v = (backend.asarray(a, dtype="float32") for a in (Q, K, V))
    attend = linear_attention_for(backend)
    whole = backend.to_numpy(attend(q, k, v, fm, causal=True, chunk_size=4))
    for cuts in ([0, 5, 6, 13], list(range(14))):
        state = None
        parts = []
        for start, stop in itertools.pairwise(cuts):
            piece = (a[..., start:stop, :] for a in (q, k, v))
            out, state = attend(
                *piece, fm, causal=True, state=state, return_state=True, chunk_size=4
            )
            parts.append(backend.to_numpy(out))
        assert state is not None and state.num_tokens == 13
        np.testing.assert_allclose(np.concatenate(parts, axis=-2), whole, rtol=1e-5, atol=1e-6)


def test_chunk_size_does_not_change_results(backend: Backend) -> None:
    fm = _map("hyperbolic")
    args = [backend.asarray(a) for a in (Q, K, V)]
    outs = [
        backend.to_numpy(la.linear_attention(*args, fm, causal=True, chunk_size=c))
        for c in (1, 3, 13, 64)
    ]
    for other in outs[1:]:
        np.testing.assert_allclose(other, outs[0], rtol=1e-12, atol=1e-14)


def test_causality_is_exact_in_floating_point(backend: Backend) -> None:
    """A future key with log-features ~50 above the rest leaves earlier outputs unchanged."""
    d = 8
    projection = la.FeatureMap(d, 16, seed=0).projection
    assert projection is not None
    projection = projection.copy()
    projection[0] = 0.0
    projection[0, 0] = 10.0  # a long row: log-feature up to |w|^2 / 2 = 50
    fm = la.FeatureMap.from_projection(projection, scale=1.0)
    rng = np.random.default_rng(9)
    q, k, v = (0.3 * rng.normal(size=(2, 12, d)) for _ in range(3))
    k_future = k.copy()
    k_future[:, 9, :] = 0.0
    k_future[:, 9, 0] = 10.0
    lk = fm.log_features(k_future)
    assert lk[:, 9].max() - np.delete(lk, 9, axis=1).max() > 45
    for dtype in ("float32", "float64"):
        for chunk_size in (4, 64):
            before, after = (
                backend.to_numpy(
                    la.linear_attention(
                        *(backend.asarray(a, dtype=dtype) for a in (q, kk, v)),
                        fm,
                        causal=True,
                        chunk_size=chunk_size,
                    )
                )
                for kk in (k, k_future)
            )
            np.testing.assert_array_equal(after[:, :9], before[:, :9])
            assert np.all(np.isfinite(after))
            assert not np.array_equal(after[:, 9:], before[:, 9:])


@pytest.mark.parametrize("causal", [False, True])
def test_padded_keys_change_nothing(backend: Backend, causal: bool) -> None:
    fm = _map("positive")
    q, k, v = Q[0, 0], K[0, 0], V[0, 0]
    pad = 5
    rng = np.random.default_rng(4)
    k_pad = np.concatenate([k, 3.0 * rng.normal(size=(pad, 8))])
    v_pad = np.concatenate([v, 100.0 * rng.normal(size=(pad, 6))])
    q_pad = np.concatenate([q, rng.normal(size=(pad, 8))]) if causal else q
    mask = np.arange(13 + pad) < 13
    out = la.linear_attention(
        backend.asarray(q_pad),
        backend.asarray(k_pad),
        backend.asarray(v_pad),
        fm,
        causal=causal,
        key_mask=backend.asarray(mask),
    )
    plain = linear_reference(q, k, v, fm, causal=causal)
    np.testing.assert_allclose(backend.to_numpy(out)[:13], plain, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", ["positive", "trigonometric"])
@pytest.mark.parametrize("causal", [False, True])
def test_non_finite_padding_changes_nothing(backend: Backend, kind: str, causal: bool) -> None:
    """Padding may hold anything: masked keys' NaN/inf keys and values must not leak
    (a zero weight times NaN is still NaN; "trigonometric" also carries signs)."""
    fm = _map(kind)
    q, k, v = Q[0, 0], K[0, 0], V[0, 0]
    mask = np.ones(13, bool)
    mask[[2, 9]] = False
    k_pad, v_pad = k.copy(), v.copy()
    k_pad[2], v_pad[2] = np.inf, np.nan
    k_pad[9], v_pad[9] = np.nan, -np.inf
    args = [backend.asarray(a) for a in (q, k_pad, v_pad)]
    out = la.linear_attention(*args, fm, causal=causal, key_mask=backend.asarray(mask))
    expected = linear_reference(q, k, v, fm, causal=causal, key_mask=mask)
    np.testing.assert_allclose(backend.to_numpy(out), expected, rtol=1e-10, atol=1e-12)
    exact = la.softmax_attention(*args, causal=causal, key_mask=backend.asarray(mask))
    expected = softmax_reference(q, k, v, causal=causal, key_mask=mask)
    np.testing.assert_allclose(backend.to_numpy(exact), expected, rtol=1e-10, atol=1e-12)


def test_mixed_precision_computes_in_the_promoted_dtype(backend: Backend) -> None:
    """float32 queries with float64 keys and values: everything in float64 (features
    included), and the state returned continues the sequence."""
    fm = _map("positive")
    q = Q[0, 0].astype(np.float32)  # float32 values, exactly representable in float64
    k, v = K[0, 0], V[0, 0]
    head, tail = slice(0, 9), slice(9, 13)

    def inputs(rows: slice) -> list:
        return [backend.asarray(q[rows], dtype="float32"), backend.asarray(k[rows]),
                backend.asarray(v[rows])]  # fmt: skip

    out, state = la.linear_attention(*inputs(head), fm, causal=True, return_state=True)
    rest = la.linear_attention(*inputs(tail), fm, causal=True, state=state)
    expected = linear_reference(q.astype(np.float64), k, v, fm, causal=True)
    assert_close(backend, out, expected[head], rtol=1e-10, atol=1e-12, dtype="float64")
    assert_close(backend, rest, expected[tail], rtol=1e-10, atol=1e-12, dtype="float64")


def test_chunk_size_beyond_the_length_costs_nothing(backend: Backend) -> None:
    """A chunk longer than the sequence is the sequence: no chunk-sized mask is built."""
    fm = _map("positive")
    args = [backend.asarray(a) for a in (Q[0, 0], K[0, 0], V[0, 0])]
    out = la.linear_attention(*args, fm, causal=True, chunk_size=10**9, backend="array_api")
    expected = linear_reference(Q[0, 0], K[0, 0], V[0, 0], fm, causal=True)
    assert_close(backend, out, expected, rtol=1e-10, atol=1e-12, dtype="float64")


def test_queries_that_see_no_key_get_zeros(backend: Backend) -> None:
    fm = _map("positive")
    q, k, v = Q[0, 0], K[0, 0], V[0, 0]
    mask = np.arange(13) >= 4  # left padding: causal queries 0..3 see nothing
    args = [backend.asarray(a) for a in (q, k, v)]
    for out in (
        la.linear_attention(*args, fm, causal=True, key_mask=backend.asarray(mask)),
        la.softmax_attention(*args, causal=True, key_mask=backend.asarray(mask)),
    ):
        result = backend.to_numpy(out)
        np.testing.assert_array_equal(result[:4], 0.0)
        assert np.all(np.isfinite(result)) and np.abs(result[4:]).min(axis=-1).max() > 0


@pytest.mark.parametrize("causal", [False, True])
def test_with_exact_heads_replaces_only_those_heads(backend: Backend, causal: bool) -> None:
    """Heads 3 and 1 of 4 (grouped-query: key heads 1 and 0) become softmax attention by
    the reference, with a mask per key head and a row without keys (zeros); the others
    stay bit for bit; no heads returns ``out`` itself."""
    rng = np.random.default_rng(7)
    q = rng.normal(size=(2, 4, 5, 3))
    k, v = rng.normal(size=(2, 2, 5, 3)), rng.normal(size=(2, 2, 5, 2))
    out = rng.normal(size=(2, 4, 5, 2))
    mask = np.ones((2, 2, 5), dtype=bool)
    mask[1, 1, :2] = False  # key head 1 of row 1: left padding
    args = [backend.asarray(a) for a in (out, q, k, v)]
    got = backend.to_numpy(
        la.with_exact_heads(*args, [3, 1], causal=causal, key_mask=backend.asarray(mask))
    )
    np.testing.assert_array_equal(got[:, [0, 2]], out[:, [0, 2]])
    for head, kv_head in ((1, 0), (3, 1)):
        expected = softmax_reference(
            q[:, head], k[:, kv_head], v[:, kv_head], causal=causal, key_mask=mask[:, kv_head]
        )
        np.testing.assert_allclose(got[:, head], expected, rtol=1e-12, atol=1e-14)
    if causal:
        np.testing.assert_array_equal(got[1, 3, :2], 0.0)
    assert la.with_exact_heads(*args, []) is args[0]


def test_with_exact_heads_names_bad_arguments() -> None:
    out, q = np.zeros((1, 4, 5, 2)), np.zeros((1, 4, 5, 3))
    k, v = np.zeros((1, 2, 5, 3)), np.zeros((1, 2, 5, 2))
    for heads, message in (
        ([4], r"heads must be query heads, integers in \[0, 4\); got \[4\]"),
        ([True], r"heads must be query heads"),
        ([1, 1], "heads must not repeat a head; got \\[1, 1\\]"),
    ):
        with pytest.raises(ValueError, match=message):
            la.with_exact_heads(out, q, k, v, heads)
    with pytest.raises(ValueError, match=r"out must have shape \(\.\.\., 4, 5, 2\)"):
        la.with_exact_heads(out[..., :1], q, k, v, [0])
    with pytest.raises(ValueError, match=r"k's heads \(3\) must divide q's \(4\)"):
        la.with_exact_heads(out, q, np.zeros((1, 3, 5, 3)), np.zeros((1, 3, 5, 2)), [0])
    with pytest.raises(ValueError, match="q must have a head axis"):
        la.with_exact_heads(out, q[0, 0], k, v, [0])


@pytest.mark.parametrize("kind", ["positive", "hyperbolic"])
@pytest.mark.parametrize("d", [16, 64])
def test_large_norms_stay_finite_in_float32(backend: Backend, kind: str, d: int) -> None:
    rng = np.random.default_rng(d)
    q, k = (rng.normal(size=(40, d)) for _ in range(2))
    norms = np.linspace(0.1, 10.0, 40)[:, None]
    q = q / np.linalg.norm(q, axis=-1, keepdims=True) * norms
    k = k / np.linalg.norm(k, axis=-1, keepdims=True) * norms[::-1]
    v = rng.normal(size=(40, 8))
    fm = la.FeatureMap(d, 64, kind=kind, seed=1)
    for causal in (False, True):
        out = la.linear_attention(
            *(backend.asarray(a, dtype="float32") for a in (q, k, v)), fm, causal=causal
        )
        expected = linear_reference(q, k, v, fm, causal=causal)
        result = backend.to_numpy(out)
        assert np.all(np.isfinite(result))
        np.testing.assert_allclose(result, expected, rtol=1e-3, atol=1e-4)


def test_state_round_trip_errors() -> None:
    fm = _map("positive")
    q, k, v = Q[0, 0], K[0, 0], V[0, 0]
    _, state = la.linear_attention(q, k, v, fm, causal=True, return_state=True)
    with pytest.raises(ValueError, match="state was made by another feature map"):
        la.linear_attention(q, k, v, fm.redraw(seed=9), causal=True, state=state)
    with pytest.raises(ValueError, match=r"state.kv must have shape \(\.\.\., 16, 4\)"):
        la.linear_attention(q, k, v[:, :3], fm, causal=True, state=state)
    with pytest.raises(TypeError, match="state must hold float32 arrays"):
        la.linear_attention(
            *(a.astype(np.float32) for a in (q, k, v)), fm, causal=True, state=state
        )
    with pytest.raises(ValueError, match="state and return_state need causal=True"):
        la.linear_attention(q, k, v, fm, state=state)
    counted = dataclasses.replace(state, num_tokens="x")
    with pytest.raises(TypeError, match=r"state\.num_tokens must be a non-negative integer"):
        la.linear_attention(q, k, v, fm, causal=True, state=counted, return_state=True)
    with pytest.raises(TypeError, match="state must be a LinearAttentionState"):
        la.linear_attention(q, k, v, fm, causal=True, state=(state.kv, state.log_shift))  # type: ignore[arg-type]


def _bad_calls():
    fm = _map("positive")
    q, k, v = Q[0, 0], K[0, 0], V[0, 0]
    xps = pytest.importorskip("array_api_strict")
    return [
        ((q, k, v, "fm"), {}, TypeError, "feature_map must be a linattn.FeatureMap; got str"),
        (
            (q[0], k, v, fm),
            {},
            ValueError,
            r"q must have at least 2 dimensions .* got shape \(8,\)",
        ),
        ((q[:, :5], k[:, :5], v, fm), {}, ValueError, "head dimension 8 to match feature_map"),
        ((q, k[:, :5], v, fm), {}, ValueError, "q and k must have the same head dimension"),
        ((q, k, v[:7], fm), {}, ValueError, "k and v must have the same length"),
        (
            (q[:5], k, v, fm),
            {"causal": True},
            ValueError,
            "causal attention needs queries and keys of the same length",
        ),
        (
            (q.astype(int), k, v, fm),
            {},
            TypeError,
            "q must have a real floating dtype .* got int64",
        ),
        (
            (q, k.astype(complex), v, fm),
            {},
            TypeError,
            "k must have a real floating dtype .* got complex128",
        ),
        (
            (q, xps.asarray(k), v, fm),
            {},
            TypeError,
            "all arrays must come from one array library; "
            "got q: numpy.ndarray, k: array_api_strict.Array",
        ),
        (
            (q, k, v, fm),
            {"key_mask": np.ones(13)},
            TypeError,
            "key_mask must be a boolean array; got dtype float64",
        ),
        (
            (q, k, v, fm),
            {"key_mask": np.ones(12, bool)},
            ValueError,
            r"key_mask must have shape \(\.\.\., 13\)",
        ),
        (
            (q, k, v, fm),
            {"chunk_size": 0},
            ValueError,
            "chunk_size must be a positive integer or None; got 0",
        ),
        (
            (q, k, v, fm),
            {"chunk_size": 2.5},
            TypeError,
            "chunk_size must be a positive integer or None; got 2.5",
        ),
        ((q, k, v, fm), {"backend": "gpu"}, ValueError, "backend must be one of"),
        ((q, k, v, fm), {"causal": "yes"}, TypeError, "causal must be True or False"),
        (
            (np.ones((2, 13, 8)), np.ones((3, 13, 8)), np.ones((3, 13, 6)), fm),
            {},
            ValueError,
            r"leading \(batch\) dimensions must broadcast together; "
            r"got q \(2,\), k \(3,\), v \(3,\)",
        ),
        ((q[:0], k, v, fm), {}, ValueError, "q must have at least one position"),
        ((q.tolist(), k, v, fm), {}, TypeError, "q must be an array"),
    ]


def test_bad_inputs_raise_clear_errors() -> None:
    for args, kwargs, error, match in _bad_calls():
        with pytest.raises(error, match=match):
            la.linear_attention(*args, **kwargs)


def test_more_bad_inputs_raise_clear_errors() -> None:
    x, empty = np.ones((4, 8)), np.ones((4, 0))
    fm = la.FeatureMap(8, 16)
    with pytest.raises(ValueError, match=r"q must have at least one feature; got shape \(4, 0\)"):
        la.softmax_attention(empty, empty, empty)
    with pytest.raises(ValueError, match=r"v must have at least one feature; got shape \(4, 0\)"):
        la.linear_attention(x, x, empty, fm, causal=True)
    with pytest.raises(TypeError, match="return_state must be True or False; got 'no'"):
        la.linear_attention(x, x, x, fm, causal=True, return_state="no")  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="grad_output must be an array shaped like the output"):
        la.linear_attention_vjp(x, x, x, fm, None)


def test_array_api_strict_devices_must_match() -> None:
    xps = pytest.importorskip("array_api_strict")
    q = xps.asarray(Q[0, 0], device=xps.Device("device1"))
    k = xps.asarray(K[0, 0], device=xps.Device("CPU_DEVICE"))
    with pytest.raises(ValueError, match="all arrays must be on one device; q is on"):
        la.linear_attention(q, k, k, _map("positive"))


def test_softmax_bad_scale() -> None:
    with pytest.raises(ValueError, match="scale must be a positive finite number; got -1"):
        la.softmax_attention(Q, K, Q, scale=-1)


@pytest.mark.parametrize(("kind", "rebalance"), [("oprf", False), ("hyperbolic_oprf", True)])
def test_low_variance_maps_bidirectional_and_calibrated_causal(
    backend: Backend, kind: str, rebalance: bool
) -> None:
    fm = la.FeatureMap(8, 16, kind=kind, rebalance=rebalance, seed=1)
    args = [backend.asarray(a) for a in (Q, K, V)]
    # Bidirectional: statistics from the call's own batch.
    out = la.linear_attention(*args, fm)
    assert_close(backend, out, linear_reference(Q, K, V, fm), rtol=1e-10, dtype="float64")
    # Causal: statistics fixed in advance; whole = pieces still holds.
    calibrated = fm.calibrate(*args[:2])
    whole = la.linear_attention(*args, calibrated, causal=True, chunk_size=4)
    expected = linear_reference(Q, K, V, calibrated, causal=True)
    assert_close(backend, whole, expected, rtol=1e-10, dtype="float64")
    first, state = la.linear_attention(
        *(a[..., :6, :] for a in args), calibrated, causal=True, return_state=True
    )
    second = la.linear_attention(
        *(a[..., 6:, :] for a in args), calibrated, causal=True, state=state
    )
    np.testing.assert_allclose(
        np.concatenate([backend.to_numpy(first), backend.to_numpy(second)], axis=-2),
        expected,
        rtol=1e-10,
    )


# -- issue 16: defects found tried as a new user would ------------------------------


@pytest.mark.parametrize("kind", ["positive", "hyperbolic", "trigonometric"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_huge_key_changes_no_earlier_output(backend: Backend, kind: str, dtype: str) -> None:
    """A finite key whose squared norm overflows touches only outputs at or after it.

    Positive kinds give it log-feature -inf (its true features lie below the float
    range), so nothing anywhere is NaN; trigonometric features give NaN or +inf,
    which may reach only positions >= 50.  Earlier outputs are bit-identical to the
    same call with that key replaced by zeros.
    """
    rng = np.random.default_rng(7)
    q, k, v = (rng.normal(size=(2, 128, 8)).astype(dtype) for _ in range(3))
    fm = la.FeatureMap(8, 16, kind=kind, seed=0)
    huge, zero = k.copy(), k.copy()
    huge[0, 50] = 3e38 if dtype == "float32" else 1e308
    zero[0, 50] = 0.0
    out_huge, out_zero = (
        backend.to_numpy(la.linear_attention(*map(backend.asarray, (q, x, v)), fm, causal=True))
        for x in (huge, zero)
    )
    np.testing.assert_array_equal(out_huge[0, :50], out_zero[0, :50])
    np.testing.assert_array_equal(out_huge[1], out_zero[1])
    if kind != "trigonometric":  # the key drops out exactly as a masked key does
        assert np.isfinite(out_huge).all()
        keep = np.arange(128) != 50
        masked = la.linear_attention(
            *map(backend.asarray, (q, zero, v)), fm, causal=True, key_mask=backend.asarray(keep)
        )
        np.testing.assert_array_equal(out_huge[0], backend.to_numpy(masked)[0])


def test_huge_inputs_get_log_features_minus_infinity() -> None:
    fm = la.FeatureMap(8, 16, kind="hyperbolic", seed=0)
    x = np.zeros((3, 8), dtype=np.float32)
    x[1] = 3e38
    x[2] = np.nan
    log_phi = fm.log_features(x)
    assert np.isfinite(log_phi[0]).all()
    assert (log_phi[1] == -np.inf).all()  # not NaN: exp(-inf) = 0, as the true value
    assert np.isnan(log_phi[2]).all()  # NaN inputs stay NaN


def _none_calls():
    fm = _map("positive")
    q = Q[0, 0]
    state = la.linear_attention(q, q, q, fm, causal=True, return_state=True)[1]
    return [
        (la.linear_attention, (None, q, q, fm), {}, "q"),
        (la.linear_attention, (q, None, q, fm), {}, "k"),
        (la.linear_attention, (q, q, None, fm), {}, "v"),
        (la.softmax_attention, (q, None, q), {}, "k"),
        (la.favor_attention, (None, q, q), {}, "q"),
        (la.linear_attention_vjp, (q, q, None, fm, q), {}, "v"),
        (fm.calibrate, (None, q), {}, "q"),
        (fm.features, (None,), {}, "x"),
        (
            la.linear_attention,
            (q, q, q, fm),
            {"causal": True, "state": dataclasses.replace(state, kv=None)},
            "state.kv",
        ),
        (
            la.linear_attention,
            (q, q, q, fm),
            {"causal": True, "state": dataclasses.replace(state, log_shift=None)},
            "state.log_shift",
        ),
    ]


@pytest.mark.parametrize(("function", "args", "kwargs", "name"), _none_calls())
def test_none_where_an_array_belongs_names_the_argument(function, args, kwargs, name) -> None:
    with pytest.raises(TypeError, match=rf"^{re.escape(name)} must be an array .*got NoneType$"):
        function(*args, **kwargs)


def test_favor_attention_with_a_zero_width_head_blames_q() -> None:
    q = np.zeros((4, 0))
    with pytest.raises(ValueError, match=r"q must have at least one feature; got shape \(4, 0\)"):
        la.favor_attention(q, q, q)


def test_softmax_and_feature_maps_accept_the_same_scales() -> None:
    q = Q[0, 0]
    for scale in (np.int64(1), 1, np.float32(0.5)):
        fm = la.FeatureMap(8, 16, scale=scale)
        assert fm.scale == float(scale)
        la.softmax_attention(q, q, q, scale=scale)
    for bad in (True, np.bool_(True), -1, np.inf, "1"):
        with pytest.raises(ValueError, match="scale must be a positive finite number"):
            la.FeatureMap(8, 16, scale=bad)
        with pytest.raises(ValueError, match="scale must be a positive finite number"):
            la.softmax_attention(q, q, q, scale=bad)
