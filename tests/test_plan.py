"""The one plan (``linattn._plan``): which executor runs each call, why, and why not the
others; the front door runs exactly the executor the plan names."""

from __future__ import annotations

import os

import numpy as np
import pytest

import linattn as la
from linattn import _dispatch, _plan

D, M, L = 8, 16, 12

KERNELS = _dispatch.NUMBA_INSTALLED and os.environ.get("LINATTN_BACKEND", "auto") != "array_api"


def _inputs(dtype=np.float64):
    rng = np.random.default_rng(0)
    return [rng.normal(size=(2, L, D)).astype(dtype) for _ in range(3)]


FM = la.FeatureMap(D, M, seed=0)

#: (options, executor where the Numba kernels serve NumPy arrays, executor where not)
CASES = [
    ({"causal": True}, "fused-causal", "portable"),
    ({}, "fused-bidirectional", "portable"),
    ({"causal": True, "window": 4, "sink_keys": 2}, "hybrid-causal-fused", "hybrid-parts"),
    ({"window": 4, "sink_keys": 1}, "hybrid-window-fused", "hybrid-parts"),
    ({"sink_keys": 2}, "hybrid-global-fused", "hybrid-parts"),
    ({"causal": True, "window": 4, "feature_map": None}, "hybrid-parts", "hybrid-parts"),
    ({"backend": "array_api", "causal": True}, "portable", "portable"),
]


@pytest.mark.parametrize(("options", "compiled", "portable"), CASES)
def test_the_plan_names_the_executor_that_runs(monkeypatch, options, compiled, portable) -> None:
    options = dict(options)
    fm = options.pop("feature_map", FM)
    q, k, v = _inputs()
    plan = la.plan_attention(q, k, v, fm, **options)
    assert plan.executor == (compiled if KERNELS else portable)
    names = [name for name, _, _ in _plan.EXECUTORS]
    # Every executor asked before the chosen one says why not, in the plan's order.
    assert [name for name, _ in plan.rejected] == names[: names.index(plan.executor)]
    assert all(why for _, why in plan.rejected) and plan.reason
    ran = []
    for name, run in list(_plan._RUN.items()):

        def watched(call, chosen, attend, name=name, run=run):
            ran.append(name)
            return run(call, chosen, attend)

        monkeypatch.setitem(_plan._RUN, name, watched)
    out = la.linear_attention(q, k, v, fm, **options)
    assert ran == [plan.executor] and out.shape == (2, L, D)


def test_the_plan_prints_every_reason() -> None:
    q, k, v = _inputs()
    text = str(la.plan_attention(q, k, v, FM, causal=True, backend="array_api"))
    assert text.startswith("portable: ")
    assert "not fused-causal: no fused pass: backend='array_api'" in text
    assert "causal scan: array-api" in text


def test_decoding_steps_take_the_decode_executor() -> None:
    pytest.importorskip("numba")
    if not KERNELS:
        pytest.skip("LINATTN_BACKEND=array_api")
    q, k, v = _inputs(np.float32)
    _, state = la.linear_attention(q, k, v, FM, causal=True, return_state=True)
    step = [x[:, :1] for x in (q, k, v)]
    assert la.plan_attention(*step, FM, causal=True, state=state).executor == "decode"
    plan = la.plan_attention(*step, FM, causal=True, state=state, backend="array_api")
    assert plan.executor == "portable" and dict(plan.rejected)["decode"] == "backend='array_api'"


def test_no_executor_for_numba_lists_every_reason() -> None:
    xps = pytest.importorskip("array_api_strict")
    q = xps.asarray(np.zeros((2, L, D)))
    with pytest.raises(ValueError, match="backend='numba'") as error:
        la.plan_attention(q, q, q, FM, causal=True, backend="numba")
    for name, _, _ in _plan.EXECUTORS:
        assert f"{name}: " in str(error.value)


@pytest.mark.parametrize(
    ("x", "feature_map", "message"),
    [
        (None, FM, "x must be an array"),
        (np.zeros((4, D)), "positive", r"feature_map must be a linattn\.FeatureMap or None"),
        (np.zeros((4, D), dtype=np.int32), FM, "x must have a real floating dtype"),
    ],
)
def test_causal_plan_checks_its_arguments(x, feature_map, message) -> None:
    with pytest.raises(TypeError, match=message):
        la.causal_plan(x, feature_map)


def test_plan_attention_checks_as_the_front_door_does() -> None:
    q, k, v = _inputs()
    with pytest.raises(TypeError, match=r"feature_map must be a linattn\.FeatureMap"):
        la.plan_attention(q, k, v, None, causal=True)
    with pytest.raises(ValueError, match="backend must be one of"):
        la.plan_attention(q, k, v, FM, backend="fast")
    with pytest.raises(TypeError, match="q must be an array"):
        la.plan_attention([1.0], k, v, FM)
