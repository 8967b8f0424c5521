"""The torch layers: FastAttention's buffers and redraw schedule, the MultiheadAttention
drop-in, torch.compile, autocast and gradients."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import linattn as la  # noqa: E402
import linattn.torch as lt  # noqa: E402
from linattn.torch import FastAttention, MultiheadAttention  # noqa: E402

B, H, L, D = 2, 3, 20, 8


#: Dynamo reads ``.grad`` of the non-leaf tensors it is handed (torch's own warning).
def UNDER_DYNAMO(test):  # type: ignore[no-untyped-def]
    return pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not")(test)


def _qkv(dtype: torch.dtype = torch.float32, requires_grad: bool = False) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [
        (0.5 * torch.randn(B, H, L, D, generator=generator, dtype=dtype)).requires_grad_(
            requires_grad
        )
        for _ in range(3)
    ]


@pytest.mark.parametrize("causal", [False, True])
def test_fast_attention_is_linear_attention_with_the_seed_map(causal: bool) -> None:
    q, k, v = _qkv()
    keep = torch.rand(B, L, generator=torch.Generator().manual_seed(1)) > 0.2
    layer = FastAttention(D, 32, causal=causal, seed=5)
    kind = "hyperbolic" if causal else "hyperbolic_oprf"
    fm = la.FeatureMap(D, 32, kind=kind, seed=5, rebalance=not causal)
    assert layer.feature_map.fingerprint == fm.fingerprint
    expected = la.linear_attention(q, k, v, fm, causal=causal, key_mask=keep[:, None, :])
    torch.testing.assert_close(layer(q, k, v, keep), expected, rtol=0, atol=0)


def test_grouped_query_heads() -> None:
    q, k, v = _qkv()
    k, v = k[:, :1], v[:, :1]  # one key/value head for three query heads broadcasts
    layer = FastAttention(D, 32, causal=True)
    expected = layer(q, k.expand(-1, H, -1, -1), v.expand(-1, H, -1, -1))
    torch.testing.assert_close(layer(q, k, v), expected)
    q6 = torch.cat([q, q], dim=1)  # six query heads, three key/value heads: groups of two
    expected = layer(q6, k.repeat(1, 6, 1, 1), v.repeat(1, 6, 1, 1))
    torch.testing.assert_close(layer(q6, k.repeat(1, 3, 1, 1), v.repeat(1, 3, 1, 1)), expected)


def test_buffers_travel_in_the_state_dict() -> None:
    q, k, v = _qkv()
    source = FastAttention(D, 32, causal=True, seed=1, redraw_interval=2)
    source.redraw_projection()
    target = FastAttention(D, 32, causal=True, seed=99)
    assert sorted(source.state_dict()) == ["draws", "forward_calls", "projection"]
    target.load_state_dict(source.state_dict())
    assert int(target.draws) == 1
    torch.testing.assert_close(target(q, k, v), source(q, k, v), rtol=0, atol=0)
    other = FastAttention(D, 32, causal=True, seed=99)
    assert not torch.equal(other(q, k, v), source(q, k, v))


def test_redraw_schedule_counts_training_calls_with_gradients() -> None:
    q, k, v = _qkv(requires_grad=True)
    layer = FastAttention(D, 16, causal=True, seed=3, redraw_interval=3)
    first = layer.projection.clone()
    for _ in range(2):
        layer(q, k, v)
    assert torch.equal(layer.projection, first)
    with torch.no_grad():
        layer(q, k, v)  # no gradients: not a training step
    layer.eval()
    layer(q, k, v)  # eval never redraws
    layer.train()
    layer(q, k, v)  # the third counted call
    assert (int(layer.forward_calls), int(layer.draws)) == (3, 1)
    fresh = la.gaussian_projection(8, D, seed=3 + 1)
    torch.testing.assert_close(layer.projection, torch.from_numpy(fresh), rtol=0, atol=0)


def test_every_replica_draws_the_same_projections() -> None:
    """Two ranks' layers, same seed and steps: the same matrices, no communication."""
    q, k, v = _qkv(requires_grad=True)
    ranks = [FastAttention(D, 16, causal=True, redraw_interval=2) for _ in range(2)]
    for layer in ranks:
        for _ in range(5):
            layer(q, k, v)
    assert int(ranks[0].draws) == 2
    assert torch.equal(ranks[0].projection, ranks[1].projection)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_recomputation_does_not_count(use_reentrant: bool) -> None:
    from torch.utils.checkpoint import checkpoint

    q, k, v = _qkv(requires_grad=True)
    layer = FastAttention(D, 16, causal=True, redraw_interval=1)
    q2 = q * 1.0  # a non-leaf, so the reentrant checkpoint's forward records a graph
    out = checkpoint(layer, q2, k, v, use_reentrant=use_reentrant)
    draws = int(layer.draws)
    out.sum().backward()  # recomputes layer's forward inside the backward pass
    assert int(layer.draws) == draws
    # The non-reentrant forward runs with gradients (counted once); the reentrant one
    # runs under no_grad (not counted, as any call without gradients).
    assert draws == (0 if use_reentrant else 1)


def test_public_redraw_and_the_map_follow_the_buffer() -> None:
    layer = FastAttention(D, 16, kind="positive", causal=True, seed=7)
    before = layer.feature_map.fingerprint
    layer.redraw_projection()
    assert layer.feature_map.fingerprint == la.FeatureMap(D, 16, seed=8).fingerprint != before
    doubled = {**layer.state_dict(), "projection": 2 * layer.projection}
    layer.load_state_dict(doubled)
    np.testing.assert_array_equal(layer._feature_map.projection, doubled["projection"].numpy())


@UNDER_DYNAMO
def test_compiles_in_one_graph_and_redraws_without_recompiling() -> None:
    from torch._dynamo.utils import counters

    q, k, v = _qkv(requires_grad=True)
    layer = FastAttention(D, 16, causal=True, redraw_interval=1)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(layer.eval())(q, k, v)
    layer.train()
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), [
        str(r.reason) for r in explained.break_reasons
    ]
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(layer, backend="aot_eager")
    previous = None
    for _ in range(4):
        out = compiled(q, k, v)
        out.sum().backward()
        layer.eval()
        torch.testing.assert_close(out, layer(q, k, v))  # the map after this call's redraw
        layer.train()
        assert previous is None or not torch.equal(out, previous)
        previous = out
    assert int(layer.draws) == 4
    # Four redraws, at most one recompilation (dynamo 2.13 recompiles once after the
    # first call, reporting "runtime guards failed even though they passed"): the
    # projection is no guarded constant.
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])


def test_autocast_bfloat16_keeps_float32_state() -> None:
    q, k, v = (x.to(torch.bfloat16) for x in _qkv())
    layer = FastAttention(D, 32, causal=True)
    expected = la.linear_attention(
        *(x.float() for x in (q, k, v)), layer.feature_map, causal=True
    ).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, state = layer(q, k, v, return_state=True)
    assert out.dtype == torch.bfloat16 and state.kv.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_gradients_match_finite_differences() -> None:
    q, k, v = (x[:1, :1, :6] for x in _qkv(torch.float64))
    layer = FastAttention(D, 8, causal=True, kind="positive", backend="array_api")
    inputs = [x.detach().requires_grad_() for x in (q, k, v)]
    assert torch.autograd.gradcheck(lambda *a: layer(*a), inputs)


def test_decoding_state_continues_the_sequence() -> None:
    q, k, v = _qkv()
    layer = FastAttention(D, 16, causal=True).eval()
    whole = layer(q, k, v)
    first, state = layer(q[..., :12, :], k[..., :12, :], v[..., :12, :], return_state=True)
    rest = layer(q[..., 12:, :], k[..., 12:, :], v[..., 12:, :], state=state)
    torch.testing.assert_close(torch.cat([first, rest], dim=-2), whole)


def test_importing_linattn_does_not_import_torch() -> None:
    code = "import sys, linattn; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.strip() == "False", done.stderr


# -- MultiheadAttention ---------------------------------------------------------------


@pytest.fixture
def exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """Exact softmax in place of the features: the layer's wiring against torch's, exactly."""

    def softmax(q, k, v, feature_map, *, causal, key_mask, **_):  # type: ignore[no-untyped-def]
        return la.softmax_attention(q, k, v, causal=causal, key_mask=key_mask)

    monkeypatch.setattr(lt.layers, "linear_attention", softmax)  # (what the layers call)


@pytest.mark.usefixtures("exact")
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("dims", [{}, {"kdim": 6, "vdim": 10}])
def test_multihead_attention_matches_torch(batch_first: bool, dims: dict[str, int]) -> None:
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(12, 3, batch_first=batch_first, **dims)
    fast = MultiheadAttention.from_torch(mha, num_features=16)
    shape = (2, 9) if batch_first else (9, 2)
    x = torch.randn(*shape, 12)
    key, value = (
        torch.randn(*shape, dims.get("kdim", 12)),
        torch.randn(*shape, dims.get("vdim", 12)),
    )
    padding = torch.zeros(2, 9, dtype=torch.bool)
    padding[1, -4:] = True
    expected, _ = mha(x, key, value, key_padding_mask=padding)
    out, weights = fast(x, key, value, key_padding_mask=padding)
    assert weights is None
    torch.testing.assert_close(out, expected)
    additive = torch.zeros(2, 9).masked_fill(padding, -torch.inf)
    torch.testing.assert_close(fast(x, key, value, key_padding_mask=additive)[0], expected)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(9)
    expected, _ = mha(x, key, value, attn_mask=causal)
    torch.testing.assert_close(fast(x, key, value, attn_mask=causal)[0], expected)
    torch.testing.assert_close(fast(x, key, value, attn_mask=causal.isinf())[0], expected)


@pytest.mark.usefixtures("exact")
def test_unbatched_input() -> None:
    mha = torch.nn.MultiheadAttention(8, 2, bias=False)
    fast = MultiheadAttention.from_torch(mha)
    x = torch.randn(5, 8)
    torch.testing.assert_close(fast(x, x, x)[0], mha(x, x, x)[0])


def test_multihead_attention_estimates_softmax() -> None:
    """Random features: the module's output is linear attention of the same projections."""
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(16, 2, batch_first=True)
    fast = MultiheadAttention.from_torch(mha, num_features=32, causal=True)
    x = torch.randn(2, 7, 16)
    q, k, v = fast._in_projection(x, x, x)
    attention = la.linear_attention(q, k, v, fast.attention.feature_map, causal=True)
    expected = fast.out_proj(attention.transpose(1, 2).reshape(2, 7, 16))
    torch.testing.assert_close(fast(x, x, x)[0], expected, rtol=0, atol=0)
    assert "attention.projection" in fast.state_dict()


def test_refusals() -> None:
    fast = MultiheadAttention(8, 2)
    x = torch.randn(4, 1, 8)
    with pytest.raises(ValueError, match="need_weights must be False"):
        fast(x, x, x, need_weights=True)
    with pytest.raises(ValueError, match="attn_mask must be the causal mask of shape"):
        fast(x, x, x, attn_mask=torch.zeros(4, 4, dtype=torch.bool).triu(2))
    with pytest.raises(ValueError, match="key_padding_mask must be boolean"):
        fast(x, x, x, key_padding_mask=torch.full((1, 4), -1.0))
    with pytest.raises(ValueError, match=r"dropout must be 0\.0"):
        MultiheadAttention.from_torch(torch.nn.MultiheadAttention(8, 2, dropout=0.1))
    dropped = MultiheadAttention.from_torch(
        torch.nn.MultiheadAttention(8, 2, dropout=0.1), dropout=0.0
    )
    assert dropped.dropout == 0.0
    with pytest.raises(ValueError, match="add_bias_kv must be False"):
        MultiheadAttention(8, 2, add_bias_kv=True)
    with pytest.raises(TypeError, match=r"mha must be a torch\.nn\.MultiheadAttention"):
        MultiheadAttention.from_torch(torch.nn.Linear(2, 2))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="redraw_interval must be a positive integer"):
        FastAttention(8, 16, redraw_interval=0)


@UNDER_DYNAMO
def test_multihead_attention_compiles_and_trains() -> None:
    torch.manual_seed(0)
    fast = MultiheadAttention(16, 2, batch_first=True, causal=True, num_features=16)
    x = torch.randn(2, 12, 16, requires_grad=True)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(fast)(x, x, x)
    assert explained.graph_break_count == 0, [str(r.reason) for r in explained.break_reasons]
    scheduled = MultiheadAttention(16, 2, batch_first=True, causal=True, redraw_interval=5)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(scheduled)(x, x, x)
    assert explained.graph_break_count == 2  # the schedule's host hook, documented
    compiled = torch.compile(fast, backend="aot_eager")
    compiled(x, x, x)[0].sum().backward()
    assert fast.in_proj_weight.grad is not None and x.grad is not None


def _fitted_map(rng: np.random.Generator, far_weight: object) -> la.FeatureMap:
    """Per-head query parameters (H = 4) and key parameters for 2 key heads."""
    return la.FeatureMap.fitted(
        rng.normal(size=(4, D, 3)), rng.normal(size=(4, 3)),
        key_weight=rng.normal(size=(2, D, 3)), key_bias=rng.normal(size=(2, 3)),
        far_weight=far_weight,
    )  # fmt: skip


def test_a_fitted_map_is_buffers_that_round_trip() -> None:
    """A fitted map (grouped-query heads, window + sink) gives linear_attention's output;
    its parameters are buffers: a layer built with other values and loaded from the
    state_dict gives the same output (a differing far weight alone would change it)."""
    rng = np.random.default_rng(0)
    fm = _fitted_map(rng, [0.3, 1.2])
    options = {"causal": True, "window": 3, "sink_keys": 1}
    layer = FastAttention(D, feature_map=fm, **options)
    assert sorted(layer.state_dict()) == sorted(
        ["draws", "forward_calls", "query_weight", "query_bias", "key_weight", "key_bias",
         "far_weight"]
    )  # fmt: skip
    q = torch.randn(B, 4, L, D, dtype=torch.float64)
    k, v = (
        torch.randn(B, 2, L, D, dtype=torch.float64),
        torch.randn(B, 2, L, 5, dtype=torch.float64),
    )
    expected = la.linear_attention(q, k, v, fm, **options)
    torch.testing.assert_close(layer(q, k, v), expected, rtol=1e-12, atol=1e-12)
    other = FastAttention(D, feature_map=_fitted_map(rng, [1.0, 1.0]), **options)
    assert not torch.allclose(other(q, k, v), expected)
    other.load_state_dict(layer.state_dict())
    torch.testing.assert_close(other(q, k, v), expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(other.feature_map.parameters.far_weight, [0.3, 1.2])
    tied = la.FeatureMap.fitted(rng.normal(size=(D, 3)), tied=True)
    mha = MultiheadAttention(4 * D, 4, feature_map=tied, window=2, batch_first=True)
    assert "attention.key_weight" not in mha.state_dict()
    assert mha(*[torch.randn(B, 5, 4 * D)] * 3)[0].shape == (B, 5, 4 * D)
    with pytest.raises(TypeError, match=r"feature_map must be a fitted linattn\.FeatureMap"):
        FastAttention(D, feature_map=la.FeatureMap(D, 16))
    with pytest.raises(ValueError, match="feature_map has head_dim 8; the layer's head_dim is 4"):
        FastAttention(4, feature_map=fm)
    with pytest.raises(ValueError, match="num_features is 16; feature_map has 6"):
        FastAttention(D, 16, feature_map=fm)
    with pytest.raises(ValueError, match="redraw_interval must be None with a fitted"):
        FastAttention(D, feature_map=fm, redraw_interval=2)


def test_exact_heads_attend_exactly_and_refuse_to_decode() -> None:
    """``exact_heads=``: the listed query heads are softmax attention (grouped-query: key
    head ``h // 2``), the others the layer's hybrid, with a padded key mask; training the
    map keeps them; decoding and bad heads are refused by name."""
    rng = np.random.default_rng(4)
    fm = _fitted_map(rng, [0.3, 1.2])
    options = {"window": 3, "sink_keys": 1}
    q = torch.randn(B, 4, L, D, dtype=torch.float64)
    k, v = (torch.randn(B, 2, L, D, dtype=torch.float64) for _ in range(2))
    key_mask = torch.ones(B, L, dtype=torch.bool)
    key_mask[1, -4:] = False
    hybrid = la.linear_attention(q, k, v, fm, key_mask=key_mask[:, None], **options)
    for train_map in (False, True):
        layer = FastAttention(
            D, feature_map=fm, exact_heads=[3, 1], train_map=train_map, **options
        )
        assert layer.exact_heads == (1, 3) and "exact_heads=(1, 3)" in repr(layer)
        out = layer(q, k, v, key_mask)
        torch.testing.assert_close(out[:, [0, 2]], hybrid[:, [0, 2]], rtol=1e-12, atol=1e-12)
        for head in (1, 3):
            expected = la.softmax_attention(
                q[:, head], k[:, head // 2], v[:, head // 2], key_mask=key_mask,
                scale=fm.scale,
            )  # fmt: skip
            torch.testing.assert_close(out[:, head], expected, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"exact heads \(1, 3\) cannot continue or return a"):
        layer(q, k, v, return_state=True)
    with pytest.raises(ValueError, match=r"heads must be query heads, integers in \[0, 4\)"):
        FastAttention(D, feature_map=fm, exact_heads=[4], **options)(q, k, v)
    with pytest.raises(ValueError, match="exact_heads must not repeat a head"):
        FastAttention(D, feature_map=fm, exact_heads=[1, 1])
    with pytest.raises(TypeError, match="exact_heads must be a sequence"):
        FastAttention(D, feature_map=fm, exact_heads=1)
    mha = MultiheadAttention(4 * D, 4, feature_map=fm, exact_heads=[0], batch_first=True)
    assert mha.attention.exact_heads == (0,)


def test_train_map_trains_the_fitted_parameters() -> None:
    """``train_map=True``: the fitted parameters are nn.Parameters under the buffers'
    names; with gradients the layer runs ``fitted_attention`` (the same output as the
    buffer layer, gradients in every parameter), Adam steps lower the error to exact
    softmax attention, the no-gradient path follows the stepped values, and the
    state_dict loads into a buffer layer; a negative far weight acts as 0."""
    rng = np.random.default_rng(1)
    fm = _fitted_map(rng, [0.3, 1.2])
    options = {"causal": False, "window": 3, "sink_keys": 1}
    frozen = FastAttention(D, feature_map=fm, **options)
    layer = FastAttention(D, feature_map=fm, train_map=True, **options)
    names = ["query_weight", "query_bias", "key_weight", "key_bias", "far_weight"]
    assert sorted(n for n, _ in layer.named_parameters()) == sorted(names)
    assert sorted(layer.state_dict()) == sorted(frozen.state_dict())
    q = torch.randn(B, 4, L, D, dtype=torch.float64)
    k, v = (
        torch.randn(B, 2, L, D, dtype=torch.float64),
        torch.randn(B, 2, L, 5, dtype=torch.float64),
    )
    target = la.softmax_attention(q, k, v)
    out = layer(q, k, v)
    torch.testing.assert_close(out, frozen(q, k, v), rtol=1e-12, atol=1e-12)
    optimiser = torch.optim.Adam(layer.parameters(), lr=0.05)
    errors = []
    for _ in range(15):
        loss = (layer(q, k, v) - target).square().mean()
        optimiser.zero_grad()
        loss.backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in layer.parameters())
        optimiser.step()
        errors.append(float(loss.detach()))
    assert errors[-1] < 0.9 * errors[0], errors
    with torch.no_grad():  # the map made from the stepped values
        stepped = layer(q, k, v)
    torch.testing.assert_close(stepped, layer(q, k, v).detach(), rtol=1e-12, atol=1e-12)
    assert not torch.allclose(stepped, frozen(q, k, v))
    frozen.load_state_dict(layer.state_dict())
    torch.testing.assert_close(frozen(q, k, v), stepped, rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        layer.far_weight.copy_(torch.tensor([-0.5, 1.0], dtype=torch.float64))
        negative = layer(q, k, v)
        layer.far_weight.copy_(torch.tensor([0.0, 1.0], dtype=torch.float64))
        torch.testing.assert_close(negative, layer(q, k, v), rtol=1e-12, atol=1e-12)
    layer.zero_grad()
    layer(q, k, v).sum().backward()
    assert layer.far_weight.grad[0] == 0.0 and layer.far_weight.grad[1] != 0.0
    with pytest.raises(ValueError, match="train_map=True needs a fitted map"):
        FastAttention(D, 16, train_map=True)


def test_multihead_attention_trains_a_fitted_map() -> None:
    """MultiheadAttention hands ``feature_map=`` and ``train_map=True`` to its
    FastAttention: the map's parameters train with the projections (each gets a
    gradient) and the output is the buffer layer's."""
    rng = np.random.default_rng(2)
    fm = la.FeatureMap.fitted(
        rng.normal(size=(2, D, 3)), rng.normal(size=(2, 3)), far_weight=[0.5, 2.0], tied=True
    )
    mha = torch.nn.MultiheadAttention(2 * D, 2, batch_first=True)
    options = {"feature_map": fm, "window": 3, "sink_keys": 1}
    frozen = MultiheadAttention.from_torch(mha, **options)
    fast = MultiheadAttention.from_torch(mha, train_map=True, **options)
    names = {name for name, _ in fast.named_parameters()}
    assert {"attention.query_weight", "attention.query_bias", "attention.far_weight"} <= names
    x = torch.randn(B, L, 2 * D)
    out, _ = fast(x, x, x)
    torch.testing.assert_close(out, frozen(x, x, x)[0])
    out.square().sum().backward()
    for name, parameter in fast.named_parameters():
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name
