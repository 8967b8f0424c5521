"""One validation for the entry points: ``plan_attention`` rejects what
``linear_attention`` rejects, with the same error, before any plan; the fitted forms
(torch, every form) reject it before any work.

On the commit before, ``plan_attention`` returned a plan for most of the bad arguments
below, and ``linattn.torch.fitted_attention`` on an empty sequence reached torch's fused
attention kernel, which killed the interpreter (SIGFPE): that case runs in a subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import linattn as la

ROOT = Path(__file__).resolve().parents[1]
RNG = np.random.default_rng(0)
X = RNG.standard_normal((1, 2, 6, 4))
FM = la.FeatureMap(4, 8, seed=0)

#: ``(arguments, options)`` that linear_attention rejects, each for its own reason.
BAD: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {
    "empty sequence": ((X[..., :0, :], X[..., :0, :], X[..., :0, :], FM), {}),
    "no features": ((X[..., :0], X[..., :0], X, la.FeatureMap(0 + 4, 8)), {}),
    "k and v lengths": ((X, X, X[..., :5, :], FM), {}),
    "head dim against the map": ((X, X, X, la.FeatureMap(8, 8)), {}),
    "causal with other lengths": ((X, X[..., :5, :], X[..., :5, :], FM), {"causal": True}),
    "causal not a bool": ((X, X, X, FM), {"causal": 1}),
    "return_state not a bool": ((X, X, X, FM), {"causal": True, "return_state": 1}),
    "state without causal": ((X, X, X, FM), {"return_state": True}),
    "window zero": ((X, X, X, FM), {"window": 0}),
    "window a float": ((X, X, X, FM), {"window": 2.5}),
    "window a string": ((X, X, X, FM), {"window": "3"}),
    "window True": ((X, X, X, FM), {"window": True}),
    "negative sinks": ((X, X, X, FM), {"sink_keys": -1}),
    "chunk_size zero": ((X, X, X, FM), {"causal": True, "chunk_size": 0}),
    "chunk_size a float": ((X, X, X, FM), {"causal": True, "chunk_size": 2.0}),
    "key_mask not bool": ((X, X, X, FM), {"key_mask": np.ones(6)}),
    "key_mask length": ((X, X, X, FM), {"key_mask": np.ones(5, bool)}),
    "exact keys with causal": (
        (X, X, X, FM),
        {"causal": True, "window": 2, "exact_key_mask": np.ones(6, bool)},
    ),
    "window over other lengths": ((X, X[..., :5, :], X[..., :5, :], FM), {"window": 2}),
    "state not a state": ((X, X, X, FM), {"causal": True, "state": {"kv": 0}}),
    "integer inputs": ((X.astype(int), X, X, FM), {}),
}


def _error(f: Any, *args: Any, **options: Any) -> tuple[type, str]:
    with pytest.raises((TypeError, ValueError)) as caught:
        f(*args, **options)
    return type(caught.value), str(caught.value)


@pytest.mark.parametrize("case", list(BAD))
def test_plan_attention_rejects_what_linear_attention_rejects(case: str) -> None:
    args, options = BAD[case]
    assert _error(la.plan_attention, *args, **options) == _error(
        la.linear_attention, *args, **options
    )


@pytest.mark.parametrize(
    "case", ["empty sequence", "window zero", "window a float", "window a string",
             "k and v lengths", "chunk_size zero"],
)  # fmt: skip
def test_torch_fitted_attention_rejects_it_before_any_work(case: str) -> None:
    torch = pytest.importorskip("torch")
    from linattn.torch import fitted_attention

    args, options = BAD[case]
    q, k, v = (torch.from_numpy(x) for x in args[:3])
    weight = torch.from_numpy(RNG.standard_normal((2, 4, 4)))
    expected = _error(
        la.linear_attention, *args[:3], la.FeatureMap.fitted(weight.numpy(), tied=True),
        **options,
    )  # fmt: skip
    for dense in (None, True):
        got = _error(fitted_attention, q, k, v, weight, tied=True, dense=dense, **options)
        assert got == expected


#: The cases the layers and ``register()`` take too (their options are the hybrid's).
OPTION_CASES = [
    "window zero",
    "window a float",
    "window a string",
    "window True",
    "negative sinks",
]

#: The cases the custom operator's schema can carry (tensors, ints, bools and None; its
#: schema's own types turn a float or string window away as torch's RuntimeError).
OPERATOR_CASES = [
    "empty sequence", "no features", "k and v lengths", "head dim against the map",
    "causal with other lengths", "window zero", "negative sinks", "chunk_size zero",
    "key_mask not bool", "key_mask length", "exact keys with causal",
    "window over other lengths", "integer inputs",
]  # fmt: skip


def _same_error(got: tuple[type, str], expected: tuple[type, str]) -> bool:
    """The same error type, the front door's message (after the caller's prefix, such as
    ``register: ``)."""
    return got[0] is expected[0] and got[1].endswith(expected[1])


@pytest.mark.parametrize("case", [*OPTION_CASES, "empty sequence", "key_mask length"])
def test_jax_fitted_attention_rejects_it_before_any_work(case: str) -> None:
    jnp = pytest.importorskip("jax.numpy")
    from linattn.jax import fitted_attention

    args, options = BAD[case]
    weight = RNG.standard_normal((2, 4, 4))
    expected = _error(
        la.linear_attention, *args[:3], la.FeatureMap.fitted(weight, tied=True), **options
    )
    q, k, v = (jnp.asarray(x) for x in args[:3])
    options = {n: jnp.asarray(x) if isinstance(x, np.ndarray) else x for n, x in options.items()}
    for dense in (None, True):
        got = _error(
            fitted_attention, q, k, v, jnp.asarray(weight), tied=True, dense=dense, **options
        )
        assert got == expected


@pytest.mark.parametrize("case", OPTION_CASES)
@pytest.mark.parametrize("entry", ["torch layer", "flax layer", "register"])
def test_layers_and_register_reject_the_options_linear_attention_rejects(
    case: str, entry: str
) -> None:
    args, options = BAD[case]
    expected = _error(la.linear_attention, *args, **options)
    if entry == "torch layer":
        pytest.importorskip("torch")
        from linattn.torch import FastAttention as make
    elif entry == "flax layer":
        pytest.importorskip("flax")
        from linattn.flax import FastAttention as make
    else:
        pytest.importorskip("transformers")
        from linattn.integrations.transformers import register

        def make(head_dim: int, num_features: int, **options: Any) -> None:
            register(num_features=num_features, **options)

    try:
        assert _same_error(_error(make, 4, 8, **options), expected)
    finally:
        if entry == "register":
            register()  # (the defaults back for the other tests)


@pytest.mark.parametrize("case", OPERATOR_CASES)
def test_the_custom_operator_rejects_what_linear_attention_rejects(case: str) -> None:
    """``torch.ops.linattn.exact_parts_forward`` called directly checks its call as the
    front door does, before its NumPy views reach a kernel."""
    torch = pytest.importorskip("torch")
    import linattn.executors.torch_operators  # noqa: F401  (registers the operator)

    args, options = BAD[case]
    expected = _error(la.linear_attention, *args, **options)
    q, k, v, feature_map = args
    masks = (torch.from_numpy(np.asarray(options[n])) if n in options else None
             for n in ("key_mask", "exact_key_mask"))  # fmt: skip
    got = _error(
        torch.ops.linattn.exact_parts_forward, *(torch.from_numpy(x) for x in (q, k, v)),
        *masks, feature_map.fingerprint, options.get("causal", False), options.get("window"),
        options.get("sink_keys", 0), options.get("chunk_size"), None, None,
    )  # fmt: skip
    assert got == expected


def test_an_empty_sequence_does_not_kill_the_interpreter() -> None:
    """(SIGFPE in torch's fused attention kernel on the commit before.)"""
    pytest.importorskip("torch")
    program = (
        "import torch\n"
        "from linattn.torch import fitted_attention\n"
        "q = torch.randn(1, 2, 0, 4)\n"
        "try:\n"
        "    fitted_attention(q, q, q, torch.eye(4).repeat(2, 1, 1), tied=True)\n"
        "except ValueError as error:\n"
        "    print(error)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "q must have at least one position" in done.stdout


@pytest.mark.parametrize("window", [2.5, "3", True])
def test_torch_tensors_get_the_same_window_error(window: object) -> None:
    """(A raw custom-operator RuntimeError before; ``window=True`` was taken as 1.)"""
    torch = pytest.importorskip("torch")
    x = torch.from_numpy(X)
    expected = _error(la.linear_attention, X, X, X, FM, window=window)
    assert _error(la.linear_attention, x, x, x, FM, window=window) == expected
    assert expected[0] is ValueError and "window must be a positive integer" in expected[1]


@pytest.mark.parametrize("causal", [False, True])
def test_a_window_or_sinks_beyond_the_keys_cost_nothing(causal: bool) -> None:
    """``window=10**6`` on 6 tokens padded the band to a million keys (58 TiB asked,
    MemoryError); without a state in or out it is the window of all the keys."""
    import tracemalloc

    exact = la.linear_attention(X, X, X, FM, causal=causal, window=6, sink_keys=6)
    la.linear_attention(X, X, X, FM, causal=causal, window=10**9, sink_keys=10**9)  # (warm)
    tracemalloc.start()
    try:
        out = la.linear_attention(X, X, X, FM, causal=causal, window=10**9, sink_keys=10**9)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    np.testing.assert_array_equal(out, exact)
    assert peak < 2**20  # (bytes: the inputs are 384 bytes each)


@pytest.mark.parametrize(
    ("option", "value"),
    [("evaluate_every", 0), ("steps", -1), ("patience", 0), ("num_features", 63),
     ("num_features", 0), ("learning_rate", float("nan")), ("steps", 2.5)],
)  # fmt: skip
def test_fit_layer_checks_its_options_first(option: str, value: object) -> None:
    """(``evaluate_every=0`` was a ZeroDivisionError after the work had started.)"""
    from linattn.transfer import LayerBatch, fit_layer

    q = RNG.standard_normal((1, 2, 8, 4))
    batch = LayerBatch(q, q, q, key_mask=np.ones((1, 8), bool))
    with pytest.raises(ValueError, match=f"^{option} must be"):
        fit_layer([batch], [batch], window=2, **{"num_features": 8, "steps": 2, option: value})


def test_with_exact_heads_names_heads() -> None:
    out = la.linear_attention(X, X, X, FM)
    with pytest.raises(TypeError, match="heads must be a sequence of query heads"):
        la.with_exact_heads(out, X, X, X, None)  # type: ignore[arg-type]


def test_torch_layers_check_window_and_sinks_when_made() -> None:
    """(``window=0`` was dropped: the layer ran without a window.)"""
    pytest.importorskip("torch")
    from linattn.torch import FastAttention

    for window, sinks in ((0, 0), (2.5, 0), (True, 0), (None, -1)):
        with pytest.raises(ValueError, match="must be a"):
            FastAttention(4, 8, window=window, sink_keys=sinks)


def test_multihead_attention_takes_per_call_causal_masks() -> None:
    """nn.TransformerDecoderLayer passes ``is_causal=True`` with a causal mask: the
    default map raised (OPRF needs fixed statistics for causal calls)."""
    torch = pytest.importorskip("torch")
    from linattn.torch import MultiheadAttention

    torch.manual_seed(0)
    layer = torch.nn.TransformerDecoderLayer(16, 2, dim_feedforward=32, dropout=0.0,
                                             batch_first=True)  # fmt: skip
    layer.self_attn = MultiheadAttention.from_torch(layer.self_attn)
    x = torch.randn(2, 6, 16)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(6)
    out = layer(x, x, tgt_mask=mask, tgt_is_causal=True)
    later = x.clone()
    later[:, -1] += 1.0  # (a later token changes no earlier output)
    again = layer(later, x, tgt_mask=mask, tgt_is_causal=True)
    assert torch.equal(out[:, :-1], again[:, :-1])
    assert not torch.equal(out[:, -1], again[:, -1])


def test_the_transformers_integration_names_what_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """(Without transformers, importing it was a bare ModuleNotFoundError.)"""
    import importlib
    import importlib.util
    import sys

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "transformers" else real(name, *a),
    )
    monkeypatch.delitem(sys.modules, "linattn.integrations.transformers._requires", raising=False)
    with pytest.raises(
        ModuleNotFoundError,
        match=r"needs (torch and )?transformers: pip install 'linattn\[transformers\]'",
    ):
        importlib.import_module("linattn.integrations.transformers._requires")
