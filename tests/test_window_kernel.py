"""The compiled window kernel (``linattn_numba.cpu.window``) against the portable code.

The reference is ``linattn.hybrid.banded_partial`` itself, run on ``array_api_strict``
arrays (which no kernel serves), so the kernel is held to the exact contract the
hybrid relies on; the backward is held to central finite differences.
"""

from __future__ import annotations

import numpy as np
import pytest

import linattn as la
from linattn import _dispatch, hybrid

_window = pytest.importorskip("linattn_numba.cpu.window")
_readonly = pytest.importorskip("linattn_numba.cpu.arrays").readonly
xps = pytest.importorskip("array_api_strict")

SCALE = 0.35
#: float32: logits of size ~5 carry ~1e-6 absolute rounding, so the weights ~1e-6 relative.
TOLERANCE = {"float64": {"rtol": 1e-12, "atol": 1e-13}, "float32": {"rtol": 1e-5, "atol": 1e-6}}


def _inputs(span: int, length: int, dtype: str = "float64", seed: int = 0) -> tuple:
    rng = np.random.default_rng(seed)
    batch, d, dv = (2, 3), 8, 5
    q = rng.normal(size=(*batch, length, d)).astype(dtype)
    keys = rng.normal(size=(*batch, length + span, d)).astype(dtype)
    values = rng.normal(size=(*batch, length + span, dv)).astype(dtype)
    keep = rng.random((*batch, length + span)) > 0.3
    keep[0, 1, : span + 3] = False  # queries 0 .. 2 of this head see no key at all
    return q, keys, values, keep


def _portable(q, keys, values, keep, span, scale=SCALE) -> tuple[np.ndarray, np.ndarray]:
    a = xps.asarray
    rows, top = hybrid.banded_partial(xps, a(q), a(keys), a(values), a(keep), span, scale)
    return np.asarray(rows), np.asarray(top)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("span", [1, 4, 64])
@pytest.mark.parametrize("length", [70, 5])  # not a multiple of the portable block; < span
def test_kernel_equals_the_portable_code(dtype: str, span: int, length: int) -> None:
    q, keys, values, keep = _inputs(span, length, dtype)
    rows, top = _window.banded_partial(q, keys, values, keep, span, SCALE)
    expected_rows, expected_top = _portable(q, keys, values, keep, span)
    assert rows.dtype == top.dtype == np.dtype(dtype)
    np.testing.assert_allclose(rows, expected_rows, **TOLERANCE[dtype])
    np.testing.assert_allclose(top, expected_top, **TOLERANCE[dtype])
    if span < length:  # (the hidden head's first queries; with span >= T they may see keys)
        assert np.all(top[0, 1, :3] == -np.inf) and np.all(rows[0, 1, :3] == 0)


def test_invisible_keys_never_reach_a_row() -> None:
    span, length = 4, 30
    q, keys, values, keep = _inputs(span, length)
    rows, top = _window.banded_partial(q, keys, values, keep, span, SCALE)
    bad_k, bad_v = keys.copy(), values.copy()
    bad_k[~keep], bad_v[~keep] = np.nan, np.inf  # masked keys hold garbage
    bad_k[..., -1, :], bad_v[..., -1, :] = 1e300, -np.inf  # the last key: last query only
    keep_last = keep.copy()
    keep_last[..., -1] = True
    with np.errstate(over="ignore", invalid="ignore"):
        got_rows, got_top = _window.banded_partial(q, bad_k, bad_v, keep_last, span, SCALE)
    assert np.array_equal(got_rows[..., :-1, :], rows[..., :-1, :])
    assert np.array_equal(got_top[..., :-1], top[..., :-1])
    keep[..., -1] = False
    clean, _ = _window.banded_partial(q, keys, values, keep, span, SCALE)
    with np.errstate(over="ignore", invalid="ignore"):
        masked, _ = _window.banded_partial(q, bad_k, bad_v, keep, span, SCALE)
    assert np.array_equal(masked, clean)


def test_serial_and_parallel_variants_agree_and_inputs_need_not_be_contiguous() -> None:
    span, length = 6, 40
    q, keys, values, keep = _inputs(span, length)
    expected = _window.banded_partial(q, keys, values, keep, span, SCALE)
    # (read-only, as the entry points pass every input: no second signature to compile)
    flat = [_readonly(x.reshape((6, *x.shape[2:]))) for x in (q, keys, values, keep)]
    consts = _window._consts(np.dtype("float64"), SCALE)
    for variant in ("serial", "parallel"):
        rows, top = np.empty((6, length, 6)), np.empty((6, length))
        _window._forward.run(variant, *flat, span, consts, rows, top)
        assert np.array_equal(rows.reshape(expected[0].shape), expected[0])
        assert np.array_equal(top.reshape(expected[1].shape), expected[1])
    strided = (np.asfortranarray(q), keys[..., ::-1, :][..., ::-1, :], values, keep)
    for got, want in zip(_window.banded_partial(*strided, span, SCALE), expected, strict=True):
        assert np.array_equal(got, want)


def _unstabilised(q, keys, values, keep, span, shift) -> np.ndarray:
    """``exp(c - shift) rows``: the rows on a fixed scale (what the backward differentiates)."""
    rows, top = _window.banded_partial(q, keys, values, keep, span, SCALE)
    return rows * np.exp(top - shift)[..., None]


@pytest.mark.parametrize("span", [1, 3])
def test_backward_equals_central_differences(span: int) -> None:
    rng = np.random.default_rng(1)
    length, d, dv = 7, 3, 2
    q, keys = rng.normal(size=(2, length, d)), rng.normal(size=(2, length + span, d))
    values = rng.normal(size=(2, length + span, dv))
    keep = rng.random((2, length + span)) > 0.25
    g = rng.normal(size=(2, length, dv + 1))
    _, top = _window.banded_partial(q, keys, values, keep, span, SCALE)
    shift = np.where(np.isfinite(top), top, 0.0)
    grads = _window.banded_partial_backward(q, keys, values, keep, span, SCALE, top, g)
    inputs = [q, keys, values]
    step = 1e-6
    for which, grad in enumerate(grads):
        numeric = np.zeros_like(grad)
        for index in np.ndindex(grad.shape):
            total = []
            for sign in (1, -1):
                moved = [x.copy() for x in inputs]
                moved[which][index] += sign * step
                total.append(np.sum(g * _unstabilised(*moved, keep, span, shift)))
            numeric[index] = (total[0] - total[1]) / (2 * step)
        np.testing.assert_allclose(grad, numeric, rtol=1e-7, atol=1e-9)
    assert np.all(grads[1][~keep] == 0) and np.all(grads[2][~keep] == 0)


def test_backward_takes_float32() -> None:
    q, keys, values, keep = _inputs(4, 20, "float32")
    rows, top = _window.banded_partial(q, keys, values, keep, 4, SCALE)
    g = np.ones_like(rows)
    single = _window.banded_partial_backward(q, keys, values, keep, 4, SCALE, top, g)
    double = _window.banded_partial_backward(
        *(x.astype(np.float64) for x in (q, keys, values)), keep, 4, SCALE,
        top.astype(np.float64), g.astype(np.float64),
    )  # fmt: skip
    for got, want in zip(single, double, strict=True):
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def _bad(**change: object) -> dict[str, object]:
    q, keys, values, keep = _inputs(2, 6)
    args: dict[str, object] = {
        "q": q, "keys": keys, "values": values, "keep": keep, "span": 2, "scale": SCALE,
    }  # fmt: skip
    args.update(change)
    return args


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"q": [[0.0]]}, TypeError, "q must be a numpy.ndarray; got builtins.list"),
        ({"span": 0}, ValueError, "span must be a positive integer; got 0"),
        ({"span": 3}, ValueError, r"keys must have shape \(2, 3, 9, 8\) for q"),
        ({"scale": float("nan")}, ValueError, "scale must be finite; got nan"),
        ({"scale": "1"}, TypeError, "scale must be a real number; got '1'"),
        ({"keep": np.ones((2, 3, 8))}, TypeError, "keep must have dtype bool; got float64"),
        ({"keep": np.ones((2, 3, 7), bool)}, ValueError, r"keep must have shape \(2, 3, 8\)"),
        (
            {"values": np.ones((2, 3, 8, 5), np.float32)},
            TypeError,
            r"values must have dtype float32 or float64, the same as q \(float64\); got float32",
        ),
        (
            {"q": np.ones((2, 3, 6, 8), np.int64)},
            TypeError,
            "q must have dtype float32 or float64",
        ),
        ({"values": np.ones((2, 1, 8, 5))}, ValueError, r"values must have shape \(2, 3, 8, 5\)"),
    ],
)
def test_bad_inputs_are_named(change: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        _window.banded_partial(**_bad(**change))


def test_backward_checks_its_cotangent_and_log_scale() -> None:
    args = _bad()
    rows, top = _window.banded_partial(**args)
    with pytest.raises(ValueError, match=r"g_rows must have shape \(2, 3, 6, 6\)"):
        _window.banded_partial_backward(**args, log_scale=top, g_rows=rows[..., :-1])
    with pytest.raises(ValueError, match=r"log_scale must have shape \(2, 3, 6\)"):
        _window.banded_partial_backward(**args, log_scale=top[..., :-1], g_rows=rows)


def test_numpy_windows_run_the_kernel_unless_the_portable_code_is_asked_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rng = np.random.default_rng(2)
    q, k, v = (rng.normal(size=(2, 12, 4)) for _ in range(3))
    assert _dispatch.window_kernel_for(q, "auto") is _window
    assert _dispatch.window_kernel_for(xps.asarray(q), "auto") is None
    assert _dispatch.window_kernel_for(q, "array_api") is None
    before = sum(_window._forward.launches.values())
    compiled = la.linear_attention(q, k, v, None, causal=True, window=3, sink_keys=1)
    assert sum(_window._forward.launches.values()) == before + 1
    # The call's own backend (this was the environment's alone: the kernel ran)...
    portable = la.linear_attention(
        q, k, v, None, causal=True, window=3, sink_keys=1, backend="array_api"
    )
    assert sum(_window._forward.launches.values()) == before + 1
    np.testing.assert_allclose(compiled, portable, rtol=1e-12, atol=1e-14)
    # ... and the environment's, where the call names none.
    monkeypatch.setenv("LINATTN_BACKEND", "array_api")
    portable = la.linear_attention(q, k, v, None, causal=True, window=3, sink_keys=1)
    assert sum(_window._forward.launches.values()) == before + 1
    np.testing.assert_allclose(compiled, portable, rtol=1e-12, atol=1e-14)
    # An explicit backend beats the environment's.
    again = la.linear_attention(q, k, v, None, causal=True, window=3, sink_keys=1, backend="auto")
    assert sum(_window._forward.launches.values()) == before + 2
    np.testing.assert_allclose(again, compiled, rtol=0, atol=0)
