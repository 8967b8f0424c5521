"""Exact window and sink keys, random features for the far keys (``linattn.hybrid``).

The reference is dense: the weight of key ``j`` for query ``t`` is ``exp(s q.k)`` in the
exact parts and the feature map's own estimate ``phi(q) . phi(k)`` (the same features,
computed densely) elsewhere, so every comparison is deterministic and tight: each key
in exactly one part, nothing subtracted.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from conftest import Backend, assert_close

import linattn as la

B, H, L, D = 2, 3, 41, 8


def _inputs(seed: int = 0) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    q, k, v = (rng.normal(size=(B, H, L, D)) for _ in range(3))
    mask = rng.random((B, 1, L)) > 0.2
    return q, k, v, mask


def _near(causal: bool, window: int | None, sinks: int, exact: np.ndarray | None) -> np.ndarray:
    """``(..., L, L)``: keys in an exact part (before the key mask)."""
    t, j = np.arange(L)[:, None], np.arange(L)[None, :]
    w = window or 0
    within = ((t - j) < w) & (j <= t) if causal else np.abs(t - j) < w
    near = within | ((j < sinks) & (j <= t) if causal else j < sinks)
    if exact is not None:
        near = near | exact[..., None, :]
    return near


def _reference(q, k, v, mask, fm, *, causal, window, sinks, exact=None):
    t, j = np.arange(L)[:, None], np.arange(L)[None, :]
    near = _near(causal, window, sinks, exact)
    seen = (j <= t) if causal else np.ones((L, L), dtype=bool)
    exact_weight = np.exp(np.einsum("...id,...jd->...ij", q, k) / math.sqrt(D))
    weights = np.where(near, exact_weight, 0.0)
    if fm is not None:
        lq, _ = fm.signed_log_features(q, role="query")
        lk, _ = fm.signed_log_features(k, role="key")
        estimate = np.exp(lq[..., :, None, :] + lk[..., None, :, :]).sum(-1)
        weights = weights + np.where(seen & ~near, estimate, 0.0)
    weights = weights * mask[..., None, :]
    den = weights.sum(-1, keepdims=True)
    return (weights @ v) / np.where(den == 0, 1.0, den)


CASES = [(4, 0), (4, 2), (None, 3), (1, 1), (L + 5, 1)]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("window", "sinks"), CASES)
@pytest.mark.parametrize("with_features", [True, False])
def test_hybrid_equals_the_dense_reference(
    backend: Backend, causal: bool, window: int | None, sinks: int, with_features: bool
) -> None:
    q, k, v, mask = _inputs()
    fm = la.FeatureMap(D, 32, seed=1) if with_features else None
    expected = _reference(q, k, v, mask, fm, causal=causal, window=window, sinks=sinks)
    a = backend.asarray
    out = la.linear_attention(
        a(q), a(k), a(v), fm, causal=causal, key_mask=a(mask), window=window, sink_keys=sinks
    )
    assert_close(backend, out, expected, rtol=1e-10, atol=1e-12, dtype="float64")


@pytest.mark.parametrize("with_features", [True, False])
def test_exact_key_mask_is_attended_exactly_by_every_query(
    backend: Backend, with_features: bool
) -> None:
    q, k, v, mask = _inputs(1)
    exact = np.zeros((B, 1, L), dtype=bool)
    exact[:, :, [0, 17, L - 1]] = True
    exact[1, 0, 30] = True  # rows with different numbers of exact keys
    fm = la.FeatureMap(D, 32, seed=2) if with_features else None
    expected = _reference(q, k, v, mask, fm, causal=False, window=3, sinks=1, exact=exact)
    a = backend.asarray
    out = la.linear_attention(
        a(q), a(k), a(v), fm, key_mask=a(mask), window=3, sink_keys=1, exact_key_mask=a(exact)
    )
    assert_close(backend, out, expected, rtol=1e-10, atol=1e-12, dtype="float64")


@pytest.mark.parametrize("with_features", [True, False])
@pytest.mark.parametrize(("window", "sinks"), [(4, 2), (7, 0), (None, 3), (50, 1)])
def test_whole_equals_pieces_equals_tokens(
    backend: Backend, with_features: bool, window: int | None, sinks: int
) -> None:
    q, k, v, mask = _inputs(2)
    fm = la.FeatureMap(D, 32, seed=3) if with_features else None
    a = backend.asarray
    options = {"causal": True, "window": window, "sink_keys": sinks}
    whole = la.linear_attention(a(q), a(k), a(v), fm, key_mask=a(mask), **options)
    # Token by token on NumPy only: 41 eager calls per case are slow on JAX and Dask, and
    # the pieces (one-token steps among them) cover every path's state handling.
    splits = [[0, 1, 3, 20, 21, L]]
    if backend.name == "numpy":
        splits.append(list(range(L + 1)))
    for cuts in splits:
        state, pieces = None, []
        for lo, hi in itertools.pairwise(cuts):
            out, state = la.linear_attention(
                *(a(x[..., lo:hi, :]) for x in (q, k, v)),
                fm,
                key_mask=a(mask[..., lo:hi]),
                state=state,
                return_state=True,
                **options,
            )
            pieces.append(backend.to_numpy(out))
        np.testing.assert_allclose(
            np.concatenate(pieces, axis=-2), backend.to_numpy(whole), rtol=1e-10, atol=1e-13
        )
        assert state.num_tokens == L
        assert (state.window, state.sink_keys) == (window, sinks)


def test_decoding_state_is_bounded_by_window_and_sinks() -> None:
    q, k, v, _ = _inputs(3)
    fm = la.FeatureMap(D, 16, seed=0)
    _, state = la.linear_attention(
        q, k, v, fm, causal=True, window=5, sink_keys=2, return_state=True
    )
    assert [x.shape for x in state.recent] == [(B, H, 5, D), (B, H, 5, D), (B, H, 5)]
    assert [x.shape for x in state.sinks] == [(B, H, 2, D), (B, H, 2, D), (B, H, 2)]
    assert state.kv.shape == (B, H, 16, D + 1)


def test_results_do_not_depend_on_chunk_size_and_later_keys_change_nothing() -> None:
    q, k, v, _ = _inputs(4)
    fm = la.FeatureMap(D, 32, seed=0)
    options = {"causal": True, "window": 5, "sink_keys": 2, "backend": "array_api"}
    small = la.linear_attention(q, k, v, fm, chunk_size=3, **options)
    large = la.linear_attention(q, k, v, fm, chunk_size=64, **options)
    np.testing.assert_allclose(small, large, rtol=1e-12, atol=1e-14)
    huge = k.copy()
    huge[..., 30, :] = 1e30  # overflows every product it enters
    later = la.linear_attention(q, huge, v, fm, chunk_size=8, **options)
    base = la.linear_attention(q, k, v, fm, chunk_size=8, **options)
    assert np.array_equal(later[..., :30, :], base[..., :30, :])


def test_a_window_covering_everything_is_softmax_attention(backend: Backend) -> None:
    q, k, v, mask = _inputs(5)
    fm = la.FeatureMap(D, 16, seed=0)
    a = backend.asarray
    for causal in (True, False):
        out = la.linear_attention(a(q), a(k), a(v), fm, causal=causal, key_mask=a(mask), window=L)
        expected = la.softmax_attention(q, k, v, causal=causal, key_mask=mask)
        assert_close(backend, out, expected, rtol=1e-10, atol=1e-12, dtype="float64")


def test_favor_attention_takes_the_exact_parts() -> None:
    q, k, v, _ = _inputs(6)
    out = la.favor_attention(q, k, v, num_features=32, causal=True, window=L, seed=0)
    np.testing.assert_allclose(
        out, la.softmax_attention(q, k, v, causal=True), rtol=1e-10, atol=1e-12
    )


@pytest.mark.needs("jax")
def test_jax_jit_and_a_scan_decoding_loop() -> None:
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    q, k, v, _ = _inputs(7)
    q, k, v = (x.astype(np.float32) for x in (q, k, v))
    fm = la.FeatureMap(D, 16, seed=0)
    options = {"causal": True, "window": 4, "sink_keys": 2}
    whole = la.linear_attention(q, k, v, fm, **options)
    jitted = jax.jit(lambda q, k, v: la.linear_attention(q, k, v, fm, **options))
    np.testing.assert_allclose(np.asarray(jitted(q, k, v)), whole, rtol=2e-5, atol=2e-6)

    def step(state, x):
        out, state = la.linear_attention(*x, fm, state=state, return_state=True, **options)
        return state, out

    _, state = la.linear_attention(
        *(jnp.asarray(x[..., :1, :]) for x in (q, k, v)), fm, return_state=True, **options
    )
    tokens = tuple(
        jnp.moveaxis(jnp.asarray(x[..., 1:, :]), -2, 0)[..., None, :] for x in (q, k, v)
    )
    _, outs = jax.jit(lambda s, t: jax.lax.scan(step, s, t))(state, tokens)
    decoded = np.moveaxis(np.asarray(outs)[..., 0, :], 0, -2)
    np.testing.assert_allclose(decoded, whole[..., 1:, :], rtol=2e-5, atol=2e-6)


def test_torch_gradients_through_the_hybrid() -> None:
    torch = pytest.importorskip("torch")
    q, k, v, mask = (torch.asarray(x[:1, :1, :12]) for x in _inputs(8))
    fm = la.FeatureMap(D, 8, seed=0)
    for causal in (True, False):

        def f(q, k, v, causal=causal):
            return la.linear_attention(
                q, k, v, fm, causal=causal, key_mask=mask, window=3, sink_keys=1
            )

        args = [x.clone().requires_grad_(True) for x in (q, k, v)]
        assert torch.autograd.gradcheck(f, args)


@pytest.mark.needs("dask")
def test_dask_windows_cross_chunk_boundaries() -> None:
    da = pytest.importorskip("dask.array")
    q, k, v, _ = _inputs(9)
    fm = la.FeatureMap(D, 16, seed=0)
    for causal in (True, False):
        options = {"causal": causal, "window": 6, "sink_keys": 2}
        expected = la.linear_attention(q, k, v, fm, **options)
        lazy = (da.from_array(x, chunks=(1, H, 10, D)) for x in (q, k, v))
        out = la.linear_attention(*lazy, fm, **options)
        assert isinstance(out, da.Array)
        np.testing.assert_allclose(out.compute(), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"window": 0}, "window must be a positive integer or None; got 0"),
        ({"window": 2.5}, "window must be a positive integer or None; got 2.5"),
        ({"sink_keys": -1}, "sink_keys must be a non-negative integer; got -1"),
        (
            {"window": 3, "causal": True, "exact_key_mask": np.ones(L, dtype=bool)},
            "exact_key_mask is for bidirectional attention",
        ),
        ({"exact_key_mask": np.ones(L - 1, dtype=bool)}, "exact_key_mask must have shape"),
        ({"window": 3, "scale": 0.1}, r"scale is the feature map's"),
    ],
)
def test_bad_options_are_named(options: dict, message: str) -> None:
    q, k, v, _ = _inputs()
    with pytest.raises((ValueError, TypeError), match=message):
        la.linear_attention(q, k, v, la.FeatureMap(D, 8), **options)


def test_the_maps_scale_rounded_to_float32_is_the_maps_scale() -> None:
    q, k, v, _ = _inputs()
    fm = la.FeatureMap(D, 8)
    rounded = float(np.float32(fm.scale))
    assert rounded != fm.scale  # one rounding step away, as a float32 model passes it
    for options in ({}, {"window": 3}):
        expected = la.linear_attention(q, k, v, fm, **options)
        np.testing.assert_array_equal(
            la.linear_attention(q, k, v, fm, scale=rounded, **options), expected
        )
        with pytest.raises(ValueError, match=r"scale is the feature map's"):
            la.linear_attention(q, k, v, fm, scale=fm.scale * (1 + 1e-4), **options)
    plan = la.plan_attention(q, k, v, fm, scale=rounded)
    assert plan is not None


def test_options_need_shared_positions_and_the_same_continuation() -> None:
    q, k, v, _ = _inputs()
    fm = la.FeatureMap(D, 8)
    with pytest.raises(ValueError, match="same length"):
        la.linear_attention(q[..., :5, :], k, v, fm, window=3)
    _, state = la.linear_attention(q, k, v, fm, causal=True, window=3, return_state=True)
    with pytest.raises(ValueError, match=r"window=3, sink_keys=0.*got window=4"):
        la.linear_attention(q, k, v, fm, causal=True, window=4, state=state)
    with pytest.raises(ValueError, match="got window=None"):
        la.linear_attention(q, k, v, fm, causal=True, state=state)
    with pytest.raises(TypeError, match="None only with window or sink_keys"):
        la.linear_attention(q, k, v, None)
    out = la.linear_attention(q, k, v, None, window=2, scale=0.5)
    expected = _reference(
        q * math.sqrt(0.5 * math.sqrt(D)),
        k * math.sqrt(0.5 * math.sqrt(D)),
        v,
        np.ones((1, 1, L), dtype=bool),
        None,
        causal=False,
        window=2,
        sinks=0,
    )
    np.testing.assert_allclose(out, expected, rtol=1e-10)


@pytest.mark.parametrize("batch", [H, 2])  # B == H is the case that used to be wrong
def test_a_batch_by_length_mask_of_four_dimensional_keys_is_refused(batch: int) -> None:
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(batch, H, 6, D)) for _ in range(3))
    mask = rng.random((batch, 6)) > 0.3
    fm = la.FeatureMap(D, 8, seed=0)
    calls = [
        lambda: la.softmax_attention(q, k, v, key_mask=mask),
        lambda: la.linear_attention(q, k, v, fm, key_mask=mask),
        lambda: la.linear_attention_vjp(q, k, v, fm, q, key_mask=mask),
        lambda: la.FeatureMap(D, 8, kind="oprf").calibrate(q, k, key_mask=mask),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=r"key_mask must have shape \(6,\) or exactly 3 axes"):
            call()
    fine = la.linear_attention(q, k, v, fm, key_mask=mask[:, None, :])
    per_row = [la.linear_attention(q[b], k[b], v[b], fm, key_mask=mask[b]) for b in range(batch)]
    np.testing.assert_allclose(fine, np.stack(per_row), rtol=1e-12)


def test_calibrate_leaves_padded_queries_out() -> None:
    rng = np.random.default_rng(0)
    q, k = rng.normal(size=(2, 10, D)), rng.normal(size=(2, 10, D))
    keep = np.ones((2, 10), dtype=bool)
    keep[1, 6:] = False
    padded_q = np.where(keep[..., None], q, 5.0)  # padding rows that would shift A
    fm = la.FeatureMap(D, 8, kind="oprf")
    with_mask = fm.calibrate(padded_q, k, key_mask=keep, query_mask=keep)
    reference = fm.calibrate(q[keep][None], k[keep][None])
    assert with_mask.oprf_a == pytest.approx(reference.oprf_a, rel=1e-12)
    assert fm.calibrate(padded_q, k, key_mask=keep).oprf_a != pytest.approx(reference.oprf_a)
    with pytest.raises(ValueError, match=r"query_mask must have shape \(10,\)"):
        fm.calibrate(q, k, query_mask=keep[:, :5])


@pytest.mark.parametrize("with_features", [True, False])
@pytest.mark.parametrize(
    ("causal", "options"),
    [
        (True, {"window": 4, "sink_keys": 2}),
        (True, {"sink_keys": 3}),
        (False, {"window": 4, "sink_keys": 2}),
        (False, {"window": 3, "sink_keys": 1, "exact": True}),
        (False, {"sink_keys": 2}),
    ],
)
def test_vjp_equals_central_differences(causal: bool, options: dict, with_features: bool) -> None:
    q, k, v, mask = (x[:, :1, :13] for x in _inputs(10))
    options = dict(options)
    if options.pop("exact", False):
        exact = np.zeros((B, 1, 13), dtype=bool)
        exact[:, :, 6] = True
        exact[1, :, 11] = True
        options["exact_key_mask"] = exact
    fm = la.FeatureMap(D, 8, seed=0) if with_features else None
    grad = np.random.default_rng(0).normal(size=q.shape)
    kw = {"causal": causal, "key_mask": mask, **options}
    grads = la.linear_attention_vjp(q, k, v, fm, grad, **kw)
    eps = 1e-6
    for which, g in enumerate(grads):
        for index in [(0, 0, 0, 0), (1, 0, 5, 3), (0, 0, 12, 7), (1, 0, 11, 1)]:
            args = [q, k, v]
            up, down = args[which].copy(), args[which].copy()
            up[index] += eps
            down[index] -= eps
            f_up = la.linear_attention(
                *[up if i == which else a for i, a in enumerate(args)], fm, **kw
            )
            f_down = la.linear_attention(
                *[down if i == which else a for i, a in enumerate(args)], fm, **kw
            )
            numeric = np.sum(grad * (f_up - f_down)) / (2 * eps)
            assert g[index] == pytest.approx(numeric, rel=1e-6, abs=1e-8), (which, index)
