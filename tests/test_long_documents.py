"""Long documents from a 512-position encoder: position extension, calibration at length
(sampled query rows, exact attention in row blocks), and the command line's options.

Tiny random models here; the real model at real lengths is
``benchmarks/long_documents.py``'s.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("scipy")  # (linattn.models.bert's GELU)

from linattn import cli
from linattn.models import bert
from linattn.models.bert import BertConfig, BertEncoder, random_weights
from linattn.models.positions import (
    POSITIONS_ENTRY,
    extend_positions,
    extended_table,
    position_count,
)
from linattn.transfer import LayerBatch, fit_layer
from linattn.transfer.batches import prepare, sampled_rows
from linattn.transfer.loss import forward

CONFIG = BertConfig(8, 2, 2, 1e-12)


def _encoder() -> BertEncoder:
    return BertEncoder(random_weights(CONFIG, 60), CONFIG)


# -- position extension -------------------------------------------------------------------


def test_extended_tables_keep_the_learned_rows_where_they_fall() -> None:
    """Interpolation: the ends are the learned ends, every row lies between two learned
    neighbours, and a table stretched by an integer factor k + 1 over n - 1 steps holds
    every learned row at p k; grouping repeats each learned row length / n times."""
    table = np.random.default_rng(0).normal(size=(5, 3))
    stretched = extended_table(table, 17, "interpolate")  # (17 - 1) / (5 - 1) = 4 per step
    np.testing.assert_allclose(stretched[::4], table, atol=1e-12)
    np.testing.assert_allclose(stretched[2], (table[0] + table[1]) / 2, atol=1e-12)
    grouped = extended_table(table, 15, "group")
    np.testing.assert_array_equal(grouped, np.repeat(table, 3, axis=0))
    np.testing.assert_array_equal(extended_table(table, 5), table)
    with pytest.raises(ValueError, match="length must be an integer of at least"):
        extended_table(table, 4)
    with pytest.raises(ValueError, match="method must be one of"):
        extended_table(table, 9, "rope")


def test_an_extended_encoder_reads_longer_inputs() -> None:
    encoder = _encoder()
    ids = np.arange(700)[None] % 60
    mask = np.ones((1, 700), dtype=bool)
    with pytest.raises(ValueError, match="has 512 positions"):
        encoder.encode(ids, mask)
    assert extend_positions(encoder, 1024) == {
        "method": "interpolate", "original": 512, "length": 1024,
    }  # fmt: skip
    assert position_count(encoder) == encoder.max_length == 1024
    assert encoder.encode(ids, mask).shape == (1, 8)
    with pytest.raises(ValueError, match="extended already"):
        extend_positions(encoder, 2048)
    with pytest.raises(TypeError, match="BERT's absolute position table"):
        extend_positions(object(), 2048)


def test_transformers_bert_extends_as_the_numpy_encoder() -> None:
    """The same table, the config and buffers updated: the NumPy encoder and transformers'
    BertModel give the same hidden states at a length past the original table."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=60, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16, hidden_act="gelu",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.BertModel(config, add_pooling_layer=False).eval()
    weights = {name: t.detach().numpy() for name, t in model.state_dict().items()}
    encoder = BertEncoder(weights, BertConfig.from_json(config.to_dict()))
    extend_positions(model, 40, "group")
    extend_positions(encoder, 40, "group")
    assert model.config.max_position_embeddings == 40
    assert getattr(model.config, POSITIONS_ENTRY)["original"] == 16
    ids = np.arange(40)[None] % 60
    mask = np.ones((1, 40), dtype=bool)
    with torch.no_grad():
        got = model(torch.tensor(ids), attention_mask=torch.tensor(mask)).last_hidden_state
    np.testing.assert_allclose(got.numpy(), encoder.hidden_states(ids, mask), atol=1e-4)


def test_exact_attention_in_row_blocks_is_exact_attention(monkeypatch) -> None:
    rng = np.random.default_rng(1)
    q, k, v = (rng.normal(size=(2, 3, 40, 4)).astype(np.float32) for _ in range(3))
    mask = np.ones((2, 40), dtype=bool)
    mask[1, 30:] = False
    whole = bert.exact_attention(q, k, v, mask, 0)
    monkeypatch.setattr(bert, "EXACT_BLOCK_ELEMENTS", 2 * 3 * 40 * 7)  # blocks of 7 rows
    np.testing.assert_allclose(bert.exact_attention(q, k, v, mask, 0), whole, atol=1e-6)


# -- calibration at length ---------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_sampled_query_rows_are_those_rows_of_the_whole_batch(causal: bool) -> None:
    """A batch prepared on sampled rows holds exactly those rows of the whole batch's
    targets, masks and hybrid output (every key still counted)."""
    rng = np.random.default_rng(2)
    q = rng.normal(size=(2, 4, 30, 8))
    k, v = rng.normal(size=(2, 2, 30, 8)), rng.normal(size=(2, 2, 30, 5))
    mask = np.ones((2, 30), dtype=bool)
    mask[1, 25:] = False
    exact = None if causal else np.arange(30) == 10
    batch = LayerBatch(q, k, v, mask, None if exact is None else np.tile(exact, (2, 1)))
    rows = sampled_rows(30, 7, 3)
    assert rows is not None and len(set(rows.tolist())) == 7
    whole, part = prepare(batch, 3, 2, causal, 0.3), prepare(batch, 3, 2, causal, 0.3, rows)
    from linattn import fitted

    p = fitted.initial_parameters(8, 6, heads=4, key_heads=2, seed=0)
    np.testing.assert_array_equal(whole.target[..., rows, :], part.target)
    np.testing.assert_array_equal(whole.far[..., rows, :], part.far)
    np.testing.assert_array_equal(whole.rows[..., rows, :], part.rows)
    np.testing.assert_allclose(forward(p, whole)[0][..., rows, :], forward(p, part)[0])


def test_the_fit_samples_rows_of_long_batches_and_says_so() -> None:
    rng = np.random.default_rng(3)

    def batch(length: int) -> LayerBatch:
        q, k, v = (rng.normal(size=(1, 2, length, 4)) for _ in range(3))
        return LayerBatch(q, k, v, np.ones((1, length), dtype=bool))

    lines: list[str] = []
    fit_layer([batch(40), batch(12)], [batch(40)], num_features=4, window=2, steps=2,
              evaluate_every=1, progress=lines.append, query_rows=16)  # fmt: skip
    assert lines[0] == (
        "16 query rows per batch sampled in 2 of 3 batches (up to 40 tokens), every key"
    )
    with pytest.raises(ValueError, match="query_rows must be a positive integer"):
        fit_layer([batch(12)], [batch(12)], window=2, query_rows=0)


def test_a_file_fitted_at_length_extends_the_encoder_it_is_loaded_into(tmp_path: Path) -> None:
    """The file records the extension and the calibration length: loading it into the
    original encoder extends that the same way (the fingerprint then matches), and an
    input past the calibrated length runs with a warning."""
    pytest.importorskip("safetensors")
    from linattn.models.convert import attention_from_file, convert_encoder, save_fitted

    encoder = _encoder()
    extend_positions(encoder, 1024)
    rng = np.random.default_rng(4)
    ids = rng.integers(0, 60, size=(1, 600))
    mask = np.ones((1, 600), dtype=bool)
    done = convert_encoder(encoder, [(ids, mask)], [(ids, mask)], window=4, num_features=4,
                           steps=1, query_rows=32, progress=lambda line: None)  # fmt: skip
    assert done.options["max_length"] == 600 and done.options["query_rows"] == 32
    path = save_fitted(tmp_path / "fitted.safetensors", done)
    fresh = _encoder()
    attention = attention_from_file(path, fresh)
    assert fresh.position_extension == encoder.position_extension
    longer = rng.integers(0, 60, size=(1, 700))
    with pytest.warns(UserWarning, match="calibrated on inputs of up to 600 tokens"):
        fresh.encode(longer, np.ones((1, 700), dtype=bool), attention)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh.encode(ids, mask, attention)  # within the range: no warning


# -- the command line --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--max-length", "10"], "--max-length must be at least --window + --sink-keys + 2"),
        (["--pack"], "--pack joins texts up to --max-length tokens: give --max-length"),
        (["--query-rows", "0"], "--query-rows"),
    ],
)  # fmt: skip
def test_convert_refuses_bad_lengths_before_any_work(
    options: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    texts = tmp_path / "texts.txt"
    texts.write_text("one text\nanother text\n")
    argv = ["convert", "--model", str(tmp_path / "absent"), "--texts", str(texts), *options]
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_packing_joins_consecutive_texts_within_the_limit() -> None:
    from linattn.cli._convert import packed

    assert packed([5, 5, 5, 5], 9) == [[0, 1], [2, 3]]  # 5 + 3 = 8 <= 9
    assert packed([20, 4], 10) == [[0], [1]]  # a long text stands alone
    report = json.dumps(packed([], 9))
    assert report == "[]"


def test_the_command_line_offers_every_position_method() -> None:
    from linattn.cli import COMMANDS
    from linattn.cli._options import build_parser
    from linattn.models.positions import METHODS

    parser = build_parser(COMMANDS)
    convert = next(
        action.choices["convert"]
        for action in parser._actions
        if isinstance(action.choices, dict) and "convert" in action.choices
    )
    positions = next(a for a in convert._actions if a.dest == "positions")
    assert tuple(positions.choices) == METHODS


def test_the_benchmark_asks_for_the_pass_key_of_a_person() -> None:
    """The passkey documents name people (a configurations tuple of the same name once
    shadowed them: the queries asked for "exact"'s key), and any ``--tasks`` draws the
    same documents."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "long_documents.py"
    spec = importlib.util.spec_from_file_location("long_documents", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    class Words:  # a stand-in tokenizer: one id per word
        def encode(self, text: str, add_special_tokens: bool = False) -> object:
            return type("Encoding", (), {"ids": [len(w) for w in text.split()]})()

        def token_to_id(self, token: str) -> int:
            return 0

    docs, queries = module.task(module.Builder(Words(), 0), "passkey", 64, 6)
    people = {query.removeprefix("what is the pass key for ").rstrip("?") for query in queries}
    assert people <= set(module.NAMES) and not people & set(module.CONFIGURATIONS)
    assert len(docs) == 6 and all(len(doc) == 64 for doc in docs)
