"""attn_implementation="linattn" on small random BERT and GPT-2 models (no download)."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import linattn as la  # noqa: E402
from linattn.integrations.transformers import (  # noqa: E402
    LinearAttentionCache,
    attention_forward,
    key_mask_from,
    register,
    special_keys,
    state_of,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
L = 12
HAS_WINDOW = "window" in inspect.signature(la.linear_attention).parameters


def _gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=50, n_positions=64,
        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config).eval()


def _bert() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
        vocab_size=50, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.BertModel(config, add_pooling_layer=False).eval()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 50, (2, L), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, L, dtype=torch.long)
    mask[1, -4:] = 0  # right padding in the second sequence
    return ids, mask


def _outputs(
    model: torch.nn.Module, implementation: str, num_features: int | None = 256, **options
):
    register(num_features=num_features, **options)
    model.set_attn_implementation(implementation)
    ids, mask = _batch()
    with torch.no_grad():
        out = model(ids, attention_mask=mask)
    result = out.logits if hasattr(out, "logits") else out.last_hidden_state
    return result[mask.bool()]  # padded positions are anyone's


@pytest.mark.parametrize("make", [_gpt2, _bert])
def test_random_features_estimate_eager(make) -> None:  # type: ignore[no-untyped-def]
    """The error shrinks like 1/sqrt(m): 16x the features, about a quarter of the error."""
    model = make()
    exact = _outputs(model, "eager")
    errors = [
        float((_outputs(model, "linattn", m) - exact).pow(2).mean().sqrt()) for m in (64, 1024)
    ]
    ratio = errors[1] / errors[0]
    # Quarter expected; the spread of a ratio of two estimates at these sizes stays in 2x.
    assert 0.125 < ratio < 0.5, errors
    assert errors[1] < 0.1 * float(exact.pow(2).mean().sqrt())


@pytest.mark.skipif(not HAS_WINDOW, reason="needs linear_attention(window=) (the hybrid)")
@pytest.mark.parametrize(
    ("make", "num_features"), [(_gpt2, 16), (_bert, 16), (_bert, None)]
)  # fmt: skip
def test_a_window_covering_the_sequence_is_eager(make, num_features) -> None:  # type: ignore[no-untyped-def]
    model = make()
    exact = _outputs(model, "eager")
    out = _outputs(model, "linattn", num_features, window=4 * L)
    torch.testing.assert_close(out, exact, rtol=1e-5, atol=1e-6)


# -- exact keys and no feature map: against the attention computed directly -----------


def _first_and_last(mask: np.ndarray) -> np.ndarray:
    """NumPy's own ``(B, L)`` first and last real token of each row."""
    exact = np.zeros(mask.shape, dtype=bool)
    for row, keep in enumerate(mask):
        real = np.flatnonzero(keep)
        exact[row, [real[0], real[-1]]] = True
    return exact


def _first(mask: torch.Tensor) -> torch.Tensor:
    """A user's rule: position 0 only."""
    return (torch.arange(mask.shape[-1]) == 0) & mask


def _reference(options: dict, exact: np.ndarray):  # type: ignore[no-untyped-def]
    """An attention implementation computing each layer's attention outside the integration:
    a dense masked softmax without a feature map, ``linear_attention`` with the layer's map
    (the one the linattn run drew) with one."""
    key_mask = torch.from_numpy(_batch()[1].numpy().astype(bool))[:, None]  # (B, 1, L)
    exact_mask = torch.from_numpy(exact)[:, None]

    def attention(module, q, k, v, attention_mask, scaling=None, **kwargs):  # type: ignore[no-untyped-def]
        if options["num_features"] is None:
            position = torch.arange(L)
            allowed = (position[:, None] - position[None, :]).abs() < options["window"]
            allowed = allowed | (position < options["sink_keys"]) | exact_mask[..., None, :]
            allowed = allowed & key_mask[..., None, :]  # (B, 1, L, L)
            scores = (q @ k.transpose(-1, -2) * scaling).masked_fill(~allowed, -torch.inf)
            out = scores.softmax(-1) @ v
        else:
            feature_map = state_of(module).drawn
            out = la.linear_attention(
                q, k, v, feature_map, key_mask=key_mask, window=options["window"],
                sink_keys=options["sink_keys"], exact_key_mask=exact_mask,
            )  # fmt: skip
        return out.transpose(1, 2).contiguous(), None

    return attention


@pytest.mark.skipif(not HAS_WINDOW, reason="needs linear_attention(window=) (the hybrid)")
@pytest.mark.parametrize(
    ("num_features", "exact_keys", "through"),
    [(None, "special", "register"), (16, "special", "config"), (None, _first, "config")],
)
def test_exact_keys_and_no_feature_map_equal_the_direct_call(
    num_features: int | None, exact_keys: object, through: str
) -> None:
    options = {"num_features": num_features, "window": 3, "sink_keys": 1}
    model = _bert()
    if through == "config":
        model.config.linattn = {**options, "exact_keys": exact_keys}
        out = _outputs(model, "linattn")
    else:
        out = _outputs(model, "linattn", **options, exact_keys=exact_keys)
    mask = _batch()[1].numpy().astype(bool)
    exact = _first_and_last(mask) if exact_keys == "special" else mask & (np.arange(L) == 0)
    transformers.AttentionInterface.register("reference", _reference(options, exact))
    model.config.linattn = None
    model.set_attn_implementation("reference")
    ids, attention_mask = _batch()
    with torch.no_grad():
        expected = model(ids, attention_mask=attention_mask).last_hidden_state[mask]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not HAS_WINDOW, reason="needs linear_attention(window=) (the hybrid)")
def test_exact_keys_trace_without_graph_breaks() -> None:
    """The special keys are tensor operations: torch.compile keeps the call in one graph
    once the module's map is drawn, which a first call does outside the graph, compiled
    or not (a model compiled before any eager call)."""
    backend = la._dispatch.resolve_backend(None)
    if la._dispatch.numpy_kernels_why_not(backend) is not None:  # (the portable path counts)
        pytest.skip("one graph needs the compiled kernels (linattn[numba])")
    register(num_features=16, window=4, sink_keys=1, exact_keys="special")
    module = torch.nn.Module()
    q, k, v = torch.randn(3, 2, 2, L, 8, generator=torch.Generator().manual_seed(0))

    def attention(q, k, v):  # type: ignore[no-untyped-def]
        return attention_forward(module, q, k, v, None, scaling=8**-0.5)[0]

    torch.compiler.reset()
    first = torch.compile(attention, backend="aot_eager")(q, k, v)  # draws the map
    torch.testing.assert_close(first, attention(q, k, v), rtol=0, atol=0)
    explained = torch._dynamo.explain(attention)(q, k, v)
    assert explained.graph_break_count == 0, [str(r.reason) for r in explained.break_reasons]


def test_special_keys_with_left_padding_and_none() -> None:
    mask = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 0, 0, 0], [0, 0, 0, 1, 0]], dtype=torch.bool)
    np.testing.assert_array_equal(
        special_keys(mask).numpy(), [[0, 0, 1, 0, 1], [0, 0, 0, 0, 0], [0, 0, 0, 1, 0]]
    )


@pytest.mark.parametrize(
    "options", [{"num_features": 64}, {"num_features": None, "window": 3, "sink_keys": 1}]
)
def test_generation_with_the_cache_equals_recomputation(options: dict) -> None:
    model = _gpt2()
    register(**options)
    model.set_attn_implementation("linattn")
    prompt = _batch()[0][:1]
    cache = LinearAttentionCache()
    generated = model.generate(
        prompt, max_new_tokens=6, do_sample=False, past_key_values=cache, pad_token_id=0
    )
    if options["num_features"]:
        assert cache.layers[0].state.kv.shape[-2:] == (64, 17)  # m features, d + 1
    tokens = prompt
    with torch.no_grad():
        for _ in range(6):  # no cache: the whole prefix every step
            logits = model(tokens).logits[:, -1]
            tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], dim=1)
    torch.testing.assert_close(generated, tokens)


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=50, max_position_embeddings=64, pad_token_id=0,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.skipif(not HAS_WINDOW, reason="needs linear_attention(window=) (the hybrid)")
@pytest.mark.parametrize("make", [_gpt2, _llama])
@pytest.mark.parametrize(
    "implementation", ["eager", "linattn-features", "linattn-window"], ids=str
)
def test_left_padding_gives_the_unpadded_row(make, implementation: str) -> None:  # type: ignore[no-untyped-def]
    """Sinks are each row's first real tokens: a left-padded row, its prefill and its
    decoding with the cache, equal the row alone (eager attention: the harness)."""
    model = make()
    if implementation != "eager":
        num_features = 16 if implementation == "linattn-features" else None
        register(num_features=num_features, window=3, sink_keys=2)
    model.set_attn_implementation(implementation.split("-")[0])
    pad = 5
    ids = torch.randint(3, 50, (2, L), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, L, dtype=torch.long)
    mask[1, :pad] = 0

    def run(ids: torch.Tensor, mask: torch.Tensor):  # type: ignore[no-untyped-def]
        with torch.no_grad():
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = model(ids, attention_mask=mask, position_ids=positions).logits
            cache = LinearAttentionCache() if implementation != "eager" else None
            out = model.generate(
                ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0,
                past_key_values=cache, output_scores=True, return_dict_in_generate=True,
            )  # fmt: skip
        return logits, torch.stack(out.scores, dim=1), out.sequences[:, ids.shape[1] :]

    logits, scores, tokens = run(ids, mask)
    alone = run(ids[1:, pad:], mask[1:, pad:])
    torch.testing.assert_close(logits[1, pad:], alone[0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(scores[1], alone[1][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tokens[1], alone[2][0])


@pytest.mark.skipif(not HAS_WINDOW, reason="needs linear_attention(window=) (the hybrid)")
def test_left_padding_gives_the_unpadded_row_in_an_encoder() -> None:
    model = _bert()
    register(num_features=None, window=3, sink_keys=2, exact_keys="special")
    model.set_attn_implementation("linattn")
    pad = 5
    ids = torch.randint(3, 50, (2, L), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, L, dtype=torch.long)
    mask[1, :pad] = 0
    with torch.no_grad():
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        padded = model(ids, attention_mask=mask, position_ids=positions).last_hidden_state
        alone = model(ids[1:, pad:]).last_hidden_state
    torch.testing.assert_close(padded[1, pad:], alone[0], rtol=1e-5, atol=1e-5)


def test_another_cache_class_is_refused() -> None:
    model = _gpt2()
    register()
    model.set_attn_implementation("linattn")
    with pytest.raises(ValueError, match=r"must be a linattn\.integrations\.transformers"):
        model.generate(_batch()[0][:1], max_new_tokens=3, do_sample=False, pad_token_id=0)


def test_dropout_in_training_is_refused() -> None:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=20, attn_pdrop=0.1)
    model = transformers.GPT2Model(config).train()
    register()
    model.set_attn_implementation("linattn")
    with pytest.raises(ValueError, match="attention dropout must be 0"):
        model(torch.zeros(1, 4, dtype=torch.long))


def test_config_options_override_register() -> None:
    model = _bert()
    model.config.linattn = {"num_features": 32, "seed": 4}
    _outputs(model, "linattn", 256)
    fm = state_of(model.encoder.layer[0].attention.self).drawn
    assert fm.num_features == 32


REFUSED = [
    ({"num_features": 0}, ValueError, "register: num_features must be a positive integer, or"),
    ({"num_features": True}, ValueError, "num_features must be a positive integer"),
    ({"num_features": None}, ValueError, "needs window, sink_keys or exact_keys"),
    ({"num_features": None, "window": 4, "kind": "positive"}, ValueError, "is a feature map's"),
    ({"kind": "gaussian"}, ValueError, "register: kind must be None or one of"),
    ({"window": 0}, ValueError, "register: window must be a positive integer or None; got 0"),
    ({"sink_keys": -1}, ValueError, "register: sink_keys must be a non-negative integer"),
    ({"exact_keys": "cls"}, TypeError, "register: exact_keys must be None, 'special' .*'cls'"),
    ({"exact_key_mask": 1}, TypeError, r"register takes num_features, .*\['exact_key_mask'\]"),
]


@pytest.mark.parametrize(("options", "error", "message"), REFUSED)
def test_invalid_options_are_refused_by_register(options: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        register(**options)


def test_invalid_config_options_are_refused_at_the_call() -> None:
    model = _bert()
    model.config.linattn = {"num_features": None}
    with pytest.raises(ValueError, match=r"config\.linattn: num_features=None"):
        _outputs(model, "linattn")
    model.config.linattn = {"exact_keys": lambda mask: mask[:, :-1]}
    with pytest.raises(
        ValueError, match=r"exact_keys \(a callable\) must return a boolean .*\(2, 12\)"
    ):
        _outputs(model, "linattn")


def test_exact_keys_in_a_decoder_are_refused() -> None:
    with pytest.raises(ValueError, match="exact_keys='special' is for bidirectional attention"):
        _outputs(_gpt2(), "linattn", exact_keys="special", sink_keys=1)


# -- the mask converter ---------------------------------------------------------------


def _masks(causal: bool) -> torch.Tensor:
    keep = torch.ones(2, 1, 5, 5, dtype=torch.bool)
    if causal:
        keep = keep.tril()
    keep[1, ..., -2:] = False
    return keep


@pytest.mark.parametrize("causal", [False, True])
def test_padding_and_causal_masks_convert(causal: bool) -> None:
    keep = _masks(causal)
    key_mask, found = key_mask_from(keep, 5, 5)
    assert found == causal
    np.testing.assert_array_equal(key_mask[:, 0].numpy(), [[1] * 5, [1, 1, 1, 0, 0]])
    additive = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    assert torch.equal(key_mask_from(additive, 5, 5)[0], key_mask)


def test_a_mask_read_once_is_read_again_when_it_changes() -> None:
    """Every layer gets the same 4-D mask: it is read once and compared after, so a mask
    changed in place (inference tensors keep no version counter), or refused, is still
    read as what it holds now."""
    with torch.inference_mode():
        keep = _masks(False)
        first = key_mask_from(keep, 5, 5)[0]
        assert key_mask_from(keep, 5, 5)[0] is first  # (the same tensor: read once)
        keep[0, ..., 0] = False  # row 0's first key is padding now
        np.testing.assert_array_equal(key_mask_from(keep, 5, 5)[0][:, 0].numpy(),
                                      [[0, 1, 1, 1, 1], [1, 1, 1, 0, 0]])  # fmt: skip
        keep[0, 0, 0, 1] = False  # not a padding pattern any more
        with pytest.raises(ValueError, match="must be a padding mask"):
            key_mask_from(keep, 5, 5)
    found = key_mask_from(_masks(False), 5, 5)[0]  # outside inference mode: its own tensor
    assert not found.is_inference()


def test_biases_and_other_masks_are_refused() -> None:
    alibi = -torch.arange(5.0).expand(2, 1, 5, 5)
    with pytest.raises(ValueError, match="cannot add attention biases"):
        key_mask_from(alibi, 5, 5)
    window = _masks(True) & ~torch.ones(5, 5, dtype=torch.bool).tril(-3)
    with pytest.raises(ValueError, match="must be a padding mask, optionally causal"):
        key_mask_from(window, 5, 5)


def test_masks_under_torch_compile_are_asserted_in_the_graph() -> None:
    """Compiled with the module's causality given, the mask's values are not read while
    tracing (one graph) but asserted when the graph runs: the same key mask as eagerly,
    and biases, other patterns or a causal mask for a module that is not causal fail."""
    for causal in (False, True):

        def keys(mask, causal=causal):  # type: ignore[no-untyped-def]
            return key_mask_from(mask, 5, 5, causal=causal)[0]

        keep = _masks(causal)
        additive = torch.zeros(keep.shape).masked_fill(~keep, -torch.inf)
        assert torch._dynamo.explain(keys)(additive).graph_break_count == 0
        compiled = torch.compile(keys, fullgraph=True, backend="aot_eager")
        for mask in (keep, additive):
            assert torch.equal(compiled(mask), key_mask_from(mask, 5, 5)[0])
        with pytest.raises(RuntimeError, match="must be a padding mask, optionally causal"):
            compiled(_masks(not causal))  # causal exactly when the module is
        with pytest.raises(RuntimeError, match="must be a padding mask, optionally causal"):
            compiled(_masks(True) & ~torch.ones(5, 5, dtype=torch.bool).tril(-3))
        with pytest.raises(RuntimeError, match="cannot add attention biases"):
            compiled(-torch.arange(5.0).expand(2, 1, 5, 5))
