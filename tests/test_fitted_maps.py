"""Fitted (``kind="hedgehog"``) feature maps on every path a random kind runs on.

Every output is compared with a dense float64 NumPy reference written here from the
map's formula (``phi(x) = softmax([x W + b, -(x W + b)])``, computed from the
parameters, not by the library): key ``j`` weighs ``exp(s q_t . k_j)`` for query ``t``
in the exact parts (bidirectional ``|t - j| < window``, ``j < sink_keys``,
``exact_key_mask``; causal ``t - window < j <= t`` and sinks ``j <= t``) and
``g sum_i phi_i(q_t) phi_i(k_j)`` on the remaining keys (``g`` the key head's far
weight, which cancels without exact parts); rows normalised.  Shapes are tiny: the
tests are about paths and parameter layouts (per head, grouped-query, shared and tied).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import linattn as la
from linattn import _dispatch
from linattn.fitted import ZERO_FAR_LOG

D, N, DV = 4, 6, 3  # head_dim, features (N / 2 columns of W), value dim
EXACT_MASK = np.array([False, False, False, False, False, True, False, False, False])
HYBRID = {"window": 2, "sink_keys": 1}
EXACT_7 = np.arange(9) == 7


# -- the reference ---------------------------------------------------------------------


def _log_phi(w: np.ndarray, b: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``log softmax([u, -u])`` of ``u = x W + b``; ``W`` ``(d, n)`` or ``(H, d, n)``."""
    u = np.einsum("...hld,hdn->...hln", x, w) + b[:, None, :] if w.ndim == 3 else x @ w + b
    z = np.concatenate([u, -u], axis=-1)
    top = z.max(axis=-1, keepdims=True)
    return z - top - np.log(np.exp(z - top).sum(axis=-1, keepdims=True))


def _reference(
    q, k, v, fm, *, causal, window=None, sink_keys=0, exact_key_mask=None, key_mask=None
):  # fmt: skip
    """Dense float64 attention, ``(B, H, L, d_v)``; keys ``(B, H_kv, L, d)``; masked keys
    (``key_mask`` false) weigh nothing, and a query that sees no key gets zeros."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    p = fm.parameters
    heads, kv_heads = q.shape[-3], k.shape[-3]
    lq = _log_phi(p.query_weight, p.query_bias, q)
    lk = _log_phi(p.key_weight, p.key_bias, k)
    hybrid = window is not None or sink_keys or exact_key_mask is not None
    g = np.broadcast_to(p.far_weight if hybrid else 1.0, (kv_heads,))
    group = heads // kv_heads
    k, v, lk = (np.repeat(a, group, axis=-3) for a in (k, v, lk))
    g = np.repeat(g, group)[:, None, None]
    length = q.shape[-2]
    t, j = np.arange(length)[:, None], np.arange(length)[None, :]
    seen = j <= t if causal else np.ones((length, length), dtype=bool)
    near = (np.abs(t - j) < (window or 0)) | (j < sink_keys)
    if exact_key_mask is not None:
        near = near | exact_key_mask
    near = near & seen
    exact = np.exp(fm.scale * np.einsum("...id,...jd->...ij", q, k))
    far = g * np.exp(lq[..., :, None, :] + lk[..., None, :, :]).sum(axis=-1)
    weights = np.where(near, exact, np.where(seen, far, 0.0))
    if key_mask is not None:
        weights = np.where(np.asarray(key_mask)[..., None, :], weights, 0.0)
        v = np.where(np.asarray(key_mask)[..., None], v, 0.0)  # (NaN padding)
    total = weights.sum(axis=-1, keepdims=True)
    return (weights @ v) / np.where(total > 0, total, 1.0)


def _map(rng, heads, kv_heads, far_weight, *, tied=False):
    """A fitted map: per head (``heads`` an int) or shared (``None``)."""
    lead = () if heads is None else (heads,)
    kv_lead = () if heads is None else (kv_heads,)
    wq, bq = rng.normal(size=(*lead, D, N // 2)), rng.normal(size=(*lead, N // 2))
    if tied:
        return la.FeatureMap.fitted(wq, bq, tied=True, far_weight=far_weight)
    wk, bk = rng.normal(size=(*kv_lead, D, N // 2)), rng.normal(size=(*kv_lead, N // 2))
    return la.FeatureMap.fitted(wq, bq, key_weight=wk, key_bias=bk, far_weight=far_weight)


def _inputs(rng, heads, kv_heads, length=9):
    q = rng.normal(size=(1, heads, length, D))
    k = rng.normal(size=(1, kv_heads, length, D))
    v = rng.normal(size=(1, kv_heads, length, DV))
    return q, k, v


def _cases(rng):
    """``(name, fm, q, k, v)``: per-head with a ``g = 0`` head, grouped-query with
    per-head key parameters, and a shared tied map."""
    yield ("per-head", _map(rng, 2, 2, [0.0, 0.6]), *_inputs(rng, 2, 2))
    yield ("grouped", _map(rng, 4, 2, [1.7, 0.0]), *_inputs(rng, 4, 2))
    yield ("shared-tied", _map(rng, None, None, 0.5, tied=True), *_inputs(rng, 2, 2))


def _options(causal):
    """Plain fitted attention, window + sinks, and (bidirectional) exact keys too."""
    yield {}
    yield HYBRID
    if not causal:
        yield {**HYBRID, "exact_key_mask": EXACT_MASK}


def _close(actual, expected, tol=1e-10):
    np.testing.assert_allclose(np.asarray(actual), expected, rtol=tol, atol=tol)


# -- 1. NumPy: the plan's paths and the portable one -----------------------------------


def test_numpy_paths_match_the_dense_reference() -> None:
    rng = np.random.default_rng(0)
    executors, scans = set(), set()
    for name, fm, q, k, v in _cases(rng):
        for causal in (True, False):
            for options in _options(causal):
                expected = _reference(q, k, v, fm, causal=causal, **options)
                for backend in (None, "array_api"):
                    plan = la.plan_attention(
                        q, k, v, fm, causal=causal, backend=backend, **options
                    )
                    executors.add(plan.executor)
                    scans.add(plan.scan.path)
                    if backend == "array_api":  # the portable code, never a kernel
                        assert plan.executor in ("portable", "hybrid-parts"), plan
                    out = la.linear_attention(
                        q, k, v, fm, causal=causal, backend=backend, **options
                    )
                    assert out.shape == (1, q.shape[1], 9, DV), name
                    _close(out, expected)
                if options and name != "shared-tied":
                    # The head with g = 0 is exactly the window and sinks alone.
                    head = list(fm.parameters.far_weight).index(0.0)
                    group = q.shape[1] // k.shape[1]
                    sparse = la.linear_attention(q, k, v, None, causal=causal, **options)
                    rows = slice(head * group, (head + 1) * group)
                    _close(out[:, rows], sparse[:, rows], 1e-12)
    # Without the kernels (numba absent, or $LINATTN_BACKEND=array_api) every scan is
    # the array API's; with them, the fused passes and the one-pass hybrid kernels
    # compute the fitted features.
    kernels = _dispatch.numpy_kernels_why_not(_dispatch.resolve_backend(None)) is None
    assert ({"numba-cpu", "array-api"} if kernels else {"array-api"}) <= scans
    fused = {"fused-causal", "fused-bidirectional", "hybrid-causal-fused", "hybrid-window-fused"}
    assert ({"portable", *fused} if kernels else {"portable", "hybrid-parts"}) <= executors


def test_a_zero_far_weight_head_without_near_keys_outputs_zeros() -> None:
    """``g = 0`` is the exact parts alone on every path: a query whose near keys are all
    masked gets zeros in that head (not the far keys' mean, as ``exp(ZERO_FAR_LOG)``
    weights normalised back), its far keys no gradient; the other heads see them.  Per
    head and grouped-query; NumPy (kernels and portable), states, torch (dense, portable,
    kernels) with gradients."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(12)
    key_mask = np.ones((1, 1, 9), dtype=bool)
    key_mask[..., 6:] = key_mask[..., 0] = False  # query 8: far keys only
    kernels = _dispatch.numpy_kernels_why_not(_dispatch.resolve_backend(None)) is None
    torch_backends = (None, "array_api") + (("numba",) if kernels else ())
    for heads, far_weight in ((2, [0.0, 0.6]), (4, [1.7, 0.0])):
        fm = _map(rng, heads, 2, far_weight)
        q, k, v = _inputs(rng, heads, 2)
        off = far_weight.index(0.0)  # query heads reading the key head with g = 0, another
        zero, other = off * (heads // 2), (1 - off) * (heads // 2)
        for causal in (True, False):
            # the sink (and the exact key) masked from every query, the window from query 8
            hidden = [{"sink_keys": 1}] + ([] if causal else [{"exact_key_mask": EXACT_7}])
            for options in (HYBRID, *hidden):
                options = {**options, "causal": causal, "key_mask": key_mask}
                expected = _reference(q, k, v, fm, **options)
                assert np.all(expected[:, zero, 8] == 0) and np.all(expected[:, other, 8])
                for backend in (None, "array_api"):
                    _close(la.linear_attention(q, k, v, fm, backend=backend, **options), expected)
                    if causal:  # in pieces, through the state (the last piece decoded)
                        outs, state = [], None
                        for t in (slice(0, 4), slice(4, 8), slice(8, 9)):
                            out, state = la.linear_attention(
                                *(a[..., t, :] for a in (q, k, v)), fm, state=state,
                                return_state=True, backend=backend,
                                **{**options, "key_mask": key_mask[..., t]},
                            )  # fmt: skip
                            outs.append(out)
                        _close(np.concatenate(outs, axis=-2), expected)
                grad = rng.normal(size=expected.shape)
                vjp = la.linear_attention_vjp(q, k, v, fm, grad, **options)
                t_options = {**options, "key_mask": torch.tensor(key_mask)}
                if "exact_key_mask" in options:
                    t_options["exact_key_mask"] = torch.tensor(EXACT_7)
                for backend in torch_backends:
                    tensors = [torch.tensor(a, requires_grad=True) for a in (q, k, v)]
                    out = la.linear_attention(*tensors, fm, backend=backend, **t_options)
                    _close(out.detach().numpy(), expected)
                    (out * torch.tensor(grad)).sum().backward()
                    for tensor, expected_grad in zip(tensors, vjp, strict=True):
                        _close(tensor.grad.numpy(), expected_grad)


def test_float32_plain_attention_with_a_zero_far_weight() -> None:
    """Without exact parts ``g`` cancels: a head with ``g = 0`` (``log g = -1e4``) keeps
    float32 rounding (the shift is not added, so the features are not rounded to the
    float spacing at ``1e4``)."""
    rng = np.random.default_rng(10)
    fm = _map(rng, 2, 2, [0.0, 1.0])
    q, k, v = _inputs(rng, 2, 2)
    q32, k32, v32 = (a.astype(np.float32) for a in (q, k, v))
    for causal in (True, False):
        expected = _reference(q, k, v, fm, causal=causal)
        for backend in (None, "array_api"):
            out = la.linear_attention(q32, k32, v32, fm, causal=causal, backend=backend)
            assert out.dtype == np.float32
            _close(out, expected, 1e-5)


def test_fused_paths_say_why_not() -> None:
    """The fused passes and the decoding kernel compute a fitted map's features for NumPy
    arrays (forward); torch tensors, which differentiate through the fused backward
    passes, which compute random features only, take the paths that take log-features
    (the plan says so; nothing runs wrong)."""
    why_not = _dispatch.numpy_kernels_why_not(_dispatch.resolve_backend(None))
    if why_not is not None:
        pytest.skip(f"no compiled kernels here: {why_not}")
    rng = np.random.default_rng(1)
    fm = _map(rng, 2, 2, 1.0)
    q, k, v = _inputs(rng, 2, 2)
    assert la.plan_attention(q, k, v, fm).executor == "fused-bidirectional"
    assert la.plan_attention(q, k, v, fm, causal=True).executor == "fused-causal"
    _, state = la.linear_attention(q, k, v, fm, causal=True, return_state=True)
    t = slice(0, 1)
    plan = la.plan_attention(
        q[..., t, :], k[..., t, :], v[..., t, :], fm, causal=True, state=state, return_state=True
    )
    assert plan.executor == "decode"
    torch = pytest.importorskip("torch")
    plan = la.plan_attention(*(torch.tensor(a) for a in (q, k, v)), fm)
    assert dict(plan.rejected)["fused-bidirectional"] == (
        "a fitted map: the fused passes compute its features for NumPy arrays only"
    )


def test_random_and_fitted_maps_share_each_kernels_specialisation() -> None:
    """A fitted map's calls run the compiled kernels a random map's calls compiled (the
    same argument types: every input read-only), so ``linattn compile`` and a process
    that uses both compile each kernel once.  Fails if a fitted call adds a signature."""
    why_not = _dispatch.numpy_kernels_why_not(_dispatch.resolve_backend(None))
    if why_not is not None:
        pytest.skip(f"no compiled kernels here: {why_not}")
    import importlib

    from linattn_numba import _machinery

    dispatchers = [
        d
        for name in ("bidirectional", "decode", "fused_causal", "hybrid")
        for x in vars(importlib.import_module(f"linattn_numba.cpu.{name}")).values()
        if isinstance(x, _machinery.Variants)
        for d in x.dispatchers.values()
    ]
    rng = np.random.default_rng(13)
    q, k, v = _inputs(rng, 2, 2)
    calls = [{"causal": True}, {}, {**HYBRID, "causal": True}, HYBRID]

    def run(fm):  # type: ignore[no-untyped-def]
        for options in calls:
            la.linear_attention(q, k, v, fm, **options)
        _, state = la.linear_attention(
            q[..., :-1, :], k[..., :-1, :], v[..., :-1, :], fm, causal=True, return_state=True
        )
        la.linear_attention(q[..., -1:, :], k[..., -1:, :], v[..., -1:, :], fm, causal=True,
                            state=state)  # fmt: skip
        return [len(d.signatures) for d in dispatchers]

    random = run(la.FeatureMap(D, N, kind="hyperbolic", seed=0))
    assert sum(random) >= 4  # (the calls reached the four kernels)
    assert run(_map(rng, 2, 2, [0.0, 0.6])) == random


def test_fused_kernels_check_the_parameters() -> None:
    """The fused passes' own entry points name a bad parameter before compiled code runs."""
    if _dispatch.numpy_kernels_why_not(_dispatch.resolve_backend(None)) is not None:
        pytest.skip("no compiled kernels here")
    from linattn_numba import cpu
    from linattn_numba.cpu.bidirectional import favor_bidirectional

    rng = np.random.default_rng(5)
    fm = _map(rng, 2, 2, 1.0)
    q, k, v = _inputs(rng, 2, 2)
    empty, good = _dispatch.fitted_kernel_arrays(fm, q.shape, np.float64)
    state = {"kv": np.zeros((1, 2, N, DV + 1)), "log_shift": np.full((1, 2, N), -np.inf)}
    options = {"hyperbolic": False, "scale": 0.5, "key_mask": None}
    bad = {**good, "key_bias": good["key_bias"][..., :1]}
    with pytest.raises(ValueError, match=r"fitted\['key_bias'\] must have shape \(1, 2, 3\)"):
        cpu.favor_causal(q, k, v, empty, **options, **state, chunk_size=4, fitted=bad)
    with pytest.raises(ValueError, match=r"fitted\['key_bias'\] must have shape"):
        favor_bidirectional(q, k, v, empty, **options, fitted=bad)
    wrong = {**good, "query_weight": good["query_weight"].astype(np.float32)}
    with pytest.raises(TypeError, match=r"fitted\['query_weight'\] must have dtype float64"):
        favor_bidirectional(q, k, v, empty, **options, fitted=wrong)
    with pytest.raises(TypeError, match="fitted must be a dict with keys"):
        favor_bidirectional(q, k, v, empty, **options, fitted={"query_weight": 1})
    out, *_ = favor_bidirectional(q, k, v, empty, **options, fitted=good)
    _close(out, _reference(q, k, v, fm, causal=False))


# -- 2. states and decoding ------------------------------------------------------------


def test_states_and_decoding_continue_the_sequence() -> None:
    rng = np.random.default_rng(2)
    for name, fm, q, k, v in _cases(rng):
        for options in (None, {"window": 3, "sink_keys": 1}):
            expected = _reference(q, k, v, fm, causal=True, **(options or {}))
            for backend in (None, "array_api"):
                kw = {"causal": True, "return_state": True, "backend": backend, **(options or {})}
                outs, state = [], None
                for start, stop in ((0, 4), (4, 7), (7, 8), (8, 9)):  # then two decode steps
                    t = slice(start, stop)
                    out, state = la.linear_attention(
                        q[..., t, :], k[..., t, :], v[..., t, :], fm, state=state, **kw
                    )
                    outs.append(out)
                _close(np.concatenate(outs, axis=-2), expected)
                assert state.num_tokens == 9, name


# -- 3. torch --------------------------------------------------------------------------


def _finite_difference_vjp(q, k, v, fm, grad, options, eps=1e-6):
    """Central differences of ``sum(grad * reference)`` for every entry of q, k, v."""
    arrays = [q.copy(), k.copy(), v.copy()]
    grads = []
    for a in arrays:
        d = np.zeros_like(a)
        for index in np.ndindex(a.shape):
            old = a[index]
            a[index] = old + eps
            plus = np.sum(grad * _reference(*arrays, fm, **options))
            a[index] = old - eps
            minus = np.sum(grad * _reference(*arrays, fm, **options))
            a[index] = old
            d[index] = (plus - minus) / (2 * eps)
        grads.append(d)
    return grads


def test_numpy_vjp_matches_finite_differences() -> None:
    """linear_attention_vjp (the reference for the torch gradients) against central
    differences of the dense reference: per-head, grouped-query and hybrid."""
    rng = np.random.default_rng(3)
    fm = _map(rng, 4, 2, [1.7, 0.0])
    q, k, v = _inputs(rng, 4, 2, length=5)
    grad = rng.normal(size=(1, 4, 5, DV))
    exact = EXACT_MASK[:5]
    for options in (
        {"causal": True},
        {"causal": False, "window": 2, "sink_keys": 1, "exact_key_mask": exact},
    ):
        expected = _finite_difference_vjp(q, k, v, fm, grad, options)
        for backend in (None, "array_api"):
            got = la.linear_attention_vjp(q, k, v, fm, grad, backend=backend, **options)
            for a, b in zip(got, expected, strict=True):
                # central differences: truncation ~ eps^2, rounding ~ 1e-16 / eps
                np.testing.assert_allclose(a, b, rtol=1e-7, atol=1e-8)


def test_torch_outputs_gradients_and_kernels() -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    fm = _map(rng, 4, 2, [0.3, 0.0])
    q, k, v = _inputs(rng, 4, 2)
    grad = rng.normal(size=(1, 4, 9, DV))
    seen = set()
    kernels = _dispatch.numpy_kernels_why_not(_dispatch.resolve_backend(None)) is None
    for causal in (True, False):
        for options in _options(causal):
            expected = _reference(q, k, v, fm, causal=causal, **options)
            vjp = la.linear_attention_vjp(q, k, v, fm, grad, causal=causal, **options)
            t_options = {
                name: torch.tensor(x) if isinstance(x, np.ndarray) else x
                for name, x in options.items()
            }
            backends = (None, "array_api") + (("numba",) if kernels else ())
            for backend in backends:
                tensors = [torch.tensor(a, requires_grad=True) for a in (q, k, v)]
                plan = la.plan_attention(*tensors, fm, causal=causal, backend=backend, **t_options)
                seen.add(plan.executor)
                out = la.linear_attention(
                    *tensors, fm, causal=causal, backend=backend, **t_options
                )
                _close(out.detach().numpy(), expected)
                (out * torch.tensor(grad)).sum().backward()
                for tensor, expected_grad in zip(tensors, vjp, strict=True):
                    _close(tensor.grad.numpy(), expected_grad)
    # Short torch CPU tensors with exact parts run the dense form (autograd); asked for
    # the kernels, the compiled kernels (forward and backward: longer calls' path).
    assert "dense-hybrid" in seen
    if kernels:
        assert "torch-kernels" in seen
    # float32 on the kernels: rounding of float32.
    t32 = [torch.tensor(a, dtype=torch.float32) for a in (q, k, v)]
    out = la.linear_attention(*t32, fm, **HYBRID)
    assert out.dtype == torch.float32
    _close(out.numpy(), _reference(q, k, v, fm, causal=False, **HYBRID), 1e-5)


# -- 4. JAX, Dask, array-api-strict ----------------------------------------------------


@pytest.mark.needs("jax")
def test_jax_jit_and_grad() -> None:
    """Outputs and ``jax.grad`` w.r.t. q in one jitted function (one compile a case)."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    rng = np.random.default_rng(5)
    fm = _map(rng, 4, 2, [0.0, 2.0])
    q, k, v = _inputs(rng, 4, 2)
    grad = rng.normal(size=(1, 4, 9, DV))
    with jax.enable_x64(True):
        jq, jk, jv, jg = (jnp.asarray(a) for a in (q, k, v, grad))
        for causal, options in ((True, HYBRID), (False, {**HYBRID, "exact_key_mask": EXACT_MASK})):
            j_options = {
                name: jnp.asarray(x) if isinstance(x, np.ndarray) else x
                for name, x in options.items()
            }

            def outputs_and_dq(q, causal=causal, j_options=j_options):
                def attend(q):
                    return la.linear_attention(q, jk, jv, fm, causal=causal, **j_options)

                return attend(q), jax.grad(lambda q: jnp.sum(jg * attend(q)))(q)

            # short calls: the dense form, traced and differentiated by JAX
            plan = la.plan_attention(jq, jk, jv, fm, causal=causal, **j_options)
            assert plan.executor == "dense-hybrid"
            out, dq = jax.jit(outputs_and_dq)(jq)
            _close(out, _reference(q, k, v, fm, causal=causal, **options))
            expected = la.linear_attention_vjp(q, k, v, fm, grad, causal=causal, **options)
            _close(dq, expected[0])


@pytest.mark.needs("dask")
def test_dask_chunks_along_the_sequence_and_the_heads() -> None:
    """Per-head parameters with the head axis chunked: each block's call needs every
    head, so the graph holds the head axes whole (never a block with another head's
    parameters)."""
    da = pytest.importorskip("dask.array")
    rng = np.random.default_rng(6)
    fm = _map(rng, 4, 2, [1.7, 0.0])
    q, k, v = _inputs(rng, 4, 2)

    def chunked(x, heads):
        return da.from_array(x, chunks=(1, heads or x.shape[1], 4, x.shape[-1]))

    for causal, options in ((True, {}), (False, {**HYBRID, "exact_key_mask": EXACT_MASK})):
        expected = _reference(q, k, v, fm, causal=causal, **options)
        d_options = {
            key: da.from_array(x, chunks=4) if isinstance(x, np.ndarray) else x
            for key, x in options.items()
        }
        for heads in (None, 1):  # the sequence only; then the heads one by one too
            dq, dk, dv = (chunked(a, heads) for a in (q, k, v))
            out = la.linear_attention(dq, dk, dv, fm, causal=causal, **d_options)
            _close(out.compute(), expected)
    # The causal graph's state continues the sequence on NumPy arrays.
    first, state = la.linear_attention(
        *(chunked(a[..., :5, :], 1) for a in (q, k, v)), fm, causal=True, return_state=True
    )
    state = la.LinearAttentionState(
        kv=np.asarray(state.kv.compute()),
        log_shift=np.asarray(state.log_shift.compute()),
        feature_map=state.feature_map,
        num_tokens=state.num_tokens,
    )
    second = la.linear_attention(*(a[..., 5:, :] for a in (q, k, v)), fm, causal=True, state=state)
    both = np.concatenate([first.compute(), second], axis=-2)
    _close(both, _reference(q, k, v, fm, causal=True))


def test_array_api_strict() -> None:
    xs = pytest.importorskip("array_api_strict")
    rng = np.random.default_rng(7)
    for name, fm, q, k, v in _cases(rng):
        for causal in (True, False):
            for options in _options(causal):
                s_options = {
                    key: xs.asarray(x) if isinstance(x, np.ndarray) else x
                    for key, x in options.items()
                }
                out = la.linear_attention(
                    *(xs.asarray(a) for a in (q, k, v)), fm, causal=causal, **s_options
                )
                assert type(out).__module__.startswith("array_api_strict"), name
                _close(np.asarray(out), _reference(q, k, v, fm, causal=causal, **options))


# -- 5. parameter cotangents -----------------------------------------------------------


def _parameter_finite_differences(fm, x, d_log, role, names, eps=1e-6):
    """Central differences of ``sum(d_log * log_features(x))`` in each named parameter."""
    p = fm.parameters._asdict()
    out = {}
    for name in names:
        base = np.array(p[name])
        d = np.zeros_like(base)
        for index in np.ndindex(base.shape):
            values = []
            for step in (eps, -eps):
                moved = base.copy()
                moved[index] += step
                changed = fm.with_parameters(**{name: moved})
                values.append(np.sum(d_log * changed.log_features(x, role=role)))
            d[index] = (values[0] - values[1]) / (2 * eps)
        out[name] = d
    return out


def test_parameter_vjp_matches_finite_differences() -> None:
    rng = np.random.default_rng(8)
    per_head = _map(rng, 4, 2, [0.7, 1.9])
    x_q = rng.normal(size=(2, 4, 5, D))
    x_k = rng.normal(size=(2, 2, 5, D))
    grouped = per_head.grouped(2, 2)
    for fm, x, role in (
        (per_head, x_q, "query"),
        (per_head, x_k, "key"),
        # grouped-query inputs (B, H_kv, G, L, d) and (B, H_kv, 1, L, d)
        (grouped, x_q.reshape(2, 2, 2, 5, D), "query"),
        (grouped, x_k[:, :, None], "key"),
        (_map(rng, None, None, 0.4, tied=True), x_q, "key"),
    ):
        d_log = rng.normal(size=(*x.shape[:-1], N))
        got = fm.log_features_parameter_vjp(x, d_log, role=role)
        prefix = "query" if fm.parameters.tied else role
        names = [f"{prefix}_weight", f"{prefix}_bias"] + (["far_weight"] if role == "key" else [])
        assert sorted(got) == sorted(names)
        if fm is grouped:  # the grouped map's layout; differences on the map it came from
            shapes = per_head.parameters._asdict()
            got = {name: got[name].reshape(shapes[name].shape) for name in names}
            expected = _grouped_finite_differences(per_head, x, d_log, role, names)
        else:
            expected = _parameter_finite_differences(fm, x, d_log, role, names)
        for name in names:
            np.testing.assert_allclose(got[name], expected[name], rtol=1e-7, atol=1e-8)
    # A head with g = 0 chose the exact parts: its far weight gets no cotangent.
    fm = _map(rng, 4, 2, [0.0, 1.0])
    d_log = rng.normal(size=(2, 2, 5, N))
    assert fm.log_features_parameter_vjp(x_k, d_log, role="key")["far_weight"][0] == 0.0
    assert np.all(fm.log_features(x_k, role="key")[:, 0] < ZERO_FAR_LOG / 2)


def _grouped_finite_differences(fm, x, d_log, role, names, eps=1e-6):
    """As :func:`_parameter_finite_differences` on grouped inputs: the grouped map of
    ``fm`` with each parameter moved."""
    group = x.shape[-3] if role == "query" else 2
    p = fm.parameters._asdict()
    out = {}
    for name in names:
        base = np.array(p[name])
        d = np.zeros_like(base)
        for index in np.ndindex(base.shape):
            values = []
            for step in (eps, -eps):
                moved = base.copy()
                moved[index] += step
                changed = fm.with_parameters(**{name: moved}).grouped(group, 2)
                values.append(np.sum(d_log * changed.log_features(x, role=role)))
            d[index] = (values[0] - values[1]) / (2 * eps)
        out[name] = d
    return out


# -- 6. errors -------------------------------------------------------------------------


def test_errors_name_the_argument() -> None:
    rng = np.random.default_rng(9)
    w = rng.normal(size=(4, D, N // 2))
    fitted = la.FeatureMap.fitted
    with pytest.raises(ValueError, match=r"query_bias must have shape \(4, 3\)"):
        fitted(w, np.zeros((4, 4)), tied=True)
    with pytest.raises(ValueError, match=r"key_weight must have shape \(4, 3\)"):
        fitted(w, key_weight=np.ones((2, D, N // 2 + 1)))
    with pytest.raises(ValueError, match="key_weight's heads must divide query_weight's"):
        fitted(w, key_weight=np.ones((3, D, N // 2)))
    with pytest.raises(ValueError, match=r"far_weight must be a number or have shape \(2,\)"):
        fitted(w, key_weight=w[:2], far_weight=[1.0, 1.0, 1.0, 1.0])
    for bad in (-1.0, [1.0, -0.5]):
        with pytest.raises(ValueError, match="far_weight must be non-negative"):
            fitted(w, key_weight=w[:2], far_weight=bad)
    for bad in (np.inf, [1.0, np.nan]):
        with pytest.raises(ValueError, match="far_weight must be finite"):
            fitted(w, key_weight=w[:2], far_weight=bad)
    with pytest.raises(ValueError, match="key_weight is required unless tied=True"):
        fitted(w)
    fm = fitted(w, key_weight=w)
    x3 = rng.normal(size=(1, 3, 5, D))
    with pytest.raises(ValueError, match=r"query_weight has heads \(4\) needs inputs"):
        la.linear_attention(x3, x3, x3, fm)
    with pytest.raises(ValueError, match=r"query_weight has heads \(4\) needs inputs"):
        la.linear_attention(x3[0], x3[0], x3[0], fm, window=2)
    # Grouped-query inputs whose head counts are not the parameters'.
    q8, kv2 = rng.normal(size=(1, 8, 5, D)), rng.normal(size=(1, 2, 5, D))
    with pytest.raises(ValueError, match=r"query_weight has 4 heads .* 8 query and 2"):
        la.linear_attention(q8, kv2, kv2, fitted(w, key_weight=w[:2]))
    with pytest.raises(ValueError, match=r"key_weight has 4 heads .* needs one per key/value"):
        la.linear_attention(q8[:, :4], kv2, kv2, fm, causal=True)
    with pytest.raises(ValueError, match=r"key_weight has 4 heads .* needs one per key/value"):
        la.linear_attention_vjp(q8[:, :4], kv2, kv2, fm, q8[:, :4, :, :3])
    for call in (
        lambda: fm.log_features(x3[0, 0]),
        lambda: fm.log_features_vjp(x3[0, 0], np.ones((5, N))),
        lambda: fm.log_features_parameter_vjp(x3[0, 0], np.ones((5, N)), role=None),
    ):
        with pytest.raises(ValueError, match="role must be 'query' or 'key' for a fitted map"):
            call()
    with pytest.raises(ValueError, match="num_features must be even"):
        la.FeatureMap(D, 7, kind="hedgehog")
    with pytest.raises(ValueError, match="no random draw to redraw"):
        fm.redraw()
    backend = _dispatch.resolve_backend(None)
    if _dispatch.numpy_kernels_why_not(backend) is None:  # the kernel's own entry point
        from linattn.fitted import kernel_parameters
        from linattn_numba.cpu import hybrid

        params = kernel_parameters(fm.parameters, (1, 4, 5, D))
        params["key_bias"] = params["key_bias"][..., :2]
        x4 = rng.normal(size=(1, 4, 5, D))
        sinks = np.zeros((1, 4, 0, D)), np.zeros((1, 4, 0, D)), np.zeros((1, 4, 5, 0), bool)
        with pytest.raises(ValueError, match=r"fitted\['key_bias'\] must have shape \(1, 4, 3\)"):
            hybrid.bidirectional_forward(
                x4, x4, x4, np.ones((1, 4, 5), bool), 2, 0.5, *sinks, np.zeros((0, D)),
                hyperbolic=False, chunk_size=4, fitted=params,
            )  # fmt: skip


# -- 7. parameter cotangents of attention ------------------------------------------------


def test_attention_vjp_parameters_match_finite_differences() -> None:
    """``linear_attention_vjp(..., parameters=True)``: plain and hybrid, per-head with
    grouped-query inputs and a shared tied map, against central differences of the
    dense reference in every parameter entry."""
    rng = np.random.default_rng(11)
    exact = EXACT_MASK[:5]
    cases = [
        (_map(rng, 4, 2, [0.7, 1.9]), 4, 2, {"causal": True}),
        (_map(rng, 4, 2, [0.7, 1.9]), 4, 2, {"causal": False, **HYBRID, "exact_key_mask": exact}),
        (_map(rng, None, None, 0.6, tied=True), 2, 2, {"causal": True, **HYBRID}),
    ]
    eps = 1e-6
    for fm, heads, kv_heads, options in cases:
        q, k, v = _inputs(rng, heads, kv_heads, length=5)
        grad = rng.normal(size=(1, heads, 5, DV))
        plain = la.linear_attention_vjp(q, k, v, fm, grad, **options)
        assert len(plain) == 3
        *inputs, got = la.linear_attention_vjp(q, k, v, fm, grad, parameters=True, **options)
        for a, b in zip(inputs, plain, strict=True):
            np.testing.assert_array_equal(a, b)
        assert sorted(got) == sorted(fm.parameters.arrays())
        for name, base in fm.parameters.arrays().items():
            expected = np.zeros_like(base)
            for index in np.ndindex(base.shape):
                values = []
                for step in (eps, -eps):
                    moved = np.array(base)
                    moved[index] += step
                    changed = fm.with_parameters(**{name: moved})
                    values.append(np.sum(grad * _reference(q, k, v, changed, **options)))
                expected[index] = (values[0] - values[1]) / (2 * eps)
            assert got[name].shape == base.shape, name
            np.testing.assert_allclose(got[name], expected, rtol=1e-7, atol=1e-8, err_msg=name)
    with pytest.raises(ValueError, match="parameters=True needs a fitted feature map"):
        la.linear_attention_vjp(q, k, v, la.FeatureMap(D, 8), grad, parameters=True)


def test_dense_or_library_path_is_chosen_in_one_place() -> None:
    """``use_dense``: the dense form for self-attention up to DENSE_MAX_LENGTH tokens with
    no backend named; ``dense=`` forces either; bad values are named."""
    from linattn._fitted_call import DENSE_MAX_LENGTH, use_dense

    def x(length: int) -> np.ndarray:
        return np.broadcast_to(np.zeros(()), (1, 2, length, D))

    short, long = x(DENSE_MAX_LENGTH), x(DENSE_MAX_LENGTH + 1)
    assert use_dense(None, None, short, short) and not use_dense(None, None, long, long)
    assert not use_dense(None, "numba", short, short)  # a named backend: the library
    assert not use_dense(None, None, x(3), x(4))  # cross-attention: the library
    assert use_dense(True, None, long, long) and not use_dense(False, None, short, short)
    with pytest.raises(ValueError, match="dense=True computes in the caller's array library"):
        use_dense(True, "numba", short, short)
    with pytest.raises(TypeError, match="dense must be None, True or False; got 'yes'"):
        use_dense("yes", None, short, short)


def test_the_dense_form_is_linear_attention() -> None:
    """``dense_hybrid`` (NumPy, float64) equals ``linear_attention`` with the same map:
    plain and hybrid, causal and not, padded keys, grouped-query heads, a shared tied
    map, ``g = 0`` with exact parts (the exact parts alone) and without (``g`` cancels)."""
    from linattn._fitted_call import dense_hybrid

    rng = np.random.default_rng(14)
    key_mask = np.array([True] * 5 + [False] * 2)
    for fm, heads, kv_heads in (
        (_map(rng, 4, 2, [0.0, 1.9]), 4, 2),
        (_map(rng, None, None, 0.6, tied=True), 2, 2),
        (_map(rng, 2, 1, [0.0]), 2, 1),
    ):
        q, k, v = _inputs(rng, heads, kv_heads, length=7)
        for options in (
            {"causal": True},
            {"causal": False, "key_mask": key_mask},
            {"causal": True, **HYBRID, "key_mask": key_mask},
            {"causal": False, "window": 2, "exact_key_mask": EXACT_MASK[:7]},
        ):
            got = dense_hybrid(
                q, k, v, **fm.parameters.arrays(), tied=fm.parameters.tied, **options
            )
            _close(got, la.linear_attention(q, k, v, fm, **options))


def test_torch_fitted_attention_differentiates_the_parameters() -> None:
    """``linattn.torch.fitted_attention``: torch autograd in q, k, v and every parameter
    equals ``linear_attention_vjp(parameters=True)`` (held to finite differences above),
    in the dense form (autograd) and on the library's path (``_FittedAttention``:
    linear_attention's plan forward, the array-API path); a ``g = 0`` head's far weight gets 0, a
    tensor that does not require gradients none."""
    torch = pytest.importorskip("torch")
    from linattn.torch import fitted_attention

    rng = np.random.default_rng(12)
    exact = EXACT_MASK[:5]
    cases = [
        (_map(rng, 4, 2, [0.7, 1.9]), 4, 2, {"causal": True}),
        (_map(rng, 4, 2, [0.0, 1.9]), 4, 2, {"causal": False, **HYBRID, "exact_key_mask": exact}),
        (_map(rng, None, None, 0.6, tied=True), 2, 2, {"causal": True, **HYBRID}),
    ]
    seen = set()
    for fm, heads, kv_heads, options in cases:
        q, k, v = _inputs(rng, heads, kv_heads, length=5)
        grad = rng.normal(size=(1, heads, 5, DV))
        *expected_inputs, expected = la.linear_attention_vjp(
            q, k, v, fm, grad, parameters=True, **options
        )
        arrays = fm.parameters.arrays()
        tensors = {
            name: torch.tensor(np.array(x), requires_grad=True) for name, x in arrays.items()
        }
        t_options = {
            n: torch.tensor(x) if isinstance(x, np.ndarray) else x for n, x in options.items()
        }
        for backend, dense in ((None, None), (None, False), ("array_api", None)):
            inputs = [torch.tensor(a, requires_grad=True) for a in (q, k, v)]
            seen.add(la.plan_attention(*inputs, fm, backend=backend, **t_options).executor)
            out = fitted_attention(
                *inputs,
                **tensors,
                tied=fm.parameters.tied,
                backend=backend,
                dense=dense,
                **t_options,
            )
            library = type(out.grad_fn).__name__ == "_FittedAttentionBackward"
            assert library == (dense is False or backend is not None)  # 5 tokens: dense
            _close(out.detach().numpy(), la.linear_attention(q, k, v, fm, **options))
            (out * torch.tensor(grad)).sum().backward()
            for tensor, want in zip(inputs, expected_inputs, strict=True):
                _close(tensor.grad.numpy(), want)
            for name, tensor in tensors.items():
                np.testing.assert_allclose(
                    tensor.grad.numpy(), expected[name], rtol=1e-9, atol=1e-12, err_msg=name
                )
                tensor.grad = None
        if options.get("exact_key_mask") is not None:  # the g = 0 head chose the exact parts
            assert expected["far_weight"][0] == 0.0 and expected["far_weight"][1] != 0.0
    # (the library's path forward at 5 tokens: the dense executor of linear_attention)
    assert "dense-hybrid" in seen
    # Only what requires gradients gets one; float32 parameters get float32 gradients.
    fm, heads, kv_heads, options = cases[1]
    q, k, v = (torch.tensor(a, dtype=torch.float32) for a in _inputs(rng, heads, kv_heads, 5))
    arrays = fm.parameters.arrays()
    tensors = {name: torch.tensor(np.array(x), dtype=torch.float32) for name, x in arrays.items()}
    tensors["key_weight"].requires_grad_()
    options = {**options, "exact_key_mask": torch.tensor(exact)}
    for dense in (True, False):
        out = fitted_attention(q.requires_grad_(), k, v, **tensors, **options, dense=dense)
        out.sum().backward()
        assert tensors["key_weight"].grad.dtype == torch.float32
        assert all(t.grad is None for n, t in tensors.items() if n != "key_weight")
        assert k.grad is None and q.grad is not None
        tensors["key_weight"].grad = None
    for dense in (True, False):
        negative = {**tensors, "far_weight": torch.tensor([-0.1, 1.0])}
        with pytest.raises(ValueError, match="far_weight must be non-negative"):
            fitted_attention(q, k, v, **negative, dense=dense)
        wrong_heads = r"query_weight has heads \(4\) needs inputs \(\.\.\., 4, L, d\); got shape"
        with pytest.raises(ValueError, match=wrong_heads):
            fitted_attention(q[:, :2], k[:, :1], v[:, :1], **tensors, dense=dense)


def test_dense_form_checks_a_structure_once_and_values_every_call(monkeypatch) -> None:
    """The dense form of ``linattn.torch.fitted_attention`` copies no parameter to the
    host once a call of the same structure has been checked, yet still refuses bad
    values on every call and checks every new structure in full."""
    torch = pytest.importorskip("torch")
    from linattn import _fitted_call, fitted
    from linattn.torch import fitted_attention

    rng = np.random.default_rng(17)
    tensors = {
        "query_weight": torch.tensor(rng.normal(size=(2, D, N // 2))),
        "far_weight": torch.tensor([0.5, 1.5]),
    }
    q, k, v = (torch.tensor(a) for a in _inputs(rng, 2, 2, length=5))
    _fitted_call._CHECKED.clear()
    host_copies = []
    original = fitted.to_host
    monkeypatch.setattr(fitted, "to_host", lambda x: host_copies.append(x) or original(x))
    fitted_attention(q, k, v, **tensors, tied=True, **HYBRID)
    assert host_copies and not any(np.any(original(x)) for x in host_copies)  # stand-ins
    host_copies.clear()
    out = fitted_attention(q, k, v, **tensors, tied=True, **HYBRID)
    assert host_copies == []  # the same structure: values checked on the tensors
    ref = la.linear_attention(q, k, v, la.FeatureMap.fitted(**tensors, tied=True), **HYBRID)
    _close(out.numpy(), ref.numpy())
    for name, bad, message in (
        ("far_weight", torch.tensor([0.5, -1.0]), "far_weight must be non-negative"),
        ("far_weight", torch.tensor([0.5, math.nan]), "far_weight must be finite"),
        ("query_weight", tensors["query_weight"] * math.inf, "query_weight must be finite"),
    ):
        with pytest.raises(ValueError, match=message):
            fitted_attention(q, k, v, **{**tensors, name: bad}, tied=True, **HYBRID)
    with pytest.raises(ValueError, match=r"query_weight has heads \(2\)"):  # a new structure
        fitted_attention(q[:, :1], k[:, :1], v[:, :1], **tensors, tied=True, **HYBRID)


def test_torch_fitted_attention_compiles_in_one_graph() -> None:
    """``torch.compile`` of the dense form: compiled before any eager call it equals the
    eager call, gradients included; once its structure is checked the call is one graph,
    and the parameters' values are asserted when the graph runs."""
    torch = pytest.importorskip("torch")
    from linattn import _fitted_call
    from linattn.torch import fitted_attention

    rng = np.random.default_rng(19)
    q, k, v = (torch.tensor(a) for a in _inputs(rng, 2, 2, length=5))
    w = torch.tensor(rng.normal(size=(2, D, N // 2)), requires_grad=True)
    g = torch.tensor([0.5, 1.5])

    def call(w, g):  # type: ignore[no-untyped-def]
        return fitted_attention(q, k, v, w, tied=True, far_weight=g, **HYBRID)

    torch.compiler.reset()
    _fitted_call._CHECKED.clear()
    compiled = torch.compile(call, backend="aot_eager")(w, g)  # the structure: untraced
    (d_compiled,) = torch.autograd.grad(compiled.sum(), w)
    eager = call(w, g)
    (d_eager,) = torch.autograd.grad(eager.sum(), w)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-14)
    torch.testing.assert_close(d_compiled, d_eager, rtol=0, atol=1e-14)
    explained = torch._dynamo.explain(call)(w, g)
    assert explained.graph_break_count == 0, [str(r.reason)[:200] for r in explained.break_reasons]
    one_graph = torch.compile(call, fullgraph=True, backend="aot_eager")
    with pytest.raises(RuntimeError, match="far_weight must be non-negative"):
        one_graph(w, torch.tensor([0.5, -1.0]))
    with pytest.raises(RuntimeError, match="query_weight must be finite"):
        one_graph(w.detach() * math.inf, g)


@pytest.mark.needs("jax")
def test_jax_fitted_attention_differentiates_the_parameters() -> None:
    """``linattn.jax.fitted_attention``: ``jax.grad`` (eager and under ``jax.jit``) in q,
    k, v and every parameter equals ``linear_attention_vjp(parameters=True)``, in the
    dense form (no callback in the jaxpr) and on the library's path through the host
    callback; masks are arguments, a ``g = 0`` head's far weight gets 0."""
    jax = pytest.importorskip("jax")
    from linattn.jax import fitted_attention

    jnp = jax.numpy
    rng = np.random.default_rng(13)
    exact = EXACT_MASK[:5]
    key_mask = np.array([True, True, True, True, False])
    cases = [
        (_map(rng, 4, 2, [0.7, 1.9]), 4, 2, {"causal": True, "key_mask": key_mask}),
        (_map(rng, 4, 2, [0.0, 1.9]), 4, 2, {"causal": False, **HYBRID, "exact_key_mask": exact}),
        (_map(rng, None, None, 0.6, tied=True), 2, 2, {"causal": True, **HYBRID}),
    ]
    with jax.enable_x64(True):
        for fm, heads, kv_heads, options in cases:
            q, k, v = _inputs(rng, heads, kv_heads, length=5)
            grad = rng.normal(size=(1, heads, 5, DV))
            *expected_inputs, expected = la.linear_attention_vjp(
                q, k, v, fm, grad, parameters=True, **options
            )
            tied = fm.parameters.tied
            arrays = {n: jnp.asarray(x) for n, x in fm.parameters.arrays().items()}
            j_options = {
                n: jnp.asarray(x) if isinstance(x, np.ndarray) else x for n, x in options.items()
            }

            inputs = tuple(jnp.asarray(a) for a in (q, k, v))
            for dense in (None, False):  # 5 tokens: the dense form, or the host callback

                def call(inputs, parameters, j_options=j_options, tied=tied, dense=dense):
                    return fitted_attention(
                        *inputs, **parameters, tied=tied, dense=dense, **j_options
                    )

                def loss(inputs, parameters, call=call, g=grad):
                    return jnp.sum(jnp.asarray(g) * call(inputs, parameters))

                traced = str(jax.make_jaxpr(call)(inputs, arrays))
                assert ("pure_callback" in traced) == (dense is False)
                _close(call(inputs, arrays), la.linear_attention(q, k, v, fm, **options))
                for differentiate in (jax.grad(loss, (0, 1)), jax.jit(jax.grad(loss, (0, 1)))):
                    d_inputs, d_parameters = differentiate(inputs, arrays)
                    for got, want in zip(d_inputs, expected_inputs, strict=True):
                        _close(got, want)
                    assert sorted(d_parameters) == sorted(expected)
                    for name, got in d_parameters.items():
                        np.testing.assert_allclose(got, expected[name], rtol=1e-9, atol=1e-12)
            if "exact_key_mask" in options:  # the g = 0 head chose the exact parts
                assert expected["far_weight"][0] == 0.0 and expected["far_weight"][1] != 0.0
        # Errors are raised before any callback (JAX would wrap them), under jit too.
        q, k, v = (jnp.asarray(a) for a in _inputs(rng, 4, 2, length=5))
        w = jnp.asarray(rng.normal(size=(3, D, N // 2)))
        with pytest.raises(ValueError, match="far_weight must be non-negative"):
            fitted_attention(q, k, v, w[:1], tied=True, far_weight=-1.0)
        for run in (fitted_attention, jax.jit(fitted_attention, static_argnames="tied")):
            with pytest.raises(ValueError, match="query_weight has 3 heads cannot serve"):
                run(q, k, v, w, tied=True)
        # Under jit a traced g < 0 cannot be refused first: the dense form gives its head
        # NaN (not the g = 0 answer), the other heads what a valid g gives them.
        q, k, v = (jnp.asarray(a) for a in _inputs(rng, 2, 2, length=5))

        def jitted_call(g, q=q, k=k, v=v, w=w[:2]):
            return fitted_attention(q, k, v, w, tied=True, far_weight=g, **HYBRID)

        jitted = jax.jit(jitted_call)
        got = np.asarray(jitted(jnp.array([-1.0, 0.5])))
        want = np.asarray(jitted(jnp.array([0.0, 0.5])))
        assert np.isnan(got[:, 0]).all() and np.isfinite(want[:, 0]).all()
        np.testing.assert_array_equal(got[:, 1], want[:, 1])


# -- 3b. short calls as matrix products (torch CPU tensors, no gradient) ---------------


def test_short_torch_calls_run_dense_and_match_the_reference(monkeypatch) -> None:
    """The ``dense-hybrid`` executor (torch's fused attention for the near keys, the
    features' product for the far keys): every map layout, causal and bidirectional,
    window, sinks and exact keys, NaN padding, a batch row without keys, and batch rows
    in blocks; the same function on NumPy arrays (the array API's softmax, no fused
    kernel) too."""
    torch = pytest.importorskip("torch")
    from linattn.hybrid import dense
    from linattn.hybrid.build import ExactParts

    fused_calls = []

    def fused(*args):  # type: ignore[no-untyped-def]
        out = fused_softmax_lse(*args)
        fused_calls.append(out is not None)
        return out

    from linattn._xp import fused_softmax_lse

    monkeypatch.setattr(dense, "fused_softmax_lse", fused)
    rng = np.random.default_rng(11)
    for name, fm, q, k, v in _cases(rng):
        q, k, v = (np.concatenate([a, rng.normal(size=a.shape)]) for a in (q, k, v))
        # values as wide as the keys, as torch's fused kernel takes them
        v = np.concatenate([v, rng.normal(size=(*v.shape[:-1], D - DV))], axis=-1)
        key_mask = np.ones((2, 1, 9), dtype=bool)
        key_mask[0] = False  # batch row 0 sees no key: zeros
        key_mask[1, :, 6:] = key_mask[1, :, 0] = False  # query 8: far keys only
        k[1, :, 7], v[1, :, 8] = np.nan, np.inf  # padding holds anything
        for causal in (True, False):
            for options in _options(causal):
                expected = _reference(q, k, v, fm, causal=causal, key_mask=key_mask, **options)
                assert np.all(expected[0] == 0) and np.all(np.isfinite(expected)), name
                t_options = {
                    "causal": causal, "key_mask": torch.tensor(key_mask),
                    **{n: torch.tensor(x) if isinstance(x, np.ndarray) else x
                       for n, x in options.items()},
                }  # fmt: skip
                tensors = [torch.tensor(a) for a in (q, k, v)]
                if not options:  # no exact parts: not this executor's
                    assert la.plan_attention(*tensors, fm, **t_options).executor != (
                        "dense-hybrid"
                    )
                    continue
                assert la.plan_attention(*tensors, fm, **t_options).executor == "dense-hybrid"
                _close(la.linear_attention(*tensors, fm, **t_options).numpy(), expected)
                for blocks in (dense.BLOCK_ELEMENTS, 1):  # (1: one batch row a block)
                    monkeypatch.setattr(dense, "BLOCK_ELEMENTS", blocks)
                    got = la.linear_attention(*tensors, fm, **t_options)
                    _close(got.numpy(), expected)
                if k.shape[1] != q.shape[1]:
                    continue  # (the executor groups the heads first)
                got = dense.dense_attention(
                    np, q, *(np.where(key_mask[..., None], a, 0.0) for a in (k, v)), key_mask,
                    ExactParts(options["window"], options["sink_keys"],
                               options.get("exact_key_mask")),
                    fm, causal=causal, scale=fm.scale,
                )  # fmt: skip
                _close(got, expected)
    assert any(fused_calls) and not all(fused_calls)  # torch's kernel, and NumPy's path
    # float32: float32 rounding
    fm = _map(rng, 2, 2, [0.0, 0.6])
    q, k, v = _inputs(rng, 2, 2)
    t32 = [torch.tensor(a, dtype=torch.float32) for a in (q, k, v)]
    out = la.linear_attention(*t32, fm, **HYBRID)
    assert out.dtype == torch.float32
    _close(out.numpy(), _reference(q, k, v, fm, causal=False, **HYBRID), 1e-5)


def test_the_dense_form_is_chosen_for_short_calls() -> None:
    """Where ``dense-hybrid`` does not serve, the plan says why (and the compiled kernels
    or the portable parts run, as before)."""
    torch = pytest.importorskip("torch")
    from linattn.hybrid import dense

    rng = np.random.default_rng(12)
    fm = _map(rng, 2, 2, [0.5, 0.6])
    q, k, v = (torch.tensor(a) for a in _inputs(rng, 2, 2))

    def why(*arrays, feature_map=fm, **options):  # type: ignore[no-untyped-def]
        plan = la.plan_attention(*arrays, feature_map, **{**HYBRID, **options})
        return None if plan.executor == "dense-hybrid" else dict(plan.rejected)["dense-hybrid"]

    assert why(q, k, v) is None
    assert why(q, k, v, causal=True) is None
    assert why(q.requires_grad_(), k, v) is None  # autograd differentiates it
    q = q.detach()
    assert why(q, k, v, backend="array_api") == "backend='array_api'"
    assert why(q, k, v, feature_map=la.FeatureMap(D, N, seed=0)).startswith("no fitted map")
    assert why(q, k, v, causal=True, return_state=True).startswith("a state is asked")
    assert why(*(x.numpy() for x in (q, k, v))) == "not torch CPU tensors or JAX arrays"
    assert why(q.half(), k.half(), v.half()) == "q is float16, not float32 or float64"
    top = dense.MAX_LENGTH["torch"]
    long = [torch.zeros(1, 2, top + 1, D) for _ in range(3)]
    assert why(*long) == f"not self-attention of at most {top} tokens"
    assert why(*(x[..., :top, :] for x in long)) is None
    limit = dense.CAUSAL_MAX_LENGTH["torch"]
    assert why(*(x[..., :limit, :] for x in long), causal=True) is None
    assert why(*(x[..., : limit + 1, :] for x in long), causal=True) == (
        f"not causal self-attention of at most {limit} tokens"
    )
    with pytest.raises(ValueError, match="same length"):  # (a call no path takes)
        why(q, k[..., :5, :], v[..., :5, :], causal=True)
    top = dense.CAUSAL_MAX_LENGTH["torch-grad"]  # with a gradient: its own limits
    grad = [torch.zeros(1, 2, top + 1, D, requires_grad=True) for _ in range(3)]
    assert why(*(x[..., :top, :] for x in grad), causal=True) is None
    assert why(*grad, causal=True) == (
        f"not causal self-attention of at most {top} tokens with a gradient"
    )


def test_the_exact_parts_alone_run_dense_on_short_torch_calls() -> None:
    """No feature map (window, sinks and exact keys only): torch CPU tensors without a
    gradient take the dense form (torch's attention over the near keys) up to its own
    measured lengths, with the same output as the NumPy path (the compiled kernels);
    with a gradient, longer, or on JAX, the plan says why not."""
    torch = pytest.importorskip("torch")
    from linattn.hybrid import dense

    rng = np.random.default_rng(14)
    q, k, v = (rng.normal(size=(2, 3, 12, D)) for _ in range(3))
    key_mask = np.ones((2, 1, 12), dtype=bool)
    key_mask[1, :, 9:] = False
    k[1, :, 10] = np.nan  # padding holds anything
    exact = np.zeros((2, 1, 12), dtype=bool)
    exact[:, :, 7] = True
    for causal in (False, True):
        options = {"window": 2, "sink_keys": 1, "causal": causal, "key_mask": key_mask}
        if not causal:
            options["exact_key_mask"] = exact
        expected = la.linear_attention(q, k, v, None, **options)
        tensors = [torch.tensor(a) for a in (q, k, v)]
        t_options = {n: torch.tensor(x) if isinstance(x, np.ndarray) else x
                     for n, x in options.items()}  # fmt: skip
        plan = la.plan_attention(*tensors, None, **t_options)
        assert plan.executor == "dense-hybrid"
        _close(la.linear_attention(*tensors, None, **t_options).numpy(), expected)
        grad = [x.clone().requires_grad_() for x in tensors]
        plan = la.plan_attention(*grad, None, **t_options)
        assert dict(plan.rejected)["dense-hybrid"].startswith("no feature map with a gradient")
        top = dense.max_length(causal, "torch-near")
        long = [torch.zeros(1, 2, top + 1, D) for _ in range(3)]
        plan = la.plan_attention(*long, None, window=2, causal=causal)
        assert dict(plan.rejected)["dense-hybrid"].endswith(f"at most {top} tokens")
        short = [x[..., :top, :] for x in long]
        assert la.plan_attention(*short, None, window=2, causal=causal).executor == (
            "dense-hybrid"
        )


@pytest.mark.needs("jax")
def test_the_dense_form_serves_short_jax_calls() -> None:
    """JAX arrays on the CPU take the dense form up to their own measured lengths (its
    outputs and gradients: ``test_jax_jit_and_grad``), longer ones the portable parts."""
    jax = pytest.importorskip("jax")
    from linattn.hybrid import dense

    if jax.default_backend() != "cpu":
        pytest.skip("the JAX limits are measured on the CPU")
    rng = np.random.default_rng(13)
    fm = _map(rng, 2, 2, [0.5, 0.6])
    for causal in (False, True):
        top = dense.max_length(causal, "jax")
        x = jax.numpy.zeros((1, 2, top + 1, D))
        plan = la.plan_attention(x, x, x, fm, causal=causal, **HYBRID)
        kind = "causal " if causal else ""
        assert dict(plan.rejected)["dense-hybrid"] == (
            f"not {kind}self-attention of at most {top} tokens"
        )
        assert plan.executor == "hybrid-parts"
        short = x[..., :top, :]
        assert la.plan_attention(short, short, short, fm, causal=causal, **HYBRID).executor == (
            "dense-hybrid"
        )


def test_torch_compile_traces_a_fitted_map_in_one_graph() -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    fm = _map(rng, 2, 2, np.array([0.5, 2.0]))  # log g traced with the features
    q, k, v = (torch.tensor(a) for a in _inputs(rng, 2, 2))
    for options in ({"causal": True}, {"window": 3, "sink_keys": 1}):

        def call(q, k, v, options=options):  # type: ignore[no-untyped-def]
            return la.linear_attention(q, k, v, fm, **options)

        assert torch._dynamo.explain(call)(q, k, v).graph_break_count == 0
        compiled = torch.compile(call, fullgraph=True, backend="aot_eager")
        _close(compiled(q, k, v).numpy(), call(q, k, v).numpy(), 1e-12)
    # The portable parts with a g = 0 head (its far keys left out, not read on the host)
    fm = _map(rng, 2, 2, np.array([0.0, 2.0]))

    def portable(q, k, v):  # type: ignore[no-untyped-def]
        return la.linear_attention(q, k, v, fm, backend="array_api", window=3, sink_keys=1)

    assert torch._dynamo.explain(portable)(q, k, v).graph_break_count == 0
    compiled = torch.compile(portable, fullgraph=True, backend="aot_eager")
    _close(compiled(q, k, v).numpy(), portable(q, k, v).numpy(), 1e-12)
