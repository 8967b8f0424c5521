"""The Numba CPU kernels against the array-API path: forward, backward, causality, pieces.

Tolerances: the contract asks for 1e-10 (float64) and 1e-5 (float32) relative.
Outputs are sums of positive weights times values, so single entries can cancel;
"relative" is taken per output row, against the row's largest entry (the
denominator column bounds every term of the row).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

pytest.importorskip("numba")

import linattn as la
from linattn import _dispatch
from linattn import causal as causal_path
from linattn._adjoints import normalise_vjp
from linattn_numba import cpu, libraries

RTOL = {"float64": 1e-10, "float32": 1e-5}

#: (batch, length, features, value width d_v + 1, chunk, masked keys, initial state)
CASES = [
    ((2,), 1, 3, 3, 4, False, False),  # one token
    ((3,), 37, 5, 5, 8, True, False),  # length not a multiple of the chunk
    ((2, 2), 64, 16, 8, 64, False, True),  # exactly one chunk, state in
    ((1,), 130, 8, 4, 7, True, True),  # d_v != m, odd chunk, masks and state
    ((2,), 20, 6, 2, 100, True, True),  # chunk longer than the sequence
    ((), 33, 4, 3, 1, False, True),  # no batch dimension, chunk of one
]


def row_close(actual: np.ndarray, expected: np.ndarray, rtol: float) -> None:
    """``|a - e| <= rtol * max |e|`` over each last-axis row."""
    assert actual.shape == expected.shape
    assert actual.dtype == expected.dtype
    scale = np.max(np.abs(expected), axis=-1, keepdims=True)
    error = np.abs(actual.astype(np.float64) - expected) / np.where(scale == 0, 1, scale)
    assert float(np.max(error)) <= rtol, f"row-relative error {np.max(error):.3g} > {rtol}"


def make_inputs(
    seed: int,
    batch: tuple[int, ...],
    length: int,
    m: int,
    width: int,
    masked: bool,
    state: bool,
    dtype: str,
) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    lq = rng.normal(size=(*batch, length, m)) - 2
    lk = 2 * rng.normal(size=(*batch, length, m)) - 2
    if masked:
        lk[..., rng.random(length) < 0.3, :] = -np.inf
        lk[..., : min(3, length), :] = -np.inf  # a fully masked start
    va = np.concatenate(
        [rng.normal(size=(*batch, length, width - 1)), np.ones((*batch, length, 1))], axis=-1
    )
    if state:
        mu = rng.normal(size=(*batch, m))
        mu[..., 0] = -np.inf  # a feature that has seen no key yet
        kv = np.abs(rng.normal(size=(*batch, m, width))) * np.isfinite(mu)[..., None]
    else:
        kv = np.zeros((*batch, m, width))
        mu = np.full((*batch, m), -np.inf)
    return tuple(x.astype(dtype) for x in (lq, lk, va, kv, mu))


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("case", CASES)
def test_forward_equals_array_api(case: tuple, dtype: str) -> None:
    batch, length, m, width, chunk, masked, state = case
    lq, lk, va, kv, mu = make_inputs(0, batch, length, m, width, masked, state, dtype)
    kv_before = kv.copy()
    out, kv_out, mu_out = libraries.cpu_causal_kernel("numpy")(lq, lk, va, kv, mu, chunk)
    ref_out, ref_kv, ref_mu = causal_path.causal(np, lq, None, lk, None, va, kv, mu, chunk)
    # Unnormalised outputs carry each row's stabiliser, which depends on how the tokens
    # are grouped (the array-API pass uses blocks of at least d_v + 1 tokens): compare
    # what the stabiliser cancels from.
    row_close(causal_path.normalise(np, out), causal_path.normalise(np, ref_out), RTOL[dtype])
    assert out.shape == ref_out.shape
    row_close(kv_out, ref_kv, RTOL[dtype])
    np.testing.assert_array_equal(mu_out, ref_mu)
    np.testing.assert_array_equal(kv, kv_before)  # the state passed in is not modified


def _reference_gradients(
    inputs: tuple[np.ndarray, ...], chunk: int, g: np.ndarray, h: np.ndarray
) -> tuple[np.ndarray, ...]:
    """torch autograd (float64) of a shift-invariant loss through the array-API path."""
    torch = pytest.importorskip("torch")
    import array_api_compat.torch as xp

    tensors = [
        torch.tensor(x, dtype=torch.float64, requires_grad=i < 4) for i, x in enumerate(inputs)
    ]
    out, kv, mu = causal_path.causal(xp, tensors[0], None, tensors[1], None, *tensors[2:], chunk)
    safe_mu = torch.where(torch.isfinite(mu), mu, 0.0)
    loss = (torch.tensor(g) * causal_path.normalise(xp, out)).sum() + (
        torch.tensor(h) * torch.exp(safe_mu)[..., None] * kv
    ).sum()
    return tuple(t.numpy() for t in torch.autograd.grad(loss, tensors[:4]))


def _kernel_cotangents(
    inputs: tuple[np.ndarray, ...], chunk: int, g: np.ndarray, h: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    out, _, mu = cpu.numpy_forward(*inputs, chunk)
    d_out = normalise_vjp(np, out, g.astype(out.dtype))
    d_kv = h * np.exp(np.where(np.isfinite(mu), mu, 0))[..., None]
    return d_out.astype(out.dtype), d_kv.astype(out.dtype)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("case", CASES)
def test_backward_equals_array_api_autograd(case: tuple, dtype: str) -> None:
    batch, length, m, width, chunk, masked, state = case
    inputs = make_inputs(1, batch, length, m, width, masked, state, dtype)
    rng = np.random.default_rng(2)
    g = rng.normal(size=(*batch, length, width - 1))
    h = rng.normal(size=(*batch, m, width))
    expected = _reference_gradients(tuple(x.astype("float64") for x in inputs), chunk, g, h)
    d_out, d_kv = _kernel_cotangents(inputs, chunk, g, h)
    got = cpu.numpy_backward(*inputs, chunk, d_out, d_kv)
    for name, actual, ref in zip(("lq", "lk", "va", "kv"), got, expected, strict=True):
        assert actual.dtype == np.dtype(dtype), name
        # Cancelling sums again: compare against the largest entry, and against the
        # cotangent's size where the exact gradient is 0 (one token: o = v whatever q).
        scale = max(float(np.max(np.abs(ref))), float(np.max(np.abs(g))))
        err = float(np.max(np.abs(actual - ref))) / scale
        assert err < RTOL[dtype], (name, err)
        assert np.all(actual[np.isneginf(inputs[1])] == 0) if name == "lk" else True


def test_gradcheck_through_torch_kernel() -> None:
    torch = pytest.importorskip("torch")
    kernel = libraries.cpu_causal_kernel("torch")
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    lq, lk = rand(2, 11, 4).requires_grad_(), rand(2, 11, 4).requires_grad_()
    va = torch.cat([rand(2, 11, 3), torch.ones(2, 11, 1, dtype=torch.float64)], -1)
    va.requires_grad_()
    kv = rand(2, 4, 4).abs().requires_grad_()
    mu = rand(2, 4)

    def f(lq: torch.Tensor, lk: torch.Tensor, va: torch.Tensor, kv: torch.Tensor) -> tuple:
        out, kv_out, mu_out = kernel(lq, lk, va, kv, mu, 4)
        assert not mu_out.requires_grad
        return out[..., :-1] / out[..., -1:], kv_out * torch.exp(mu_out)[..., None]

    assert torch.autograd.gradcheck(f, (lq, lk, va, kv))


@pytest.mark.parametrize("kind", ["positive", "hyperbolic", "elu"])
def test_linear_attention_gradients_kernel_vs_array_api(kind: str) -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    q, k = (torch.tensor(0.5 * rng.normal(size=(2, 3, 50, 8))) for _ in range(2))
    v = torch.tensor(rng.normal(size=(1, 3, 50, 6)))
    mask = torch.tensor(rng.random((2, 1, 50)) > 0.2)
    g = torch.tensor(rng.normal(size=(2, 3, 50, 6)))
    fm = la.FeatureMap(8, 8 if kind == "elu" else 32, kind=kind, seed=1)
    grads = []
    for backend in ("numba", "array_api"):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = la.linear_attention(
            *leaves, fm, causal=True, key_mask=mask, chunk_size=16, backend=backend
        )
        grads.append(torch.autograd.grad((out * g).sum(), leaves))
    for a, b in zip(*grads, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    ("first", "then"), [("array_api", "numba"), ("numba", "array_api"), ("numba", "numba")]
)
def test_gradients_through_a_state_passed_between_backends(first: str, then: str) -> None:
    """A state from either backend continues on the other with exact gradients: the
    kernel passes the gradient of ``S exp(mu)`` on to the incoming ``mu`` (which the
    array-API path computes with gradients)."""
    torch = pytest.importorskip("torch")
    fm = la.FeatureMap(4, 8, seed=0)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(7, 4, generator=gen, dtype=torch.float64) for _ in range(3))

    def loss(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        head, state = la.linear_attention(
            q[:3], k[:3], v[:3], fm, causal=True, return_state=True, backend=first
        )
        tail = la.linear_attention(q[3:], k[3:], v[3:], fm, causal=True, state=state, backend=then)
        return head.sum() + (tail**2).sum()

    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    assert torch.autograd.gradcheck(loss, leaves)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("position", [5, 16, 30])
def test_causality_bit_exact(dtype: str, position: int) -> None:
    lq, lk, va, kv, mu = make_inputs(4, (2,), 40, 8, 4, False, True, dtype)
    out, _, _ = cpu.numpy_forward(lq, lk, va, kv, mu, 16)
    lk2, va2 = lk.copy(), va.copy()
    lk2[:, position:] += 50  # future keys far above every earlier stabiliser
    va2[:, position:, :-1] = 1e6
    out2, _, _ = cpu.numpy_forward(lq, lk2, va2, kv, mu, 16)
    np.testing.assert_array_equal(out2[:, :position], out[:, :position])
    assert not np.array_equal(out2[:, position:], out[:, position:])


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_whole_equals_pieces_equals_tokens(dtype: str) -> None:
    lq, lk, va, kv, mu = make_inputs(5, (3,), 45, 8, 4, True, True, dtype)
    whole, kv_whole, mu_whole = cpu.numpy_forward(lq, lk, va, kv, mu, 8)
    for cuts in ([0, 13, 14, 40, 45], list(range(46))):
        state = (kv, mu)
        pieces = []
        for a, b in itertools.pairwise(cuts):
            out, *state = cpu.numpy_forward(lq[:, a:b], lk[:, a:b], va[:, a:b], *state, 8)
            pieces.append(out)
        # Unnormalised rows carry chunk-dependent shifts; the attention output does not.
        row_close(
            causal_path.normalise(np, np.concatenate(pieces, axis=1)),
            causal_path.normalise(np, whole),
            RTOL[dtype],
        )
        row_close(state[0], kv_whole, RTOL[dtype])
        np.testing.assert_array_equal(state[1], mu_whole)


def test_linear_attention_state_pieces_with_kernel() -> None:
    rng = np.random.default_rng(6)
    q, k, v = (rng.normal(size=(2, 30, 8)) for _ in range(3))
    fm = la.FeatureMap(8, 16, seed=0)
    whole = la.linear_attention(q, k, v, fm, causal=True, backend="numba")
    ref = la.linear_attention(q, k, v, fm, causal=True, backend="array_api")
    np.testing.assert_allclose(whole, ref, rtol=1e-10, atol=1e-12)
    state, outs = None, []
    for t in range(30):
        sl = slice(t, t + 1)
        out, state = la.linear_attention(
            q[:, sl],
            k[:, sl],
            v[:, sl],
            fm,
            causal=True,
            state=state,
            return_state=True,
            backend="numba",
        )
        outs.append(out)
    np.testing.assert_allclose(np.concatenate(outs, axis=1), whole, rtol=1e-10, atol=1e-12)


def test_broadcast_and_strided_inputs() -> None:
    lq, lk, va, kv, mu = make_inputs(7, (2, 3), 25, 6, 4, True, True, "float64")
    shared_va = np.broadcast_to(va[:1, :1], va.shape)  # zero strides
    strided_lq = np.asfortranarray(lq)
    out, kv_out, _ = cpu.numpy_forward(strided_lq, lk, shared_va, kv, mu, 8)
    ref, ref_kv, _ = cpu.numpy_forward(lq.copy(), lk, np.ascontiguousarray(shared_va), kv, mu, 8)
    np.testing.assert_array_equal(out, ref)
    np.testing.assert_array_equal(kv_out, ref_kv)


def test_torch_without_grad_goes_straight_through() -> None:
    torch = pytest.importorskip("torch")
    inputs = make_inputs(8, (2,), 20, 4, 3, False, True, "float32")
    out, kv, mu = libraries.cpu_causal_kernel("torch")(*(torch.from_numpy(x) for x in inputs), 8)
    ref = cpu.numpy_forward(*inputs, 8)
    for a, b in zip((out, kv, mu), ref, strict=True):
        assert isinstance(a, torch.Tensor) and a.dtype == torch.float32
        np.testing.assert_array_equal(a.numpy(), b)


def test_dispatch_uses_kernel_for_numpy_and_torch() -> None:
    assert cpu.status() == "available"
    assert _dispatch.kernel_status()["numba-cpu"].startswith("available; ")
    assert _dispatch.kernel_for(np.zeros(1))[0] is cpu.numpy_forward
    torch = pytest.importorskip("torch")
    assert _dispatch.kernel_for(torch.zeros(1))[0] is not None


def test_backend_numba_on_unsupported_arrays_raises() -> None:
    xps = pytest.importorskip("array_api_strict")
    x = xps.asarray(np.ones((4, 8)))
    fm = la.FeatureMap(8, 8, seed=0)
    with pytest.raises(ValueError, match="backend='numba' cannot serve these arrays"):
        la.linear_attention(x, x, x, fm, causal=True, backend="numba")
    trig = la.FeatureMap(8, 8, kind="trigonometric", seed=0)
    with pytest.raises(ValueError, match="positive features only"):
        la.linear_attention(
            np.ones((4, 8)), np.ones((4, 8)), np.ones((4, 8)), trig, causal=True, backend="numba"
        )


def _good() -> list[np.ndarray]:
    return list(make_inputs(9, (2,), 6, 3, 3, False, False, "float64"))


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (lambda a: a.__setitem__(1, a[1].astype("float32")), TypeError, "log_phi_k must have"),
        (lambda a: a.__setitem__(0, a[0].astype("int64")), TypeError, "log_phi_q must have"),
        (lambda a: a.__setitem__(2, a[2][:, :5]), ValueError, "values_aug must have shape"),
        (lambda a: a.__setitem__(3, a[3][:, :2]), ValueError, "kv must have shape"),
        (lambda a: a.__setitem__(4, a[4][None]), ValueError, "log_shift must have shape"),
        (lambda a: a.__setitem__(2, a[2].tolist()), TypeError, "values_aug must be a numpy"),
        (lambda a: a.__setitem__(0, a[0][..., :0]), ValueError, "m >= 1"),
    ],
)
def test_bad_inputs_raise_before_the_kernel(change: object, error: type, match: str) -> None:
    arrays = _good()
    change(arrays)  # type: ignore[operator]
    with pytest.raises(error, match=match):
        cpu.numpy_forward(*arrays, 4)


@pytest.mark.parametrize(
    ("chunk", "error"), [(0, ValueError), (-1, ValueError), (2.0, TypeError), (True, TypeError)]
)
def test_bad_chunk_size(chunk: object, error: type) -> None:
    with pytest.raises(error, match="chunk_size must be a positive integer"):
        cpu.numpy_forward(*_good(), chunk)


def test_no_tokens_pass_the_state_through() -> None:
    """``L = 0`` is a valid call (as on the CUDA target): empty outputs, the state as given.

    (A state that holds keys: the rows of an empty one hold nothing, and get no gradient.)
    """
    inputs = make_inputs(9, (2,), 6, 3, 3, False, True, "float64")
    lq, lk, va, kv, mu = (x[:, :0] if x.ndim == 3 and x.shape[1] == 6 else x for x in inputs)
    out, kv_out, mu_out = cpu.numpy_forward(lq, lk, va, kv, mu, 4)
    assert out.shape == (2, 0, 3)
    np.testing.assert_array_equal(kv_out, kv)
    np.testing.assert_array_equal(mu_out, mu)
    d_kv = np.ones_like(kv)
    grads = cpu.numpy_backward(lq, lk, va, kv, mu, 4, np.zeros((2, 0, 3)), d_kv)
    assert [g.shape for g in grads] == [(2, 0, 3)] * 3 + [kv.shape]
    holds_keys = np.isfinite(mu)[..., None]
    assert holds_keys.any() and not holds_keys.all()
    np.testing.assert_array_equal(grads[3], np.where(holds_keys, d_kv, 0.0))


def test_bad_backward_inputs() -> None:
    arrays = _good()
    d_out = np.zeros((2, 6, 4))
    with pytest.raises(ValueError, match="d_outputs_aug must have shape"):
        cpu.numpy_backward(*arrays, 4, d_out, np.zeros((2, 3, 3)))
    pytest.importorskip("torch")
    with pytest.raises(TypeError, match="torch CPU tensor"):
        libraries.cpu_causal_kernel("torch")(*arrays, 4)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_fast_exp(dtype: str) -> None:
    numba = pytest.importorskip("numba")

    @numba.njit
    def apply(x: np.ndarray, out: np.ndarray) -> None:
        for i in range(x.size):
            out[i] = cpu.fast_exp(x[i])

    info = np.finfo(dtype)
    x = np.linspace(math.log(info.tiny) - 5, math.log(info.max) + 1, 200_001).astype(dtype)
    x = np.concatenate([x, np.array([-np.inf, np.inf, np.nan, 0.0], dtype)])
    out = np.empty_like(x)
    apply(x, out)
    with np.errstate(over="ignore"):
        ref = np.exp(x.astype(np.longdouble))
    normal = (ref > info.tiny) & (ref < info.max)
    ulps = np.abs(out[normal] - ref[normal]) / (ref[normal] * info.eps)
    assert float(ulps.max()) < 2
    assert np.all(np.isinf(out[np.isinf(ref) & (ref > 0)]))
    tiny = ref <= info.tiny  # subnormal results: two roundings, within 2 units of 2**-1074
    assert np.all(np.abs(out[tiny] - ref[tiny]) <= 2 * info.smallest_subnormal)
    assert out[-4] == 0 and np.isinf(out[-3]) and np.isnan(out[-2]) and out[-1] == 1


def test_backward_checkpoints_equal_stored_states(monkeypatch: pytest.MonkeyPatch) -> None:
    inputs = make_inputs(10, (2,), 75, 6, 4, True, True, "float64")
    rng = np.random.default_rng(11)
    d_out, d_kv = rng.normal(size=(2, 75, 4)), rng.normal(size=(2, 6, 4))
    stored = cpu.numpy_backward(*inputs, 4, d_out, d_kv)  # 19 chunks, all states kept
    monkeypatch.setattr(cpu.causal, "STORE_BYTES", 0)  # 5 segments of 4 chunks, recomputed
    recomputed = cpu.numpy_backward(*inputs, 4, d_out, d_kv)
    for a, b in zip(stored, recomputed, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("kind", ["positive", "hyperbolic"])
def test_fused_favor_equals_linear_attention(kind: str, dtype: str) -> None:
    rng = np.random.default_rng(12)
    q, k = (rng.normal(size=(2, 3, 45, 8)).astype(dtype) for _ in range(2))
    v = rng.normal(size=(1, 3, 45, 5)).astype(dtype)
    mask = rng.random((2, 1, 45)) > 0.3
    fm = la.FeatureMap(8, 16, kind=kind, seed=0)
    expected, state = la.linear_attention(
        q, k, v, fm, causal=True, key_mask=mask, chunk_size=8, return_state=True,
        backend="array_api",
    )  # fmt: skip
    out, kv, mu = cpu.favor_causal(
        q, k, v, fm.projection, hyperbolic=kind == "hyperbolic", scale=fm.scale,
        key_mask=mask, kv=np.zeros((16, 6), dtype), log_shift=np.full(16, -np.inf, dtype),
        chunk_size=8,
    )  # fmt: skip
    row_close(out, expected, 10 * RTOL[dtype])  # features rounded in another order
    row_close(kv, state.kv, 10 * RTOL[dtype])
    # Log-features are differences of O(1) terms: absolute error against their size.
    scale = float(np.abs(state.log_shift).max())
    np.testing.assert_allclose(mu, state.log_shift, rtol=0, atol=10 * RTOL[dtype] * scale)


def test_fused_linear_attention_allocates_only_its_output() -> None:
    """Above its output, the fused path's memory does not grow with L: no L x m feature
    array and no second copy of the output (scratch is O(chunk x m) per thread)."""
    import tracemalloc

    rng = np.random.default_rng(13)
    fm = la.FeatureMap(16, 64, seed=0)

    def extra(length: int) -> tuple[int, int]:
        q, k, v = (rng.normal(size=(2, length, 16)).astype(np.float32) for _ in range(3))
        la.linear_attention(q, k, v, fm, causal=True)  # compile or load the kernels first
        tracemalloc.start()
        try:
            out = la.linear_attention(q, k, v, fm, causal=True)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert out.dtype == np.float32
        return peak - out.nbytes, out.nbytes

    # Outputs of 2 and 4 MiB outgrow the scratch; both lengths take the parallel twin
    # (one scratch per worker thread), so the scratch is the same in both.
    short, out_bytes = extra(16384)
    long, _ = extra(32768)
    # 16384 more tokens would add 2 MiB for an output copy, 8 MiB for one feature array.
    assert long - short < out_bytes / 4, (short, long, out_bytes)
