"""A hypothesis fuzz of the entry points (``nox -s fuzz``; not in the default run).

Bad and extreme arguments, padding poisoned with NaN, inf and 1e300, empty and one-token
shapes, every ``backend=``, random, fitted and no feature maps, windows and sinks, on
NumPy arrays and torch tensors (``linear_attention``, ``plan_attention`` and
``linattn.torch.fitted_attention``, dense and library).  Each case must either raise a
``TypeError`` or ``ValueError`` from every entry point alike (``plan_attention`` and
``linear_attention`` with the same message), or return outputs whose real rows are
finite, the same on every path (the compiled kernels against the array API), and the
same with the padding poisoned.  No crash, no wrong answer, no silent NaN.

It runs where ``LINATTN_FUZZ=1`` (the session sets it); ``LINATTN_FUZZ_EXAMPLES`` sets
the number of cases (default 10,000).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

if not os.environ.get("LINATTN_FUZZ"):
    pytest.skip("the fuzz runs in its own session: nox -s fuzz", allow_module_level=True)
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import linattn as la  # noqa: E402

EXAMPLES = int(os.environ.get("LINATTN_FUZZ_EXAMPLES", "10000"))
pytestmark = pytest.mark.filterwarnings(
    "ignore:invalid value:RuntimeWarning", "ignore:overflow:RuntimeWarning",
    "ignore:divide by zero:RuntimeWarning",
)  # fmt: skip

COUNTS = st.one_of(
    st.none(), st.integers(-1, 12), st.sampled_from([2.5, True, "3", 10**9])
)  # fmt: skip
SINKS = st.one_of(st.integers(-1, 12), st.sampled_from([1.5, 10**9]))
POISON = st.sampled_from([np.nan, np.inf, -np.inf, 1e300])


@st.composite
def cases(draw: Any) -> dict[str, Any]:
    dtype = draw(st.sampled_from(["float32", "float64"]))
    batch = draw(st.integers(1, 2))
    heads = draw(st.integers(1, 2))
    length = draw(st.integers(0, 9))
    d = draw(st.integers(1, 4))
    dv = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    q, k, v = (
        rng.standard_normal((batch, heads, length, width)).astype(dtype) * 2
        for width in (d, d, dv)
    )
    kind = draw(st.sampled_from(["positive", "hyperbolic", "fitted", "none"]))
    m = draw(st.integers(1, 4)) * 2
    if kind == "fitted":
        weight = rng.standard_normal((heads, d, m // 2)) * draw(st.sampled_from([0.1, 1, 30]))
        fm = la.FeatureMap.fitted(weight, tied=True, far_weight=draw(st.sampled_from([0, 0.5])))
    elif kind == "none":
        fm = None
    else:
        fm = la.FeatureMap(d, m, kind=kind, seed=seed)
    pad = draw(st.integers(0, max(0, length - 1)))
    mask = None
    if draw(st.booleans()) and length:
        mask = np.ones((batch, 1, length), bool)
        mask[0, :, length - pad :] = False
    return {
        "arrays": (q, k, v),
        "feature_map": fm,
        "options": {
            "causal": draw(st.booleans()),
            "window": draw(COUNTS),
            "sink_keys": draw(SINKS),
            "key_mask": mask,
            "chunk_size": draw(st.sampled_from([None, 1, 3, 0])),
        },
        "pad": pad if mask is not None else 0,
        "poison": draw(POISON),
        "torch": draw(st.booleans()),
    }


def _outcome(f: Any, *args: Any, **options: Any) -> tuple[str, Any]:
    try:
        return "ok", f(*args, **options)
    except (TypeError, ValueError) as error:
        return "error", (type(error), str(error))


def _real_rows(out: Any, pad: int, mask: Any) -> np.ndarray:
    out = np.asarray(out, dtype=np.float64)
    if mask is None or pad == 0:
        return out
    return np.concatenate([out[0, :, : out.shape[2] - pad].ravel(), out[1:].ravel()])


@settings(
    max_examples=EXAMPLES, deadline=None, derandomize=True,
    suppress_health_check=list(HealthCheck),
)  # fmt: skip
@given(cases())
def test_every_entry_point_errs_alike_or_answers_alike(case: dict[str, Any]) -> None:
    q, k, v = case["arrays"]
    fm, options = case["feature_map"], case["options"]
    planned = _outcome(la.plan_attention, q, k, v, fm, **options)
    auto = _outcome(la.linear_attention, q, k, v, fm, **options)
    hypothesis.event(f"{auto[0]}: {planned[1].executor if planned[0] == 'ok' else 'rejected'}")
    if auto[0] == "error":
        assert planned == auto  # (the same error, before any plan)
        return
    assert planned[0] == "ok", planned
    tolerance = 2e-3 if q.dtype == np.float32 else 1e-8
    portable = la.linear_attention(q, k, v, fm, backend="array_api", **options)
    real = _real_rows(auto[1], case["pad"], options["key_mask"])
    assert np.isfinite(real).all(), "a real row is not finite"
    np.testing.assert_allclose(real, _real_rows(portable, case["pad"], options["key_mask"]),
                               rtol=tolerance, atol=tolerance)  # fmt: skip
    if case["pad"]:
        poisoned = [x.copy() for x in (q, k, v)]
        for x in poisoned:
            x[0, :, x.shape[2] - case["pad"] :] = case["poison"]
        again = la.linear_attention(*poisoned, fm, **options)
        np.testing.assert_allclose(_real_rows(again, case["pad"], options["key_mask"]), real,
                                   rtol=tolerance, atol=tolerance)  # fmt: skip
    if case["torch"]:
        torch = pytest.importorskip("torch")
        tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
        mask = options["key_mask"]
        torch_options = {**options, "key_mask": None if mask is None else torch.from_numpy(mask)}
        out = la.linear_attention(tq, tk, tv, fm, **torch_options)
        np.testing.assert_allclose(_real_rows(out.numpy(), case["pad"], mask), real,
                                   rtol=tolerance, atol=tolerance)  # fmt: skip
        if fm is not None and fm.parameters is not None:
            from linattn.torch import fitted_attention

            p = fm.parameters
            for dense in (True, False):
                got = fitted_attention(
                    tq, tk, tv, torch.from_numpy(np.array(p.query_weight)),
                    torch.from_numpy(np.array(p.query_bias)), tied=True,
                    far_weight=torch.from_numpy(np.array(p.far_weight)), dense=dense,
                    **{n: x for n, x in torch_options.items() if n != "chunk_size"},
                    chunk_size=options["chunk_size"] if not dense else None,
                )  # fmt: skip
                np.testing.assert_allclose(_real_rows(got.detach().numpy(), case["pad"], mask),
                                           real, rtol=tolerance, atol=tolerance)  # fmt: skip
