"""The fused bidirectional CPU pass (``linattn_numba.cpu.bidirectional``) against the array API."""

from __future__ import annotations

import numpy as np
import pytest

import linattn as la
from linattn import _dispatch
from linattn import causal as causal_path

bd = pytest.importorskip("linattn_numba.cpu.bidirectional")
from linattn_numba import _machinery  # noqa: E402

#: Row-relative error of the outputs and gradients: float64 rounds the same sums in a
#: different order (a few ulp per product, sums of up to ~600 terms); float32 against a
#: float64 reference is bounded by float32 rounding of those sums.
RTOL = {"float64": 1e-12, "float32": 2e-5}

# (batch of q, batch of k and v, L_q, L_k, masked): lengths across block boundaries (256).
CASES = [
    ((2, 3), (2, 3), 37, 37, False),
    ((2, 3), (2, 3), 300, 300, True),
    ((1, 2), (1, 1), 513, 260, True),  # keys shared by heads, L_q != L_k
    ((3,), (3,), 1, 5, False),
]


def inputs(case: tuple, dtype: str, seed: int = 0) -> tuple:
    batch_q, batch_k, length, key_length, masked = case
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(*batch_q, length, 16)).astype(dtype)
    k = rng.normal(size=(*batch_k, key_length, 16)).astype(dtype)
    v = rng.normal(size=(*batch_k, key_length, 8)).astype(dtype)
    mask = None
    if masked:
        mask = rng.random((*batch_q, key_length)) < 0.7
        heads = mask.reshape(-1, key_length)  # (a view)
        heads[-1, :3] = True
        heads[0] = False  # a head whose queries see no key: zeros
    return q, k, v, mask


def row_close(actual: np.ndarray, expected: np.ndarray, rtol: float) -> None:
    assert actual.shape == expected.shape
    scale = np.max(np.abs(expected), axis=-1, keepdims=True)
    error = np.abs(actual.astype(np.float64) - expected) / np.where(scale == 0, 1, scale)
    assert float(np.max(error)) <= rtol, f"row-relative error {np.max(error):.3g} > {rtol}"


def reference(q, k, v, fm, mask) -> np.ndarray:
    """``FeatureMap.log_features`` then ``linattn.causal.bidirectional`` (float64)."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    if mask is not None:
        k, v = (np.where(mask[..., None], x, 0.0) for x in (k, v))
    lq, lk = fm.log_features(q), fm.log_features(k)
    if mask is not None:
        lk = np.where(mask[..., None], lk, -np.inf)
    va = np.concatenate([v, np.ones_like(v[..., :1])], axis=-1)
    batch = np.broadcast_shapes(lq.shape[:-2], lk.shape[:-2])
    lq = np.broadcast_to(lq, (*batch, *lq.shape[-2:]))
    lk = np.broadcast_to(lk, (*batch, *lk.shape[-2:]))
    va = np.broadcast_to(va, (*batch, *va.shape[-2:]))
    kv = np.zeros((*batch, fm.num_features, va.shape[-1]))
    mu = np.full((*batch, fm.num_features), -np.inf)
    return causal_path.normalise(np, causal_path.bidirectional(np, lq, None, lk, None, va, kv, mu))


def fused(q, k, v, fm, mask) -> tuple:
    return bd.favor_bidirectional(
        q, k, v, fm.projection, hyperbolic=fm.kind == "hyperbolic", scale=fm.scale, key_mask=mask
    )


@pytest.mark.sweep  # every case, kind and dtype; all their combinations: -m exhaustive
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("kind", ["positive", "hyperbolic"])
@pytest.mark.parametrize("case", CASES)
def test_forward_equals_array_api(case: tuple, kind: str, dtype: str) -> None:
    fm = la.FeatureMap(16, 32, kind=kind, seed=1)
    q, k, v, mask = inputs(case, dtype)
    out, kv, mu = fused(q, k, v, fm, mask)
    assert out.dtype == np.dtype(dtype)
    row_close(out, reference(q, k, v, fm, mask), RTOL[dtype])
    if mask is not None:
        np.testing.assert_array_equal(out.reshape(-1, *out.shape[-2:])[0], 0.0)  # no key seen
    assert kv.shape == (*out.shape[:-2], 32, 9) and mu.shape == (*out.shape[:-2], 32)


def test_front_door_matches_array_api() -> None:
    fm = la.FeatureMap(16, 32, seed=2)
    q, k, v, mask = inputs(CASES[1], "float64")
    expected = la.linear_attention(q, k, v, fm, key_mask=mask, backend="array_api")
    assert la.plan_attention(q, k, v, fm, key_mask=mask).executor == "fused-bidirectional"
    row_close(_dispatch.fused_bidirectional(q, k, v, fm, mask), expected, RTOL["float64"])
    row_close(la.linear_attention(q, k, v, fm, key_mask=mask), expected, RTOL["float64"])


def test_plan_decision() -> None:
    x, fm = np.zeros((2, 4, 16)), la.FeatureMap(16, 32)

    def why(feature_map, backend="auto"):  # type: ignore[no-untyped-def]
        plan = la.plan_attention(x, x, x, feature_map, backend=backend)
        return dict(plan.rejected).get("fused-bidirectional")

    assert why(fm) is None
    assert why(fm, "array_api") == "backend='array_api'"
    oprf = la.FeatureMap(16, 32, kind="oprf")  # (needs each call's statistics)
    assert "statistics" in why(oprf)
    trigonometric = la.FeatureMap(16, 32, kind="trigonometric")  # (not computed in the kernel)
    assert "features" in why(trigonometric)


def vjp_reference(q, k, v, fm, mask, g) -> tuple:
    return la.linear_attention_vjp(q, k, v, fm, g, key_mask=mask, backend="array_api")


@pytest.mark.parametrize("kind", ["positive", "hyperbolic"])
@pytest.mark.parametrize("case", CASES)
def test_backward_equals_array_api_vjp(case: tuple, kind: str) -> None:
    fm = la.FeatureMap(16, 32, kind=kind, seed=3)
    q, k, v, mask = inputs(case, "float64")
    out, kv, mu = fused(q, k, v, fm, mask)
    g = np.random.default_rng(1).normal(size=out.shape)
    options = {"hyperbolic": kind == "hyperbolic", "scale": fm.scale, "key_mask": mask}
    grads = bd.favor_bidirectional_backward(q, k, v, fm.projection, kv, mu, out, g, **options)
    for grad, x, expected in zip(
        grads, (q, k, v), vjp_reference(q, k, v, fm, mask, g), strict=True
    ):
        summed = grad.sum(
            axis=tuple(i for i, n in enumerate(x.shape[:-2]) if n == 1), keepdims=True
        )
        row_close(summed.reshape(x.shape), expected, RTOL["float64"])
    if mask is not None:  # masked keys take no part: no gradient
        np.testing.assert_array_equal(np.where(mask[..., None], 0.0, grads[1]), 0.0)


def test_backward_equals_finite_differences() -> None:
    fm = la.FeatureMap(4, 6, kind="hyperbolic", seed=4)
    rng = np.random.default_rng(5)
    q, k, v = (rng.normal(size=(2, 5, 4)) for _ in range(3))
    g = rng.normal(size=(2, 5, 4))
    options = {"hyperbolic": True, "scale": fm.scale}

    def loss(q, k, v):
        return float((g * bd.favor_bidirectional(q, k, v, fm.projection, **options)[0]).sum())

    out, kv, mu = bd.favor_bidirectional(q, k, v, fm.projection, **options)
    grads = bd.favor_bidirectional_backward(q, k, v, fm.projection, kv, mu, out, g, **options)
    eps = 1e-6
    for which, grad in enumerate(grads):
        for index in [(0, 0, 0), (1, 3, 2), (1, 4, 3)]:
            args = [q, k, v]
            plus, minus = (a.copy() for a in (args[which], args[which]))
            plus[index] += eps
            minus[index] -= eps
            slope = (loss(*args[:which], plus, *args[which + 1 :])
                     - loss(*args[:which], minus, *args[which + 1 :])) / (2 * eps)  # fmt: skip
            # central differences: error O(eps^2 f''') plus rounding O(1e-16 / eps)
            assert abs(slope - grad[index]) < 1e-8, (which, index, slope, grad[index])


def test_parallel_and_serial_twins_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    """Heads are independent: the parallel and serial variants give identical results."""
    fm = la.FeatureMap(16, 32, seed=6)
    q, k, v, mask = inputs(CASES[1], "float32")
    monkeypatch.setattr(_machinery, "SERIAL_WORK", 2**62)
    serial = fused(q, k, v, fm, mask)
    monkeypatch.setattr(_machinery, "SERIAL_WORK", 0)
    monkeypatch.setattr(_machinery, "threads", lambda: 2)
    before = bd._forward.launches["parallel"]
    parallel = fused(q, k, v, fm, mask)
    assert bd._forward.launches["parallel"] == before + 1
    for a, b in zip(serial, parallel, strict=True):
        np.testing.assert_array_equal(a, b)


def test_inputs_are_not_modified() -> None:
    fm = la.FeatureMap(16, 32, seed=7)
    q, k, v, mask = inputs(CASES[1], "float64")
    copies = [x.copy() for x in (q, k, v, mask)]
    out, kv, mu = fused(q, k, v, fm, mask)
    g = np.ones_like(out)
    options = {"hyperbolic": False, "scale": fm.scale, "key_mask": mask}
    bd.favor_bidirectional_backward(q, k, v, fm.projection, kv, mu, out, g, **options)
    for x, c in zip((q, k, v, mask), copies, strict=True):
        np.testing.assert_array_equal(x, c)


def bad_calls() -> list:
    q = np.zeros((2, 5, 4))
    w = np.zeros((3, 4))
    return (
        [
            ({"q": q.tolist()}, TypeError, "q must be a numpy.ndarray; got builtins.list"),
            ({"k": q.astype(int)}, TypeError, "k must have a floating dtype; got int64"),
            (
                {"projection": np.zeros((3, 5))},
                ValueError,
                r"projection must have shape \(rows, 4\)",
            ),
            ({"v": np.zeros((2, 6, 4))}, ValueError, r"v must have shape \(\.\.\., 5, d_v\)"),
            ({"k": np.zeros((2, 5, 3))}, ValueError, r"k must have shape \(\.\.\., 4\)"),
            ({"q": np.zeros(4)}, ValueError, r"q must have shape \(\*batch, L, d\)"),
            (
                {"key_mask": np.ones((2, 4), bool)},
                ValueError,
                r"key_mask must have shape \(\.\.\., 5\)",
            ),
            (
                {"key_mask": np.ones((2, 5))},
                TypeError,
                "key_mask must have dtype bool; got float64",
            ),
            ({"k": np.zeros((3, 5, 4)), "v": np.zeros((3, 5, 4))}, ValueError, "must broadcast"),
            ({"scale": -1.0}, ValueError, "scale must be a positive float; got -1.0"),
            ({"scale": "1"}, TypeError, "scale must be a positive float; got '1'"),
            ({"hyperbolic": 1}, TypeError, "hyperbolic must be True or False; got 1"),
        ],
        q,
        w,
    )


@pytest.mark.parametrize("index", range(12))
def test_bad_inputs_raise_before_the_kernel(index: int) -> None:
    calls, q, w = bad_calls()
    change, error, message = calls[index]
    args = {"q": q, "k": q, "v": q, "projection": w, "hyperbolic": False, "scale": 1.0,
            "key_mask": None, **change}  # fmt: skip
    with pytest.raises(error, match=message):
        bd.favor_bidirectional(**args)


def test_backward_checks_its_cotangent() -> None:
    q, w = np.zeros((2, 5, 4)), np.zeros((3, 4))
    out, kv, mu = bd.favor_bidirectional(q, q, q, w, hyperbolic=False, scale=1.0)
    with pytest.raises(ValueError, match=r"grad_output must have shape \(2, 5, 4\); got \(2, 5\)"):
        bd.favor_bidirectional_backward(
            q, q, q, w, kv, mu, out, out[..., 0], hyperbolic=False, scale=1.0
        )
    with pytest.raises(ValueError, match=r"kv must have shape \(2, 3, 5\)"):
        bd.favor_bidirectional_backward(q, q, q, w, kv[..., :4], mu, out, out, hyperbolic=False,
                                        scale=1.0)  # fmt: skip


def test_no_keys_gives_zeros() -> None:
    q, w = np.ones((1, 3, 4)), np.ones((2, 4))
    out, _, mu = bd.favor_bidirectional(q, q[:, :0], q[:, :0], w, hyperbolic=False, scale=1.0)
    np.testing.assert_array_equal(out, 0.0)
    assert np.all(mu == -np.inf)
