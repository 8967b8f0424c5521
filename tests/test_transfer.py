"""Attention transfer (linattn.transfer) and the NumPy BERT conversion (linattn.models.convert).

Tiny shapes: the fit's figures on the real model are in benchmarks/transfer_minilm.py.
"""

from __future__ import annotations

import threading
import warnings

import numpy as np
import pytest

import linattn as la
from linattn import fitted, transfer
from linattn.transfer import LayerBatch, exact_heads_of, fit_layer, load_maps

RNG = np.random.default_rng(0)
D, M, L = 4, 8, 10


def _batch(
    heads: int = 4, key_heads: int = 2, exact: bool = True, scale: float = 1.0
) -> LayerBatch:
    q = scale * RNG.normal(size=(2, heads, L, D))
    k = scale * RNG.normal(size=(2, key_heads, L, D))
    v = RNG.normal(size=(2, key_heads, L, D))
    key_mask = np.ones((2, L), dtype=bool)
    key_mask[1, -3:] = False
    sep = np.zeros((2, L), dtype=bool)
    sep[:, 4] = True
    return LayerBatch(q, k, v, key_mask, sep if exact else None)


def _perturbed(heads: int, key_heads: int, tied: bool = False) -> fitted.FittedParameters:
    p = fitted.initial_parameters(D, M, heads=heads, key_heads=key_heads, tied=tied, seed=1)
    values = transfer.optimiser.values_of(p)
    values = {n: x + 0.3 * RNG.normal(size=x.shape) for n, x in values.items()}
    return transfer.optimiser.parameters_of(values, tied)


@pytest.mark.parametrize(
    ("causal", "heads", "key_heads", "tied"),
    [(False, 4, 2, False), (True, 4, 2, False), (False, 2, 2, True)],
)
def test_the_fit_gradient_equals_finite_differences(causal, heads, key_heads, tied) -> None:  # type: ignore[no-untyped-def]
    batch = _batch(heads, key_heads, exact=not causal)
    parts = transfer.batches.prepare(batch, 2, 1, causal, 0.5)
    p = _perturbed(heads, key_heads, tied)
    values = transfer.optimiser.values_of(p)
    _, grads = transfer.loss.batch_loss_grad(p, parts.pieces())
    eps = 1e-6
    for name, value in values.items():
        for _ in range(3):
            index = tuple(int(RNG.integers(0, s)) for s in value.shape)

            def loss(shift: float, name: str = name, index: tuple = index) -> float:
                moved = {n: x.copy() for n, x in values.items()}
                moved[name][index] += shift
                return float(
                    transfer.loss.batch_loss_grad(
                        transfer.optimiser.parameters_of(moved, tied), [parts]
                    )[0].sum()
                )

            slope = (loss(eps) - loss(-eps)) / (2 * eps)
            assert grads[name][index] == pytest.approx(slope, rel=1e-5, abs=1e-9), name


@pytest.mark.parametrize("causal", [False, True])
def test_the_fit_computes_what_linear_attention_computes(causal: bool) -> None:
    batch = _batch(exact=not causal)
    parts = transfer.batches.prepare(batch, 2, 1, causal, 0.5)
    p = _perturbed(4, 2)
    out, _ = transfer.loss.forward(p, parts)
    fm = la.FeatureMap.fitted(
        p.query_weight, p.query_bias, key_weight=p.key_weight, key_bias=p.key_bias,
        far_weight=p.far_weight, scale=0.5,
    )  # fmt: skip
    exact = None if causal else batch.exact_key_mask[:, None, :]
    ref = la.linear_attention(
        batch.q, batch.k, batch.v, fm, causal=causal, window=2, sink_keys=1,
        key_mask=batch.key_mask[:, None, :], exact_key_mask=exact, backend="array_api",
    )  # fmt: skip
    rows = batch.key_mask[:, None, :, None]
    np.testing.assert_allclose(
        np.where(rows, out.reshape(ref.shape), 0), np.where(rows, ref, 0), atol=1e-12
    )


def test_large_logits_without_exact_parts_warn_of_nothing() -> None:
    """Fitted maps alone (no window, sinks or exact keys) with logits far beyond exp's
    float32 range: the exact target and the (empty) near weights are computed without an
    overflow warning (each exp takes the masked logits, -inf off the mask)."""
    batch = _batch(2, 2, exact=False, scale=30.0)
    batch = LayerBatch(*(x.astype(np.float32) for x in batch[:3]), batch.key_mask, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parts = transfer.batches.prepare(batch, None, 0, False, 0.5)
        out, _ = transfer.loss.forward(_perturbed(2, 2), parts)
    assert np.isfinite(out).all()


def test_fit_beats_window_and_sinks_on_held_out_batches_and_is_deterministic() -> None:
    fit = [_batch(2, 2) for _ in range(3)]
    validation, test = [_batch(2, 2)], [_batch(2, 2)]
    options = {"num_features": M, "window": 2, "sink_keys": 1, "steps": 40, "evaluate_every": 10}
    first = fit_layer(fit, validation, progress=lambda line: None, **options)
    again = fit_layer(fit, validation, progress=lambda line: None, **options)
    assert first.feature_map.fingerprint == again.feature_map.fingerprint
    err, _ = transfer.attention_errors(first.feature_map, test, window=2, sink_keys=1)
    base, _ = transfer.attention_errors(None, test, window=2, sink_keys=1)
    # Window 2 of 10 keys leaves most of the mass far: the fitted far part must help on
    # the unseen batch (every head where it was kept).
    kept = ~np.repeat(first.exact_only, 1)
    assert kept.any()
    assert np.all(err[kept] < base[kept])
    assert np.all(first.validation_error <= first.exact_parts_error)
    # The per-head norms weight the heads' errors into the layer's, as attention_errors
    # measures it on the validation batches; the shares rank the heads by that error.
    v_err, v_norm = transfer.attention_errors(first.feature_map, validation, window=2, sink_keys=1)
    np.testing.assert_allclose(first.exact_squared_norm, v_norm.reshape(-1), rtol=1e-12)
    np.testing.assert_allclose(first.validation_error, np.sqrt(v_err / v_norm).reshape(-1))
    shares = first.error_shares()
    np.testing.assert_allclose(shares.sum(), 1.0)
    np.testing.assert_allclose(shares, (v_err / v_err.sum()).reshape(-1), rtol=1e-9)


def test_a_numpy_fit_runs_each_batch_in_pieces_on_threads_to_the_same_bits(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """NumPy fits compute each batch's pieces (rows) on a thread pool; the pieces are
    summed in order, so the fit is the sequential one's to the last bit."""
    fit, validation = [_batch(), _batch()], [_batch()]
    options = {"num_features": M, "window": 2, "sink_keys": 1, "steps": 6, "evaluate_every": 3}
    threads = set()
    forward = transfer.loss.forward

    def recorded(p, parts):  # type: ignore[no-untyped-def]
        threads.add(threading.current_thread().name.split("_")[0])
        return forward(p, parts)

    for module in (transfer.loss, transfer.fit):  # (the modules that run it on the pieces)
        monkeypatch.setattr(module, "forward", recorded)
    results = []
    for cores in (2, 1):
        threads.clear()
        monkeypatch.setattr(transfer.threads, "cores", lambda cores=cores: cores)
        results.append(fit_layer(fit, validation, progress=lambda line: None, **options))
        assert ("linattn-fit" in threads) == (cores > 1), threads
    threaded, sequential = (r.feature_map.parameters for r in results)
    for name in ("query_weight", "query_bias", "key_weight", "key_bias", "far_weight"):
        np.testing.assert_array_equal(getattr(threaded, name), getattr(sequential, name))
    assert results[0].history == results[1].history


def test_heads_whose_fit_cannot_help_keep_the_exact_parts_alone() -> None:
    # A window covering every key leaves no far key: the fit cannot beat window + sinks,
    # so every head gets g = 0 (and the map then equals the exact parts exactly).
    fit, validation = [_batch(2, 2)], [_batch(2, 2)]
    result = fit_layer(
        fit, validation, num_features=M, window=L, steps=5, evaluate_every=5,
        progress=lambda line: None,
    )  # fmt: skip
    assert result.exact_only.all()
    assert np.all(result.feature_map.parameters.far_weight == 0)


def test_bad_calibration_batches_are_refused() -> None:
    batch = _batch(2, 2)
    empty = batch._replace(key_mask=np.zeros((2, L), dtype=bool))
    with pytest.raises(ValueError, match="key_mask must mark real tokens"):
        fit_layer([empty], [batch], num_features=M, window=2)
    with pytest.raises(ValueError, match="exact_key_mask is for bidirectional"):
        fit_layer([batch], [batch], num_features=M, window=2, causal=True)
    with pytest.raises(ValueError, match="tied=True needs as many key heads"):
        fit_layer([_batch(4, 2)], [_batch(4, 2)], num_features=M, window=2, tied=True)
    with pytest.raises(ValueError, match="at least one LayerBatch"):
        fit_layer([], [batch], num_features=M, window=2)


def test_maps_save_and_load_with_their_model_and_version(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("safetensors")
    per_head = la.FeatureMap.fitted(
        RNG.normal(size=(2, D, M // 2)), key_weight=RNG.normal(size=(2, D, M // 2)),
        far_weight=[0.0, 2.5], scale=0.3,
    )  # fmt: skip
    shared = la.FeatureMap(D, M, kind="hedgehog", seed=3).with_parameters(tied=True)
    path = transfer.save_maps(
        tmp_path / "maps.safetensors", [per_head, None, shared], model_fingerprint="abc",
        options={"window": 2},
    )  # fmt: skip
    layers, options = transfer.load_maps(path, model_fingerprint="abc")
    assert options == {"window": 2}
    assert [fm is None for fm, _ in layers] == [False, True, False]
    assert layers[0][0].fingerprint == per_head.fingerprint
    assert layers[2][0].fingerprint == shared.fingerprint and layers[2][0].parameters.tied
    np.testing.assert_array_equal(layers[0][1], [0.0, 2.5])
    with pytest.raises(ValueError, match="fitted for another model"):
        transfer.load_maps(path, model_fingerprint="xyz")
    monkeypatch.setattr(la, "__version__", "0.0.0")  # another version reads the format
    assert transfer.load_maps(path, model_fingerprint="abc")[1] == {"window": 2}
    from safetensors import safe_open
    from safetensors.numpy import save_file

    with safe_open(str(path), framework="numpy") as f:
        metadata, tensors = f.metadata(), {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    newer = tmp_path / "newer.safetensors"
    save_file(tensors, str(newer), metadata={**metadata, "format": "linattn-fitted-maps/9"})
    with pytest.raises(ValueError, match=r"format linattn-fitted-maps/9, written by linattn "):
        transfer.load_maps(newer, model_fingerprint="abc")
    (tmp_path / "other").write_bytes(b"not a file of maps")
    with pytest.raises(ValueError, match="path must be a linattn fitted-maps file"):
        transfer.load_maps(tmp_path / "other", model_fingerprint=None)


def _tiny_bert():  # type: ignore[no-untyped-def]
    """A random 2-layer, 2-head BERT, its config, and a batch with one padded row."""
    from linattn.models.bert import BertConfig, BertEncoder, random_weights

    config = BertConfig(8, 2, 2, 1e-12)
    encoder = BertEncoder(random_weights(config, 50), config)
    ids = RNG.integers(0, 50, size=(2, 12))
    mask = np.ones((2, 12), dtype=bool)
    mask[1, 9:] = False
    return config, encoder, ids, mask


def test_a_converted_bert_encodes_and_reloads_without_refit(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("safetensors")
    from linattn.models.bert import BertEncoder, random_weights
    from linattn.models.convert import attention_from_file, convert_encoder, save_fitted

    config, encoder, ids, mask = _tiny_bert()
    done = convert_encoder(
        encoder, [(ids, mask)], [(ids[::-1], mask[::-1])], window=2, num_features=4, steps=4,
        stitch="converted", progress=lambda line: None,
    )  # fmt: skip
    assert len(done.fits) == 2
    embeddings = encoder.encode(ids, mask, done.attention)
    path = save_fitted(tmp_path / "fitted.safetensors", done)
    np.testing.assert_array_equal(
        encoder.encode(ids, mask, attention_from_file(path, encoder)), embeddings
    )
    other = BertEncoder(random_weights(config, 50, seed=1), config)
    with pytest.raises(ValueError, match="fitted for another model"):
        attention_from_file(path, other)


def test_a_conversion_keeps_its_sink_keys_and_is_measured_against_the_same(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The default sink keys are transfer.SINK_KEYS; the file keeps the count, and
    `linattn accuracy --fitted`'s window + sinks row attends to as many."""
    pytest.importorskip("safetensors")
    from linattn.cli._convert import FITTED_FILE
    from linattn.cli._model_accuracy import _fitted_configs
    from linattn.models.accuracy import cls_sep_mask, make_attention
    from linattn.models.convert import FittedAttention, convert_encoder, save_fitted

    _, encoder, ids, mask = _tiny_bert()
    options = {"window": 1, "num_features": 4, "steps": 2, "progress": lambda line: None}
    done = convert_encoder(encoder, [(ids, mask)], [(ids[::-1], mask[::-1])], **options)
    assert done.options["sink_keys"] == done.attention.sink_keys == transfer.SINK_KEYS == 4
    save_fitted(tmp_path / FITTED_FILE, done)
    base, fitted = _fitted_configs(tmp_path)
    assert base.sink_keys == fitted.sink_keys == transfer.SINK_KEYS
    assert base.label == "w=1 + 4 sinks" and fitted.label.startswith("w=1 + 4 sinks + fitted")
    q, k, v = encoder.qkv(encoder.embed(ids), 0)
    alone = FittedAttention([None, None], 1, transfer.SINK_KEYS)(q, k, v, mask, 0)
    got = make_attention(base, q.shape[-1])(q, k, v, mask, 0)
    want = la.linear_attention(
        q, k, v, None, key_mask=mask[:, None], window=1, sink_keys=4,
        exact_key_mask=cls_sep_mask(mask), scale=q.shape[-1] ** -0.5,
    )  # fmt: skip
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(alone, want, rtol=1e-6, atol=1e-7)


def test_exact_heads_of_a_converted_bert(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """exact_heads: every head exact is the exact model; one head per layer is the worst
    fitted one, attends exactly, and survives the file and a resumed checkpoint."""
    pytest.importorskip("safetensors")
    from linattn.models.bert import exact_attention
    from linattn.models.convert import attention_from_file, convert_encoder, save_fitted

    _, encoder, ids, mask = _tiny_bert()
    options = {"window": 2, "num_features": 4, "steps": 3, "progress": lambda line: None}
    every = convert_encoder(
        encoder, [(ids, mask)], [(ids[::-1], mask[::-1])], exact_heads=2, **options
    )
    assert every.attention.exact_heads == [(0, 1), (0, 1)]
    np.testing.assert_allclose(
        encoder.encode(ids, mask, every.attention), encoder.encode(ids, mask), rtol=1e-6
    )
    checkpoint = tmp_path / "maps.safetensors"
    one = convert_encoder(
        encoder, [(ids, mask)], [(ids[::-1], mask[::-1])], exact_heads=1, checkpoint=checkpoint,
        **options,
    )  # fmt: skip
    heads = one.attention.exact_heads
    assert heads == [(int(np.argmax(f.error_shares())),) for f in one.fits]
    q, k, v = encoder.qkv(encoder.embed(ids), 0)
    got = one.attention(q, k, v, mask, 0)
    h = heads[0][0]
    np.testing.assert_allclose(got[:, h], exact_attention(q, k, v, mask, 0)[:, h], rtol=1e-6)
    plain = convert_encoder(encoder, [(ids, mask)], [(ids[::-1], mask[::-1])], **options)
    np.testing.assert_array_equal(
        np.delete(got, h, axis=1), np.delete(plain.attention(q, k, v, mask, 0), h, axis=1)
    )
    embeddings = encoder.encode(ids, mask, one.attention)
    path = save_fitted(tmp_path / "fitted.safetensors", one)
    loaded = attention_from_file(path, encoder)
    assert loaded.exact_heads == heads
    assert exact_heads_of(load_maps(path, model_fingerprint=None)[1], 2) == heads  # direct use
    np.testing.assert_array_equal(encoder.encode(ids, mask, loaded), embeddings)
    resumed = convert_encoder(
        encoder, [(ids, mask)], [(ids[::-1], mask[::-1])], exact_heads=1, checkpoint=checkpoint,
        **options,
    )  # fmt: skip
    assert resumed.fits == [None, None] and resumed.attention.exact_heads == heads
    for bad in (-1, True):
        with pytest.raises(ValueError, match=f"exact_heads must be an integer >= 0; got {bad}"):
            convert_encoder(encoder, [(ids, mask)], [(ids, mask)], exact_heads=bad, **options)
    with pytest.raises(ValueError, match=r"from 0 to the number of query heads \(2\); got 3"):
        convert_encoder(encoder, [(ids, mask)], [(ids, mask)], exact_heads=3, **options)


def test_a_conversion_resumes_from_its_checkpoint(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("safetensors")
    from linattn.models.bert import BertConfig, BertEncoder, random_weights
    from linattn.models.convert import convert_encoder

    config = BertConfig(8, 2, 2, 1e-12)
    encoder = BertEncoder(random_weights(config, 50), config)
    ids = RNG.integers(0, 50, size=(2, 8))
    mask = np.ones((2, 8), dtype=bool)
    options = {"window": 2, "num_features": 4, "steps": 3, "progress": lambda line: None}
    checkpoint = tmp_path / "maps.safetensors"
    first = convert_encoder(
        encoder, [(ids, mask)], [(ids, mask)], checkpoint=checkpoint, **options
    )
    again = convert_encoder(
        encoder, [(ids, mask)], [(ids, mask)], checkpoint=checkpoint, **options
    )
    assert all(fit is not None for fit in first.fits)
    assert again.fits == [None, None]  # nothing refitted
    assert [m.fingerprint for m in again.attention.maps] == [
        m.fingerprint for m in first.attention.maps
    ]
    with pytest.raises(ValueError, match="other options"):
        convert_encoder(
            encoder, [(ids, mask)], [(ids, mask)], checkpoint=checkpoint, **{**options, "steps": 4}
        )
    # Other texts: no resume (it wrote the old maps again, fitting nothing).
    with pytest.raises(ValueError, match="fitted on other texts"):
        convert_encoder(
            encoder, [(ids[::-1], mask)], [(ids, mask)], checkpoint=checkpoint, **options
        )


def test_a_checkpoint_of_an_unfinished_conversion_resumes_but_is_refused_for_use(
    tmp_path,  # type: ignore[no-untyped-def]
) -> None:
    pytest.importorskip("safetensors")
    from linattn.models.bert import BertConfig, BertEncoder, random_weights
    from linattn.models.convert import convert_encoder, model_signature

    config = BertConfig(8, 2, 2, 1e-12)
    encoder = BertEncoder(random_weights(config, 50), config)
    ids, mask = RNG.integers(0, 50, size=(2, 8)), np.ones((2, 8), dtype=bool)
    options = {"window": 2, "num_features": 4, "steps": 3, "progress": lambda line: None}
    checkpoint = tmp_path / "maps.safetensors"
    stop = {"layer": 0}

    def interrupt(line: str) -> None:  # (the conversion killed after its first layer)
        if "layer 1" in line:
            raise KeyboardInterrupt
        stop["layer"] += 1

    with pytest.raises(KeyboardInterrupt):
        convert_encoder(
            encoder, [(ids, mask)], [(ids, mask)], checkpoint=checkpoint,
            **{**options, "progress": interrupt},
        )  # fmt: skip
    with pytest.raises(ValueError, match="checkpoint of an unfinished conversion"):
        load_maps(checkpoint, model_fingerprint=model_signature(encoder))
    done = convert_encoder(encoder, [(ids, mask)], [(ids, mask)], checkpoint=checkpoint, **options)
    assert done.fits[0] is None and done.fits[1] is not None  # (resumed after layer 0)
    layers, _ = load_maps(checkpoint, model_fingerprint=model_signature(encoder))
    assert all(fm is not None for fm, _ in layers)


def test_a_fitted_maps_file_is_written_whole_or_not_at_all(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    fm = la.FeatureMap.fitted(RNG.standard_normal((2, 4, 3)), tied=True)
    path = tmp_path / "maps.safetensors"
    transfer.save_maps(path, [fm], model_fingerprint="m")
    before = path.read_bytes()
    real = safetensors_numpy.save_file

    def full_disk(tensors, filename, metadata=None):  # type: ignore[no-untyped-def]
        real(tensors, filename, metadata=metadata)
        with open(filename, "r+b") as f:  # (half written, then the disk is full)
            f.truncate(len(before) // 2)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors_numpy, "save_file", full_disk)
    with pytest.raises(OSError, match="No space"):
        transfer.save_maps(path, [fm, fm], model_fingerprint="m")
    assert path.read_bytes() == before  # (the old file, whole)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["maps.safetensors"]  # no temporary


@pytest.mark.parametrize("damage", ["drop a tensor", "drop a layer", "garble the metadata"])
def test_a_damaged_fitted_maps_file_is_refused_by_name(tmp_path, damage: str) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("safetensors")
    from safetensors import safe_open
    from safetensors.numpy import save_file

    fm = la.FeatureMap.fitted(RNG.standard_normal((2, 4, 3)), tied=True)
    path = tmp_path / "maps.safetensors"
    transfer.save_maps(path, [fm, fm], model_fingerprint="m")
    with safe_open(str(path), framework="numpy") as f:
        metadata = dict(f.metadata())
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    if damage == "drop a tensor":
        del tensors["layer.1.query_bias"]
    elif damage == "drop a layer":
        tensors = {name: x for name, x in tensors.items() if not name.startswith("layer.1.")}
    else:
        metadata["scales"] = "[1.0"
    save_file(tensors, str(path), metadata=metadata)
    with pytest.raises(ValueError, match=f"{path} is damaged"):
        load_maps(path, model_fingerprint="m")
