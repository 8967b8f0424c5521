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
    key_mask_from,
    register,
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


def _outputs(model: torch.nn.Module, implementation: str, num_features: int = 256, **options):
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
@pytest.mark.parametrize("make", [_gpt2, _bert])
def test_a_window_covering_the_sequence_is_eager(make) -> None:  # type: ignore[no-untyped-def]
    model = make()
    exact = _outputs(model, "eager")
    out = _outputs(model, "linattn", 16, window=4 * L)
    torch.testing.assert_close(out, exact, rtol=1e-5, atol=1e-6)


def test_generation_with_the_cache_equals_recomputation() -> None:
    model = _gpt2()
    register(num_features=64)
    model.set_attn_implementation("linattn")
    prompt = _batch()[0][:1]
    cache = LinearAttentionCache()
    generated = model.generate(
        prompt, max_new_tokens=6, do_sample=False, past_key_values=cache, pad_token_id=0
    )
    assert cache.layers[0].state.kv.shape[-2:] == (64, 17)  # m features, d + 1
    tokens = prompt
    with torch.no_grad():
        for _ in range(6):  # no cache: the whole prefix every step
            logits = model(tokens).logits[:, -1]
            tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], dim=1)
    torch.testing.assert_close(generated, tokens)


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
    fm = model.encoder.layer[0].attention.self._linattn_feature_map[1]
    assert fm.num_features == 32


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


def test_biases_and_other_masks_are_refused() -> None:
    alibi = -torch.arange(5.0).expand(2, 1, 5, 5)
    with pytest.raises(ValueError, match="cannot add attention biases"):
        key_mask_from(alibi, 5, 5)
    window = _masks(True) & ~torch.ones(5, 5, dtype=torch.bool).tril(-3)
    with pytest.raises(ValueError, match="must be a padding mask, optionally causal"):
        key_mask_from(window, 5, 5)
