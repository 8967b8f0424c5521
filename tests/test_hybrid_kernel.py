"""The one-pass causal hybrid kernel (``linattn_numba.cpu.hybrid``) against the portable parts.

The reference is ``linear_attention`` itself on ``array_api_strict`` arrays (which no
kernel serves): the window, the sinks and the far keys as separate parts, merged.  The
kernel computes the same estimate (the same features, the same keys in each part), so
the two agree to rounding; float32 is held to float64.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import linattn as la
from linattn import _dispatch

_hybrid = pytest.importorskip("linattn_numba.cpu.hybrid")
xps = pytest.importorskip("array_api_strict")

#: The same estimate rounded differently: float64 agrees to a few hundred ulp of the
#: outputs (O(1)); float32 carries ~1e-6 relative rounding in logits of size ~5.
FLOAT64 = {"rtol": 1e-10, "atol": 1e-12}
FLOAT32 = {"rtol": 2e-5, "atol": 2e-5}
BATCH, LENGTH, D = (2, 3), 150, 8


def _inputs(dtype: str = "float64", seed: int = 0) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    q, k, v = (rng.normal(size=(*BATCH, LENGTH, D)).astype(dtype) for _ in range(3))
    mask = rng.random((BATCH[0], 1, LENGTH)) > 0.25
    mask[1, 0, :2] = False  # a masked sink
    return q, k, v, mask


def _options(window: int | None, sinks: int, chunk_size: int = 16) -> dict:
    return {"causal": True, "window": window, "sink_keys": sinks, "chunk_size": chunk_size}


def _launches() -> int:
    return sum(_hybrid._forward.launches.values())


@pytest.mark.parametrize("kind", ["positive", "hyperbolic"])
@pytest.mark.parametrize(("window", "sinks"), [(5, 3), (40, 0), (40, 2), (None, 4), (1, 1)])
def test_kernel_equals_the_portable_parts(kind: str, window: int | None, sinks: int) -> None:
    q, k, v, mask = _inputs()
    fm = la.FeatureMap(D, 16, kind=kind, seed=1)
    before = _launches()
    got = la.linear_attention(q, k, v, fm, key_mask=mask, **_options(window, sinks))
    assert _launches() == before + 1
    a = xps.asarray
    want = la.linear_attention(a(q), a(k), a(v), fm, key_mask=a(mask), **_options(window, sinks))
    np.testing.assert_allclose(got, np.asarray(want), **FLOAT64)
    q32, k32, v32 = (x.astype(np.float32) for x in (q, k, v))
    got32 = la.linear_attention(q32, k32, v32, fm, key_mask=mask, **_options(window, sinks))
    assert got32.dtype == np.float32
    np.testing.assert_allclose(got32, got, **FLOAT32)


@pytest.mark.parametrize("window", [6, _hybrid.BLOCKED_SPAN + 4])
def test_whole_equals_pieces_and_tokens_and_any_chunk(window: int) -> None:
    q, k, v, mask = _inputs(seed=1)
    fm = la.FeatureMap(D, 16, seed=2)
    whole, state = la.linear_attention(
        q, k, v, fm, key_mask=mask, return_state=True, **_options(window, 2)
    )
    other_chunk = la.linear_attention(
        q, k, v, fm, key_mask=mask, **_options(window, 2, chunk_size=7)
    )
    np.testing.assert_allclose(other_chunk, whole, **FLOAT64)
    pieces, piece_state = [], None
    for start, stop in ((0, 1), (1, 40), (40, 41), (41, LENGTH)):  # tokens and pieces
        out, piece_state = la.linear_attention(
            q[..., start:stop, :], k[..., start:stop, :], v[..., start:stop, :], fm,
            key_mask=mask[..., start:stop], state=piece_state, return_state=True,
            **_options(window, 2),
        )  # fmt: skip
        pieces.append(out)
    np.testing.assert_allclose(np.concatenate(pieces, axis=-2), whole, **FLOAT64)
    np.testing.assert_allclose(piece_state.kv, state.kv, **FLOAT64)
    np.testing.assert_allclose(piece_state.log_shift, state.log_shift, **FLOAT64)


@pytest.mark.parametrize("window", [5, _hybrid.BLOCKED_SPAN + 3])  # direct loops; products
def test_masked_keys_never_reach_a_row(window: int) -> None:
    q, k, v, mask = _inputs(seed=3)
    fm = la.FeatureMap(D, 16, seed=3)
    clean = la.linear_attention(q, k, v, fm, key_mask=mask, **_options(window, 3))
    hidden = np.broadcast_to(~mask, k.shape[:-1])
    bad_k, bad_v = k.copy(), v.copy()
    bad_k[hidden], bad_v[hidden] = np.nan, np.inf
    dirty = la.linear_attention(q, bad_k, bad_v, fm, key_mask=mask, **_options(window, 3))
    assert np.array_equal(dirty, clean)


@pytest.mark.parametrize("window", [5, _hybrid.BLOCKED_SPAN + 3])
def test_serial_and_parallel_variants_agree(monkeypatch: pytest.MonkeyPatch, window: int) -> None:
    q, k, v, mask = _inputs(seed=4)
    fm = la.FeatureMap(D, 16, seed=4)
    results = []
    for variant in ("serial", "parallel"):
        monkeypatch.setattr(_hybrid._machinery, "choose_variant", lambda *_, v=variant: v)
        results.append(la.linear_attention(q, k, v, fm, key_mask=mask, **_options(window, 3)))
    assert np.array_equal(results[0], results[1])


def test_other_paths_do_not_take_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v, _ = _inputs()
    fm = la.FeatureMap(D, 16, seed=1)
    assert _dispatch.hybrid_kernel_for(q, "auto") is _hybrid
    assert _dispatch.hybrid_kernel_for(q, "array_api") is None
    assert _dispatch.hybrid_kernel_for(xps.asarray(q), "auto") is None
    before = _launches()
    la.linear_attention(q, k, v, None, **_options(5, 3))  # no feature map: the window kernel
    la.linear_attention(q, k, v, fm, **{**_options(None, 3), "causal": False})  # no window
    for causal in (True, False):
        la.linear_attention(
            q, k, v, fm, **{**_options(5, 3), "causal": causal}, backend="array_api"
        )
    monkeypatch.setenv("LINATTN_BACKEND", "array_api")
    la.linear_attention(q, k, v, fm, **_options(5, 3))
    la.linear_attention(q, k, v, fm, **{**_options(5, 3), "causal": False})
    assert _launches() == before


# -- bidirectional: a reverse scan of the later far keys, then the forward scan ----------


def _bidirectional(window: int | None, sinks: int, chunk_size: int = 16, **extra: object) -> dict:
    return {**_options(window, sinks, chunk_size), "causal": False, **extra}


def _bidirectional_against_the_portable_parts(
    kind: str, window: int | None, sinks: int, exact: bool, launches: Any
) -> None:
    """One kernel launch (counted by ``launches``), equal to the portable parts on
    ``array_api_strict`` (float64), float32 held to float64."""
    q, k, v, mask = _inputs()
    fm = la.FeatureMap(D, 16, kind=kind, seed=1)
    extra = {}
    if exact:
        chosen = np.zeros((BATCH[0], 1, LENGTH), bool)
        chosen[0, 0, [3, 70, 149]] = chosen[1, 0, [0, 100]] = True
        extra = {"exact_key_mask": chosen}
    options = _bidirectional(window, sinks, **extra)
    before = launches()
    got = la.linear_attention(q, k, v, fm, key_mask=mask, **options)
    assert launches() == before + 1
    a = xps.asarray
    strict = {**options, **{name: a(x) for name, x in extra.items()}}
    want = la.linear_attention(a(q), a(k), a(v), fm, key_mask=a(mask), **strict)
    np.testing.assert_allclose(got, np.asarray(want), **FLOAT64)
    q32, k32, v32 = (x.astype(np.float32) for x in (q, k, v))
    got32 = la.linear_attention(q32, k32, v32, fm, key_mask=mask, **options)
    assert got32.dtype == np.float32
    np.testing.assert_allclose(got32, got, **FLOAT32)


@pytest.mark.parametrize("kind", ["positive", "hyperbolic"])
@pytest.mark.parametrize(
    ("window", "sinks", "exact"),
    [(5, 3, False), (40, 0, False), (12, 2, False), (1, 1, False), (200, 0, False), (5, 0, True)],
)
def test_bidirectional_kernel_equals_the_portable_parts(
    kind: str, window: int, sinks: int, exact: bool
) -> None:
    """Windows of ``2 w - 1`` keys: 9 and 23 (direct loops, products), 79 and 1 (edges),
    one beyond the sequence; sinks, and ``exact_key_mask``'s gathered keys."""
    _bidirectional_against_the_portable_parts(kind, window, sinks, exact, _launches)


@pytest.mark.parametrize("window", [4, _hybrid.BLOCKED_SPAN, None])  # loops; products; none
def test_bidirectional_any_chunk_and_masked_keys_never_reach_a_row(window: int | None) -> None:
    q, k, v, mask = _inputs(seed=5)
    fm = la.FeatureMap(D, 16, seed=5)
    clean = la.linear_attention(q, k, v, fm, key_mask=mask, **_bidirectional(window, 2))
    other = la.linear_attention(q, k, v, fm, key_mask=mask, **_bidirectional(window, 2, 7))
    np.testing.assert_allclose(other, clean, **FLOAT64)
    hidden = np.broadcast_to(~mask, k.shape[:-1])
    bad_k, bad_v = k.copy(), v.copy()
    bad_k[hidden], bad_v[hidden] = np.nan, np.inf
    dirty = la.linear_attention(q, bad_k, bad_v, fm, key_mask=mask, **_bidirectional(window, 2))
    assert np.array_equal(dirty, clean)


def test_bidirectional_serial_and_parallel_variants_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v, mask = _inputs(seed=6)
    fm = la.FeatureMap(D, 16, seed=6)
    results = []
    for variant in ("serial", "parallel"):
        monkeypatch.setattr(_hybrid._machinery, "choose_variant", lambda *_, v=variant: v)
        results.append(la.linear_attention(q, k, v, fm, key_mask=mask, **_bidirectional(20, 3)))
    assert np.array_equal(results[0], results[1])


@pytest.mark.parametrize("kind", ["positive", "hyperbolic"])
def test_bidirectional_kernel_against_a_quadratic_reference(kind: str) -> None:
    """The estimate written out with all ``L x L`` weights (NumPy float64): a key ``j``
    with ``|t - j| < w`` weighs ``exp(s q_t . k_j)``, any other ``phi(q_t) . phi(k_j)``
    (both scans), a masked key nothing."""
    rng = np.random.default_rng(7)
    length, w, dv = 90, 7, 3
    q, k = (0.5 * rng.normal(size=(2, length, D)) for _ in range(2))
    v = rng.normal(size=(2, length, dv))
    keep = rng.random((2, length)) > 0.2
    fm = la.FeatureMap(D, 32, kind=kind, seed=7)
    log_q, sign_q = fm.signed_log_features(q, role="query")
    log_k, sign_k = fm.signed_log_features(k, role="key")
    phi_q, phi_k = (
        np.exp(x) * (1 if s is None else s) for x, s in [(log_q, sign_q), (log_k, sign_k)]
    )
    far = phi_q @ np.swapaxes(phi_k, -1, -2)
    exact = np.exp(fm.scale * q @ np.swapaxes(k, -1, -2))
    near = np.abs(np.arange(length)[:, None] - np.arange(length)) < w
    weights = np.where(near, exact, far) * keep[:, None, :]
    want = weights @ v / weights.sum(-1, keepdims=True)
    sinks = np.zeros((2, 0, D)), np.zeros((2, 0, dv)), np.zeros((2, length, 0), bool)
    got = _hybrid.bidirectional_forward(
        q, k, v, keep, w, fm.scale, *sinks, np.asarray(fm.projection),
        hyperbolic=kind == "hyperbolic", chunk_size=8,
    )  # fmt: skip
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)


def _bidirectional_launches() -> int:
    from linattn_numba.cpu import bidirectional as kernel

    return sum(kernel._forward.launches.values())


@pytest.mark.parametrize("kind", ["positive", "hyperbolic"])
@pytest.mark.parametrize(("sinks", "exact"), [(4, False), (0, True), (2, True)])
def test_bidirectional_sinks_without_a_window_take_the_fused_pass(
    kind: str, sinks: int, exact: bool
) -> None:
    """No window: the far keys are one global state, and the fused bidirectional pass
    merges each query's exact keys with its row; as the portable parts."""
    _bidirectional_against_the_portable_parts(kind, None, sinks, exact, _bidirectional_launches)


@pytest.mark.parametrize("kind", ["positive", "hyperbolic"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_bidirectional_log_normaliser_against_a_reference(kind: str, dtype: str) -> None:
    """``log sum_j phi(q_t) . phi(k_j)`` over the kept keys, written out in float64 with
    the map's own log-features; ``-inf`` for a row of queries that sees no key, and the
    outputs those of the plain call."""
    from linattn_numba.cpu import bidirectional as kernel

    rng = np.random.default_rng(8)
    q, k = (rng.normal(size=(3, 40, D)).astype(dtype) for _ in range(2))
    v = rng.normal(size=(3, 40, 5)).astype(dtype)
    keep = rng.random((3, 40)) > 0.3
    keep[2] = False  # a batch row with no key
    fm = la.FeatureMap(D, 16, kind=kind, seed=8)
    out, _, _, lse = kernel.favor_bidirectional(
        q, k, v, np.asarray(fm.projection), hyperbolic=kind == "hyperbolic",
        scale=fm.scale, key_mask=keep, return_log_normaliser=True,
    )  # fmt: skip
    log_q, sign_q = fm.signed_log_features(q.astype(np.float64), role="query")
    log_k, sign_k = fm.signed_log_features(k.astype(np.float64), role="key")
    assert sign_q is None and sign_k is None  # (positive features: no signs)
    pairs = log_q[:, :, None, :] + log_k[:, None, :, :]  # (batch, t, j, r)
    pairs = np.where(keep[:, None, :, None], pairs, -np.inf)
    top = np.max(pairs, axis=(2, 3), keepdims=True)
    with np.errstate(invalid="ignore"):  # the row with no key: -inf - -inf
        want = np.log(np.sum(np.exp(pairs - top), axis=(2, 3))) + top[..., 0, 0]
    want[2] = -np.inf
    tolerance = FLOAT64 if dtype == "float64" else {"rtol": 1e-5, "atol": 1e-5}
    np.testing.assert_allclose(lse[:2], want[:2], **tolerance)
    assert np.all(lse[2] == -np.inf) and np.all(out[2] == 0)
    plain, _, _ = kernel.favor_bidirectional(
        q, k, v, np.asarray(fm.projection), hyperbolic=kind == "hyperbolic",
        scale=fm.scale, key_mask=keep,
    )  # fmt: skip
    assert np.array_equal(out, plain)
    keys, values, seen = k[:, :2], v[:, :2], np.ones((3, 40, 2), bool)
    for bad, error, message in [
        ((keys, values), TypeError, "sinks must be a tuple"),
        ((keys, v[:, :3], seen), ValueError, r"sink values must have shape \(\*batch, 2, 5\)"),
        ((keys, values, seen[:, :7]), ValueError, r"visible must have shape \(\*batch, 40, 2\)"),
        ((keys, values, seen.astype(int)), TypeError, "visible must have dtype bool"),
    ]:
        with pytest.raises(error, match=message):
            kernel.favor_bidirectional(
                q, k, v, np.asarray(fm.projection), hyperbolic=False, scale=fm.scale,
                sinks=bad,
            )  # fmt: skip
    with pytest.raises(TypeError, match="return_log_normaliser must be True or False; got 1"):
        kernel.favor_bidirectional(
            q, k, v, np.asarray(fm.projection), hyperbolic=False, scale=fm.scale,
            return_log_normaliser=1,
        )  # fmt: skip


def test_bidirectional_bad_inputs_are_named() -> None:
    args = _call()
    for name in ("recent", "recent_values", "span", "kv", "log_shift"):
        del args[name]
    args["keep"] = args["keep"][:, :6]
    _hybrid.bidirectional_forward(**args, window=2)  # (valid)
    with pytest.raises(ValueError, match="window must be a positive integer; got 0"):
        _hybrid.bidirectional_forward(**args, window=0)
    with pytest.raises(ValueError, match=r"keep must have shape \(2, 6\) for q"):
        _hybrid.bidirectional_forward(**{**args, "keep": np.ones((2, 8), bool)}, window=2)
    with pytest.raises(TypeError, match="sinks must have dtype float64; got float32"):
        _hybrid.bidirectional_forward(
            **{**args, "sinks": np.zeros((2, 1, 4), np.float32)}, window=2
        )


def _call(**change: object) -> dict:
    rng = np.random.default_rng(0)
    length, span, d, dv, m = 6, 2, 4, 3, 8
    args = {
        "q": rng.normal(size=(2, length, d)),
        "k": rng.normal(size=(2, length, d)),
        "v": rng.normal(size=(2, length, dv)),
        "keep": np.ones((2, length + span), bool),
        "recent": rng.normal(size=(2, span, d)),
        "recent_values": rng.normal(size=(2, span, dv)),
        "span": span,
        "scale": 0.5,
        "sinks": np.zeros((2, 1, d)),
        "sink_values": np.zeros((2, 1, dv)),
        "visible": np.ones((2, length, 1), bool),
        "projection": rng.normal(size=(m, d)),
        "hyperbolic": False,
        "kv": np.zeros((2, m, dv + 1)),
        "log_shift": np.full((2, m), -np.inf),
        "chunk_size": 4,
    }
    args.update(change)
    return args


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"q": [[0.0]]}, TypeError, "q must be a numpy.ndarray; got builtins.list"),
        ({"span": -1}, ValueError, "span must be a non-negative integer; got -1"),
        ({"span": 3}, ValueError, r"keep must have shape \(2, 9\) for q"),
        ({"recent": np.zeros((2, 1, 4))}, ValueError, r"recent must have shape \(2, 2, 4\)"),
        ({"scale": float("nan")}, ValueError, "scale must be positive and finite; got nan"),
        ({"keep": np.ones((2, 8))}, TypeError, "keep must have dtype bool; got float64"),
        (
            {"visible": np.ones((2, 5, 1), bool)},
            ValueError,
            r"visible must have shape \(2, 6, 1\)",
        ),
        ({"kv": np.zeros((2, 8, 4), np.float32)}, TypeError, "kv must have dtype float64"),
        ({"projection": np.ones((8, 5))}, ValueError, r"projection \(8, 5\) does not match"),
        ({"chunk_size": 0}, ValueError, "chunk_size"),
    ],
)
def test_bad_inputs_are_named(change: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        _hybrid.causal_forward(**_call(**change))


@pytest.mark.parametrize(
    ("causal", "options", "far_parts"),
    [
        (True, {"window": 16, "sink_keys": 3}, 1),
        (True, {"sink_keys": 2}, 1),
        (False, {"window": 16, "sink_keys": 2}, 2),  # forward and reverse lagged scans
    ],
)
def test_vjp_far_parts_run_the_fused_backward(
    monkeypatch: pytest.MonkeyPatch, causal: bool, options: dict, far_parts: int
) -> None:
    """On NumPy the hybrid VJP's far parts run the fused causal backward (one call each,
    never the portable ``causal_vjp`` on ``L x m`` features), and its gradients equal
    the portable parts' adjoints (``backend="array_api"``)."""
    from linattn import vjp

    rng = np.random.default_rng(21)
    q, k, v = (rng.normal(size=(*BATCH, LENGTH, D)) for _ in range(3))
    mask = rng.random((*BATCH, LENGTH)) > 0.2
    g = rng.normal(size=q.shape)
    fm = la.FeatureMap(D, 16, seed=21)
    kw = {"causal": causal, "key_mask": mask, "chunk_size": 16, **options}
    expected = la.linear_attention_vjp(q, k, v, fm, g, **kw, backend="array_api")
    calls: list[str] = []
    fused, portable = _dispatch.fused_causal_rows_vjp, vjp.causal_vjp

    def spy(name: str, function: Any) -> Any:
        return lambda *a, **o: calls.append(name) or function(*a, **o)

    monkeypatch.setattr(_dispatch, "fused_causal_rows_vjp", spy("fused", fused))
    monkeypatch.setattr(vjp, "causal_vjp", spy("portable", portable))
    got = la.linear_attention_vjp(q, k, v, fm, g, **kw)
    assert calls == ["fused"] * far_parts
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_allclose(a, b, **FLOAT64)
