"""The fused causal CPU pass, checked, and its backward (``linattn_numba.cpu.fused_causal``
and ``linattn_numba.cpu.fused_causal_backward``)."""

from __future__ import annotations

import numpy as np
import pytest

import linattn as la

fc = pytest.importorskip("linattn_numba.cpu.fused_causal")
fcb = pytest.importorskip("linattn_numba.cpu.fused_causal_backward")
from linattn_numba import _machinery, cpu  # noqa: E402

#: Row-relative error of outputs and gradients against a float64 reference: float64
#: rounds the same sums in another order (a few ulp per product, sums of a few hundred
#: terms); float32 is bounded by float32 rounding of those sums.
RTOL = {"float64": 1e-12, "float32": 2e-5}

# (batch of q, batch of k and v, L, chunk, masked, state in)
CASES = [
    ((2, 3), (2, 3), 37, 8, False, False),
    ((2, 3), (2, 1), 300, 64, True, True),  # keys shared by heads, across feature blocks
    ((1, 2), (1, 2), 130, 7, True, True),  # odd chunk
    ((3,), (3,), 1, 64, False, True),  # one token
    ((2,), (2,), 20, 100, True, False),  # chunk longer than the sequence
]


def inputs(case: tuple, dtype: str, m: int = 32, seed: int = 0) -> tuple:
    batch_q, batch_k, length, chunk, masked, with_state = case
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(*batch_q, length, 16)).astype(dtype)
    k = rng.normal(size=(*batch_k, length, 16)).astype(dtype)
    v = rng.normal(size=(*batch_k, length, 8)).astype(dtype)
    batch = np.broadcast_shapes(batch_q, batch_k)
    mask = None
    if masked:
        mask = rng.random((*batch, length)) < 0.7
        mask.reshape(-1, length)[0, : min(3, length)] = False  # a fully masked start
    if with_state:
        mu = rng.normal(size=(*batch, m)).astype(dtype)
        mu[..., 0] = -np.inf  # a feature that has seen no key yet
        kv = (np.abs(rng.normal(size=(*batch, m, 9))) * np.isfinite(mu)[..., None]).astype(dtype)
    else:
        kv, mu = np.zeros((*batch, m, 9), dtype), np.full((*batch, m), -np.inf, dtype)
    return q, k, v, mask, kv, mu, chunk


def row_close(actual: np.ndarray, expected: np.ndarray, rtol: float) -> None:
    assert actual.shape == expected.shape
    scale = np.max(np.abs(expected), axis=-1, keepdims=True)
    error = np.abs(actual.astype(np.float64) - expected) / np.where(scale == 0, 1, scale)
    assert float(np.max(error)) <= rtol, f"row-relative error {np.max(error):.3g} > {rtol}"


def head_close(actual: np.ndarray, expected: np.ndarray, rtol: float) -> None:
    """``|a - e| <= rtol * max |e|`` over each head (the last two axes): for gradients,
    whose rows can vanish by cancellation (a query that sees one key has ``dq = 0``)."""
    assert actual.shape == expected.shape
    scale = np.max(np.abs(expected), axis=(-2, -1), keepdims=True)
    error = np.abs(actual.astype(np.float64) - expected) / np.where(scale == 0, 1, scale)
    assert float(np.max(error)) <= rtol, f"head-relative error {np.max(error):.3g} > {rtol}"


def options(fm: la.FeatureMap, mask: np.ndarray | None, chunk: int) -> dict:
    return {"hyperbolic": fm.kind == "hyperbolic", "scale": fm.scale, "key_mask": mask,
            "chunk_size": chunk}  # fmt: skip


def unfused(q, k, v, fm, mask, kv, mu, chunk, g, g_lse, g_kv) -> tuple:
    """The reference: float64 log-features, the unfused kernels, the map's feature VJP."""
    q, k, v, kv, mu = (x.astype(np.float64) for x in (q, k, v, kv, mu))
    if mask is not None:
        k, v = (np.where(mask[..., None], x, 0.0) for x in (k, v))
    batch = kv.shape[:-2]
    lq, lk = (np.broadcast_to(fm.log_features(x), (*batch, x.shape[-2], 32)) for x in (q, k))
    if mask is not None:
        lk = np.where(mask[..., None], lk, -np.inf)
    v = np.broadcast_to(v, (*batch, *v.shape[-2:]))
    va = np.concatenate([v, np.ones_like(v[..., :1])], axis=-1)
    rows, kv_out, mu_out, log_scale = cpu.numpy_forward(
        lq, lk, va, kv, mu, chunk, return_log_scale=True
    )
    den = rows[..., -1:]
    safe = np.where(den == 0, 1.0, den)
    out = np.where(den == 0, 0.0, rows[..., :-1] / safe)
    with np.errstate(divide="ignore"):  # -inf where a row sees no key
        lse = np.log(rows[..., -1]) + log_scale
    d_rows = np.concatenate([g / safe, (g_lse[..., None] - (g * out).sum(-1, keepdims=True))
                             / safe], axis=-1) * (den != 0)  # fmt: skip
    d_lq, d_lk, d_va, d_kv = cpu.numpy_backward(lq, lk, va, kv, mu, chunk, d_rows, g_kv)
    dq = fm.log_features_vjp(np.broadcast_to(q, (*lq.shape[:-1], 16)), d_lq)
    dk = fm.log_features_vjp(np.broadcast_to(k, (*lk.shape[:-1], 16)), d_lk)
    if mask is not None:
        dk = np.where(mask[..., None], dk, 0.0)
    return (out, kv_out, mu_out, lse), (dq, dk, d_va[..., :-1], d_kv)


@pytest.mark.sweep  # every case, kind and dtype; all their combinations: -m exhaustive
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("kind", ["positive", "hyperbolic"])
@pytest.mark.parametrize("case", CASES)
def test_forward_and_backward_equal_unfused_kernels(case: tuple, kind: str, dtype: str) -> None:
    fm = la.FeatureMap(16, 32, kind=kind, seed=1)
    q, k, v, mask, kv, mu, chunk = inputs(case, dtype)
    rng = np.random.default_rng(1)
    batch = kv.shape[:-2]
    g, g_lse = rng.normal(size=(*batch, q.shape[-2], 8)), rng.normal(size=(*batch, q.shape[-2]))
    g_kv = rng.normal(size=kv.shape)
    expected, expected_grads = unfused(q, k, v, fm, mask, kv, mu, chunk, g, g_lse, g_kv)
    results = fc.forward(q, k, v, fm.projection, kv, mu, **options(fm, mask, chunk))
    favor = cpu.favor_causal(q, k, v, fm.projection, kv=kv, log_shift=mu,
                             return_log_normaliser=True, **options(fm, mask, chunk))  # fmt: skip
    for a, b in zip(results, favor, strict=True):
        assert a.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(a, b)  # the same kernel as favor_causal
    row_close(results[0], expected[0], RTOL[dtype])
    row_close(results[1], expected[1], RTOL[dtype])
    np.testing.assert_allclose(results[3], expected[3], rtol=RTOL[dtype], atol=RTOL[dtype])
    cast = (g.astype(dtype), g_lse.astype(dtype), g_kv.astype(dtype))
    grads = fcb.backward(q, k, v, fm.projection, kv, mu, results[0], cast[0],
                        grad_log_normaliser=cast[1], grad_kv=cast[2],
                        **options(fm, mask, chunk))  # fmt: skip
    for grad, e in zip(grads, expected_grads, strict=True):
        assert grad.dtype == np.dtype(dtype) and grad.shape == e.shape
        head_close(grad, e, RTOL[dtype])
    if mask is not None:  # masked keys take no part: no gradient
        np.testing.assert_array_equal(np.where(mask[..., None], 0.0, grads[1]), 0.0)
        np.testing.assert_array_equal(np.where(mask[..., None], 0.0, grads[2]), 0.0)


@pytest.mark.parametrize("kind", ["positive", "hyperbolic"])
def test_backward_equals_array_api_vjp(kind: str) -> None:
    fm = la.FeatureMap(16, 32, kind=kind, seed=2)
    q, k, v, mask, kv, mu, chunk = inputs(CASES[1], "float64", seed=3)
    kv, mu = np.zeros_like(kv), np.full_like(mu, -np.inf)
    out, *_ = fc.forward(q, k, v, fm.projection, kv, mu, **options(fm, mask, chunk))
    g = np.random.default_rng(2).normal(size=out.shape)
    grads = fcb.backward(q, k, v, fm.projection, kv, mu, out, g, **options(fm, mask, chunk))
    expected = la.linear_attention_vjp(q, k, v, fm, g, causal=True, key_mask=mask,
                                       chunk_size=chunk, backend="array_api")  # fmt: skip
    row_close(out, la.linear_attention(q, k, v, fm, causal=True, key_mask=mask,
                                       backend="array_api"), RTOL["float64"])  # fmt: skip
    for grad, x, e in zip(grads[:3], (q, k, v), expected, strict=True):
        summed = grad.sum(axis=tuple(i for i, n in enumerate(x.shape[:-2]) if n == 1),
                          keepdims=True)  # fmt: skip
        head_close(summed.reshape(x.shape), e, RTOL["float64"])


def test_backward_equals_finite_differences() -> None:
    fm = la.FeatureMap(4, 6, kind="hyperbolic", seed=4)
    rng = np.random.default_rng(5)
    q, k, v = (rng.normal(size=(2, 7, 4)) for _ in range(3))
    mu = rng.normal(size=(2, 6)) + 3  # above every key's log-feature: no key moves it
    kv = np.abs(rng.normal(size=(2, 6, 5)))
    g, g_lse, g_kv = rng.normal(size=(2, 7, 4)), rng.normal(size=(2, 7)), rng.normal(size=kv.shape)
    opts = {"hyperbolic": True, "scale": fm.scale, "chunk_size": 3}

    def loss(q: np.ndarray, k: np.ndarray, v: np.ndarray, kv: np.ndarray) -> float:
        out, kv_out, shift, lse = fc.forward(q, k, v, fm.projection, kv, mu, **opts)
        # kv_out is taken at the output's shift, held constant by the backward: no key
        # may move it (none holds a feature's maximum here)
        np.testing.assert_array_equal(shift, mu_out)
        return float((g * out).sum() + (g_lse * lse).sum() + (g_kv * kv_out).sum())

    out, _, mu_out, _ = fc.forward(q, k, v, fm.projection, kv, mu, **opts)
    grads = fcb.backward(q, k, v, fm.projection, kv, mu, out, g, grad_log_normaliser=g_lse,
                        grad_kv=g_kv, **opts)  # fmt: skip
    eps = 1e-6
    for which, grad in enumerate(grads):
        for index in [(0, 0, 0), (1, 3, 2), (1, 4, 3), (0, 5, 1)]:
            args = [q, k, v, kv]
            plus, minus = (args[which].copy() for _ in range(2))
            plus[index] += eps
            minus[index] -= eps
            args[which] = plus
            up = loss(*args)
            args[which] = minus
            slope = (up - loss(*args)) / (2 * eps)
            # central differences: error O(eps^2 f''') plus rounding O(1e-16 / eps);
            # the final shift mu_out holds still (no key perturbed here raises a maximum)
            assert abs(slope - grad[index]) < 1e-7, (which, index, slope, grad[index])


def test_parallel_and_serial_twins_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    """Heads are independent: the parallel and serial variants give identical results."""
    fm = la.FeatureMap(16, 32, seed=6)
    q, k, v, mask, kv, mu, chunk = inputs(CASES[1], "float32")
    g = np.random.default_rng(7).normal(size=(2, 3, 300, 8)).astype(np.float32)

    def run() -> tuple:
        out, *state = fc.forward(q, k, v, fm.projection, kv, mu, **options(fm, mask, chunk))
        grads = fcb.backward(q, k, v, fm.projection, kv, mu, out, g, **options(fm, mask, chunk))
        return (out, *state, *grads)

    monkeypatch.setattr(_machinery, "SERIAL_WORK", 2**62)
    serial = run()
    monkeypatch.setattr(_machinery, "SERIAL_WORK", 0)
    monkeypatch.setattr(_machinery, "threads", lambda: 2)
    before = fcb._backward.launches["parallel"]
    parallel = run()
    assert fcb._backward.launches["parallel"] == before + 1
    for a, b in zip(serial, parallel, strict=True):
        np.testing.assert_array_equal(a, b)


def test_chunk_size_changes_rounding_only() -> None:
    fm = la.FeatureMap(16, 32, seed=8)
    q, k, v, mask, kv, mu, _ = inputs(CASES[1], "float64")
    g = np.random.default_rng(9).normal(size=(2, 3, 300, 8))
    results = []
    for chunk in (1, 5, 64, 300):
        out, *_ = fc.forward(q, k, v, fm.projection, kv, mu, **options(fm, mask, chunk))
        grads = fcb.backward(q, k, v, fm.projection, kv, mu, out, g, **options(fm, mask, chunk))
        results.append((out, *grads))
    for other in results[1:]:
        for a, b in zip(other, results[0], strict=True):
            head_close(a, b, RTOL["float64"])


def test_checkpointed_backward_equals_stored_states(monkeypatch: pytest.MonkeyPatch) -> None:
    fm = la.FeatureMap(16, 32, seed=10)
    q, k, v, mask, kv, mu, _ = inputs(CASES[2], "float64")
    g = np.random.default_rng(11).normal(size=(1, 2, 130, 8))
    args = (q, k, v, fm.projection, kv, mu)
    out, *_ = fc.forward(*args, **options(fm, mask, 7))
    stored = fcb.backward(*args, out, g, **options(fm, mask, 7))
    monkeypatch.setattr(fcb, "STORE_BYTES", 0)  # sqrt(N) checkpoints, segments recomputed
    for a, b in zip(fcb.backward(*args, out, g, **options(fm, mask, 7)), stored, strict=True):
        np.testing.assert_array_equal(a, b)


def test_inputs_are_not_modified() -> None:
    fm = la.FeatureMap(16, 32, seed=12)
    q, k, v, mask, kv, mu, chunk = inputs(CASES[1], "float64")
    copies = [x.copy() for x in (q, k, v, mask, kv, mu)]
    out, *_ = fc.forward(q, k, v, fm.projection, kv, mu, **options(fm, mask, chunk))
    g = np.ones_like(out)
    fcb.backward(q, k, v, fm.projection, kv, mu, out, g, grad_log_normaliser=g[..., 0],
                grad_kv=np.ones_like(kv), **options(fm, mask, chunk))  # fmt: skip
    for x, c in zip((q, k, v, mask, kv, mu), copies, strict=True):
        np.testing.assert_array_equal(x, c)


def test_no_tokens_pass_the_state_through() -> None:
    q, w = np.zeros((2, 0, 4)), np.ones((3, 4))
    kv, mu = np.ones((2, 3, 5)), np.zeros((2, 3))
    out, kv_out, _, lse = fc.forward(q, q, q, w, kv, mu, hyperbolic=False, scale=1.0)
    assert out.shape == (2, 0, 4) and lse.shape == (2, 0)
    np.testing.assert_array_equal(kv_out, kv)
    grads = fcb.backward(q, q, q, w, kv, mu, out, out, hyperbolic=False, scale=1.0, grad_kv=kv)
    np.testing.assert_array_equal(grads[3], kv)


def bad_calls() -> list:
    return [
        ({"q": [[0.0]]}, TypeError, "q must be a numpy.ndarray; got builtins.list"),
        ({"k": np.zeros((2, 5, 4), int)}, TypeError, "k must have a floating dtype; got int64"),
        ({"k": np.zeros((2, 6, 4)), "v": np.zeros((2, 6, 4))}, ValueError,
         r"k must have shape \(\.\.\., 5, d\) like q"),
        ({"projection": np.zeros((3, 5))}, ValueError, r"projection must have shape \(rows, 4\)"),
        ({"key_mask": np.ones((2, 5))}, TypeError, "key_mask must have dtype bool"),
        ({"kv": np.zeros((2, 3, 4))}, ValueError, r"kv must have shape \(\*batch, 3, 5\)"),
        ({"kv": np.zeros((4, 3, 5))}, ValueError, r"broadcast to \(2,\); got \(4, 3, 5\)"),
        ({"log_shift": np.zeros((2, 4))}, ValueError, r"log_shift must have shape \(\*batch, 3\)"),
        ({"log_shift": np.zeros((2, 3), int)}, TypeError, "log_shift must have a floating dtype"),
        ({"kv": np.zeros((2, 3, 5)).tolist()}, TypeError, "kv must be a numpy.ndarray"),
        ({"chunk_size": 0}, ValueError, "chunk_size must be a positive integer; got 0"),
        ({"chunk_size": 2.0}, TypeError, "chunk_size must be a positive integer; got 2.0"),
        ({"scale": 0.0}, ValueError, "scale must be a positive float; got 0.0"),
        ({"hyperbolic": "no"}, TypeError, "hyperbolic must be True or False"),
    ]  # fmt: skip


@pytest.mark.parametrize("index", range(len(bad_calls())))
def test_bad_inputs_raise_before_the_kernel(index: int) -> None:
    change, error, message = bad_calls()[index]
    q = np.zeros((2, 5, 4))
    state = {"kv": np.zeros((2, 3, 5)), "log_shift": np.zeros((2, 3))}
    args = {"q": q, "k": q, "v": q, "projection": np.zeros((3, 4)), **state, "hyperbolic": False,
            "scale": 1.0, **change}  # fmt: skip
    with pytest.raises(error, match=message):
        fc.forward(**args)
    good = {"outputs": np.zeros((2, 5, 4)), "grad_output": np.zeros((2, 5, 4))}
    with pytest.raises(error, match=message):
        fcb.backward(**args, **good)


def test_backward_checks_its_cotangents() -> None:
    q, w = np.zeros((2, 5, 4)), np.zeros((3, 4))
    state = np.zeros((2, 3, 5)), np.full((2, 3), -np.inf)
    opts = {"hyperbolic": False, "scale": 1.0}
    out, *_ = fc.forward(q, q, q, w, *state, **opts)
    for name, bad, message in [
        ("grad_output", out[..., 0], r"grad_output must have shape \(2, 5, 4\); got \(2, 5\)"),
        ("grad_log_normaliser", out, r"grad_log_normaliser must have shape \(2, 5\)"),
        ("grad_kv", state[0][..., :4], r"grad_kv must have shape \(2, 3, 5\)"),
        ("outputs", out.tolist(), "outputs must be a numpy.ndarray"),
    ]:
        given = {"outputs": out, "grad_output": out, name: bad}
        with pytest.raises((TypeError, ValueError), match=message):
            fcb.backward(q, q, q, w, *state, **given, **opts)


def test_default_chunk_is_the_cpu_forward_chunk() -> None:
    """``chunk_size=None`` runs the Numba CPU forward passes at their own chunk (bit for
    bit the explicit call), the portable path and the VJP at 64; other chunks round
    differently, so a default that did not reach the kernel would show."""
    from linattn import _dispatch
    from linattn.vjp import linear_attention_vjp

    rng = np.random.default_rng(12)
    q, k, v = (rng.normal(size=(2, 3, 200, 16)).astype(np.float32) for _ in range(3))
    fm = la.FeatureMap(16, 64, seed=12)
    own = _dispatch.CPU_FORWARD_CHUNK_SIZE
    assert own != _dispatch.DEFAULT_CHUNK_SIZE
    cases = [
        ({"causal": True}, own),
        ({"causal": True, "window": 24, "sink_keys": 2}, own),  # the causal hybrid kernel
        ({"causal": True, "backend": "array_api"}, _dispatch.DEFAULT_CHUNK_SIZE),
    ]
    for options, chunk in cases:
        default = la.linear_attention(q, k, v, fm, **options)
        np.testing.assert_array_equal(
            default, la.linear_attention(q, k, v, fm, **options, chunk_size=chunk)
        )
        other = la.linear_attention(q, k, v, fm, **options, chunk_size=96 - chunk)
        assert not np.array_equal(default, other), options
        np.testing.assert_allclose(default, other, rtol=1e-4, atol=1e-5)
    g = rng.normal(size=q.shape).astype(np.float32)
    for a, b in zip(
        linear_attention_vjp(q, k, v, fm, g, causal=True),
        linear_attention_vjp(q, k, v, fm, g, causal=True, chunk_size=_dispatch.DEFAULT_CHUNK_SIZE),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)


def test_chunk_size_for_names_the_argument() -> None:
    from linattn import _dispatch

    plan = _dispatch.causal_plan(np.zeros((2, 8)), la.FeatureMap(8, 16))
    assert plan.path == "numba-cpu"
    assert _dispatch.chunk_size_for(plan, None) == _dispatch.CPU_FORWARD_CHUNK_SIZE
    assert _dispatch.chunk_size_for(plan, np.int64(16)) == 16
    for bad, error in ((0, ValueError), (2.0, TypeError), (True, TypeError)):
        with pytest.raises(error, match="chunk_size must be a positive integer or None; got"):
            _dispatch.chunk_size_for(plan, bad)
