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
    names = [executor.name for executor in _plan.EXECUTORS]
    # Every executor asked before the chosen one says why not, in the plan's order.
    assert [name for name, _ in plan.rejected] == names[: names.index(plan.executor)]
    assert all(why for _, why in plan.rejected) and plan.reason
    ran = _watch_executors(monkeypatch)
    out = la.linear_attention(q, k, v, fm, **options)
    assert ran == [plan.executor] and out.shape == (2, L, D)


def _watch_executors(monkeypatch) -> list[str]:
    """The names of the executors that run from now on, in order."""
    ran: list[str] = []
    for executor in _plan.EXECUTORS:

        def watched(call, scan, attend, executor=executor, run=executor.run):
            ran.append(executor.name)
            return run(call, scan, attend)

        monkeypatch.setattr(executor, "run", watched)
    return ran


#: The modules whose public functions are the compiled kernels' entry points.
ENTRY_MODULES = (
    "linattn_numba",
    "linattn_numba.cpu",
    "linattn_numba.cpu.bidirectional",
    "linattn_numba.cpu.causal",
    "linattn_numba.cpu.decode",
    "linattn_numba.cpu.fused_causal",
    "linattn_numba.cpu.fused_causal_backward",
    "linattn_numba.cpu.hybrid",
    "linattn_numba.cpu.window",
    "linattn_numba.libraries",
    "linattn_numba.torch_ops",
)


def _watch_kernels(monkeypatch) -> list[str]:
    """The compiled entry points called from now on (``module.function``), the causal
    scan's kernels (handed out by ``causal_kernel_for``) included."""
    import importlib

    called: list[str] = []

    def wrap(name, function):  # type: ignore[no-untyped-def]
        def entry(*args, **kwargs):  # type: ignore[no-untyped-def]
            called.append(name)
            result = function(*args, **kwargs)
            if name.endswith(("kernel_for", "backward_kernel")) and isinstance(result, tuple):
                kernel, *rest = result  # (kernel or None, reason)
                return (None if kernel is None else wrap(f"{name}()", kernel), *rest)
            if name.endswith("backward_kernel") and callable(result):
                return wrap(f"{name}()", result)
            return result

        return entry

    for module_name in ENTRY_MODULES:
        module = importlib.import_module(module_name)
        for name in getattr(module, "__all__", ()):
            function = getattr(module, name)
            if callable(function) and not isinstance(function, type):
                label = f"{module_name}.{name}"
                if name.endswith("status") or name in ("cpu_runtime",):
                    continue  # (reports, not kernels)
                monkeypatch.setattr(module, name, wrap(label, function))
    return called


#: What each compiled executor must reach (entry points, by the end of their names).
COMPILED = {
    "fused-causal": ("cpu.favor_causal", "torch_ops.causal_fused"),
    "fused-bidirectional": ("bidirectional.favor_bidirectional", "torch_ops.bidirectional"),
    "hybrid-causal-fused": ("hybrid.causal_forward",),
    "hybrid-window-fused": ("hybrid.bidirectional_forward",),
    "hybrid-global-fused": ("bidirectional.favor_bidirectional",),
    "decode": ("decode.decode_step",),
    "torch-kernels": ("hybrid.causal_forward", "window.banded_partial"),
}

#: (library, options, feature map kind): one call of every executor that NumPy and torch
#: CPU arrays reach.
RUNS = [
    ("numpy", {"causal": True}, "positive"),
    ("numpy", {}, "positive"),
    ("numpy", {"causal": True, "window": 4, "sink_keys": 2}, "positive"),
    ("numpy", {"window": 4, "sink_keys": 1}, "positive"),
    ("numpy", {"sink_keys": 2}, "positive"),
    ("numpy", {"causal": True, "window": 4}, None),
    ("numpy", {"window": 3, "sink_keys": 1}, None),
    ("numpy", {"causal": True}, "oprf"),
    ("numpy", {"causal": True, "window": 3}, "oprf"),
    ("numpy", {"causal": True, "state": True}, "positive"),
    ("torch", {"causal": True}, "positive"),
    ("torch", {}, "positive"),
    ("torch", {"causal": True, "window": 4, "sink_keys": 2}, "positive"),
    ("torch", {"window": 3}, None),
]


@pytest.mark.parametrize("backend", [None, "auto", "numba", "array_api"])
@pytest.mark.parametrize(("library", "options", "kind"), RUNS)
def test_for_every_backend_the_plan_is_the_code_that_runs(
    monkeypatch, library, options, kind, backend
) -> None:
    """For every executor and every ``backend=``, the executor the plan names runs, and
    the compiled kernels run exactly where the plan says: never under
    ``backend="array_api"`` (a window on NumPy arrays ran the compiled window kernel
    there), always under the compiled executors."""
    pytest.importorskip("numba")
    monkeypatch.delenv("LINATTN_BACKEND", raising=False)
    options = dict(options)
    fm = None if kind is None else la.FeatureMap(D, M, kind=kind, seed=0)
    q, k, v = _inputs()
    if kind == "oprf":  # (statistics fixed in advance: not a map the fused passes compute)
        fm = fm.calibrate(q, k)
    if options.pop("state", False):  # a decoding step after a prefill
        _, options["state"] = la.linear_attention(q, k, v, fm, causal=True, return_state=True)
        q, k, v = (x[:, -1:] for x in (q, k, v))
    if library == "torch":
        torch = pytest.importorskip("torch")
        q, k, v = (torch.from_numpy(x) for x in (q, k, v))
    options["backend"] = backend
    plan = la.plan_attention(q, k, v, fm, **options)
    ran = _watch_executors(monkeypatch)
    called = _watch_kernels(monkeypatch)
    out = la.linear_attention(q, k, v, fm, **options)
    assert ran[:1] == [plan.executor], plan
    assert tuple(out.shape) == (*q.shape[:-1], D)
    if backend == "array_api":
        assert plan.executor not in COMPILED and not plan.scan.compiled, plan
        assert called == [], (plan.executor, called)
    elif plan.executor in COMPILED:
        assert any(name.endswith(COMPILED[plan.executor]) for name in called), (plan, called)
    elif plan.executor == "hybrid-parts" and options.get("window") and library == "numpy":
        assert "linattn_numba.cpu.window.banded_partial" in called, (plan, called)
    if backend == "numba" and library == "numpy":
        assert called, plan  # (every NumPy call here has a compiled part)


def test_the_plan_prints_every_reason() -> None:
    q, k, v = _inputs()
    text = str(la.plan_attention(q, k, v, FM, causal=True, backend="array_api"))
    assert text.startswith("portable: ")
    assert "not fused-causal: backend='array_api'" in text
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
    for executor in _plan.EXECUTORS:
        assert f"{executor.name}: " in str(error.value)


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
        _dispatch.causal_plan(x, feature_map)


def test_causal_plan_and_plan_are_deprecated_aliases_of_the_scan_plan() -> None:
    q, k, v = _inputs()
    scan = la.plan_attention(q, k, v, FM, causal=True, backend="array_api").scan
    with pytest.warns(DeprecationWarning, match=r"plan_attention\(q, k, v, feature_map"):
        causal_plan = la.causal_plan
    assert causal_plan(q, FM, backend="array_api") == scan
    with pytest.warns(DeprecationWarning, match="linattn.Plan is deprecated"):
        assert isinstance(scan, la.Plan)
    assert "causal_plan" not in la.__all__ and "Plan" not in la.__all__
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        la.nothing  # noqa: B018


def test_plan_attention_checks_as_the_front_door_does() -> None:
    q, k, v = _inputs()
    with pytest.raises(TypeError, match=r"feature_map must be a linattn\.FeatureMap"):
        la.plan_attention(q, k, v, None, causal=True)
    with pytest.raises(ValueError, match="backend must be one of"):
        la.plan_attention(q, k, v, FM, backend="fast")
    with pytest.raises(TypeError, match="q must be an array"):
        la.plan_attention([1.0], k, v, FM)
