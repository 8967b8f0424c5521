"""Compiling in the background (``linattn._warm``): a NumPy call whose kernels are not
compiled runs on the portable path, says so in its plan, and starts one background job;
a ready marker switches calls of that kind to the kernels; an explicit ``backend`` and
the ``foreground`` mode compile in the call.  One test runs a real background job.

The rest of the suite runs with ``LINATTN_COMPILE=foreground`` (tests/conftest.py).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("numba")

import linattn as la
from linattn import _dispatch, _warm
from linattn._call import normalise_call
from linattn.cli import _warm_job
from linattn_numba.cpu import window as window_kernels

ROOT = Path(__file__).resolve().parents[1]


def _window_call() -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(0)
    return tuple(rng.standard_normal((1, 2, 24, 8)) for _ in range(3))


@pytest.fixture
def background(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[Any]:
    """Background mode over an empty cache in ``tmp_path``; jobs recorded, not started."""
    started: list[Any] = []
    monkeypatch.setenv(_warm.VARIABLE, "background")
    monkeypatch.delenv(_dispatch.ENVIRONMENT_VARIABLE, raising=False)
    monkeypatch.setattr(_dispatch, "cache_directory", lambda: tmp_path)
    monkeypatch.setattr(_warm, "_start", lambda stem, call: started.append((stem, call)) or True)
    _warm.reset()
    yield started
    _warm.reset()


def test_the_mode_is_read_from_the_environment() -> None:
    assert _warm.mode({}) == "background"
    assert _warm.mode({"LINATTN_COMPILE": "Foreground"}) == "foreground"
    with pytest.raises(ValueError, match=r"\$LINATTN_COMPILE must be one of .* got 'later'"):
        _warm.mode({"LINATTN_COMPILE": "later"})


def test_a_cold_call_runs_portable_says_so_and_starts_one_job(
    background: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    q, k, v = _window_call()
    with monkeypatch.context() as foreground:
        foreground.setenv(_warm.VARIABLE, "foreground")
        warm = la.plan_attention(q, k, v, None, causal=True, window=4)
    plan = la.plan_attention(q, k, v, None, causal=True, window=4)
    assert background == []  # (a plan only explained starts nothing)
    assert (
        (plan.executor, plan.rejected)
        == (warm.executor, warm.rejected)
        == ("hybrid-parts", warm.rejected)
    )  # (the same executor, its window part on the array API)
    assert (warm.scan.backend, plan.scan.backend) == ("auto", "array_api")
    assert plan.scan.reason == _warm.REASON
    launches = sum(window_kernels._forward.launches.values())
    out = la.linear_attention(q, k, v, None, causal=True, window=4)
    again = la.linear_attention(q, k, v, None, causal=True, window=4)
    assert sum(window_kernels._forward.launches.values()) == launches  # (portable)
    assert len(background) == 1  # (one job per kind of call, per process)
    reference = la.linear_attention(q, k, v, None, causal=True, window=4, backend="array_api")
    np.testing.assert_array_equal(out, reference)
    np.testing.assert_array_equal(again, reference)


def test_a_ready_marker_switches_to_the_kernels(background: list[Any], tmp_path: Path) -> None:
    q, k, v = _window_call()
    la.linear_attention(q, k, v, None, causal=True, window=4)
    ((stem, _),) = background
    assert stem.parent == tmp_path / "warm"
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".ready").write_text("compiled\n")
    launches = sum(window_kernels._forward.launches.values())
    plan = la.plan_attention(q, k, v, None, causal=True, window=4)
    out = la.linear_attention(q, k, v, None, causal=True, window=4)
    assert plan.scan.backend == "auto"
    assert sum(window_kernels._forward.launches.values()) == launches + 1
    reference = la.linear_attention(q, k, v, None, causal=True, window=4, backend="array_api")
    np.testing.assert_allclose(out, reference, rtol=1e-12, atol=1e-12)


def test_explicit_backends_and_the_foreground_mode_compile_in_the_call(
    background: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    q, k, v = _window_call()
    launches = sum(window_kernels._forward.launches.values())
    la.linear_attention(q, k, v, None, causal=True, window=4, backend="numba")
    la.linear_attention(q, k, v, None, causal=True, window=4, backend="auto")
    assert sum(window_kernels._forward.launches.values()) == launches + 2
    assert background == []
    _warm.reset()  # (the kernel ran in this process: ready for later calls)
    monkeypatch.setenv(_warm.VARIABLE, "foreground")
    la.linear_attention(q, k, v, None, causal=True, window=4)
    assert sum(window_kernels._forward.launches.values()) == launches + 3
    assert background == []


def test_no_cache_no_background(background: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a compile cache a background process could not hand its kernels over."""
    monkeypatch.setattr(_dispatch, "cache_directory", lambda: None)
    q, k, v = _window_call()
    launches = sum(window_kernels._forward.launches.values())
    la.linear_attention(q, k, v, None, causal=True, window=4)
    assert sum(window_kernels._forward.launches.values()) == launches + 1
    assert background == []


def test_a_failed_job_is_marked_and_its_kind_compiles_in_the_call(
    background: list[Any], tmp_path: Path
) -> None:
    stem = tmp_path / "warm" / "job"
    stem.parent.mkdir()
    stem.with_suffix(".pending").write_text("1")
    with open(stem.with_suffix(".job"), "wb") as f:
        pickle.dump({"dtype": "float64", "shapes": {"q": (2, 3), "k": (2, 4), "v": (2, 3)},
                     "key_mask": None, "exact_key_mask": None, "feature_map": None,
                     "options": {"causal": True, "window": 2}}, f)  # fmt: skip
    assert _warm_job.main([str(stem)]) == 1
    assert "Error" in stem.with_suffix(".failed").read_text()
    assert not stem.with_suffix(".pending").exists() and not stem.with_suffix(".job").exists()
    assert not stem.with_suffix(".ready").exists()
    assert [p.suffix for p in stem.parent.iterdir()] == [".failed"]  # (no temporary left)


def test_the_job_of_a_long_call_is_cut_and_keeps_its_kind() -> None:
    x = np.zeros((2, 3, 5000, 8), np.float32)
    mask = np.ones((2, 1, 5000), bool)
    call = normalise_call(x, x, x, la.FeatureMap(8, 16, seed=0), causal=True, key_mask=mask)
    job = _warm._job(call)
    assert job["shapes"]["q"] == (2, 3, _warm.JOB_MAX_LENGTH, 8)
    assert job["key_mask"] == (2, 1, _warm.JOB_MAX_LENGTH)
    assert job["dtype"] == "float32" and job["options"]["causal"] is True


PROGRAM = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import numpy as np
    import linattn as la
    from linattn_numba.cpu import window

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 24, 8)) for _ in range(3))
    first = la.linear_attention(q, k, v, None, causal=True, window=4)
    assert sum(window._forward.launches.values()) == 0, "the first call waited"
    warm = Path(sys.argv[1]) / "warm"
    deadline = time.monotonic() + 240
    while not list(warm.glob("*.ready")):
        failed = list(warm.glob("*.failed"))
        assert not failed, failed[0].read_text()
        assert time.monotonic() < deadline, "no background compile finished in 240 s"
        time.sleep(0.2)
    later = la.linear_attention(q, k, v, None, causal=True, window=4)
    assert sum(window._forward.launches.values()) == 1, "the kernel did not run"
    np.testing.assert_allclose(later, first, rtol=1e-12, atol=1e-12)
    print("ok")
    """
)


def test_a_real_background_job_compiles_the_kernels_into_the_cache(tmp_path: Path) -> None:
    """The whole round: a fresh process over an empty cache runs portable, a detached
    job compiles (the exact window's kernel: about a second) and marks it ready, the
    next call runs the kernel."""
    cache = tmp_path / "cache"
    environment = {**os.environ, "PYTHONPATH": str(ROOT), _warm.VARIABLE: "background"}
    environment.pop("NUMBA_CACHE_DIR", None)
    environment.pop(_dispatch.ENVIRONMENT_VARIABLE, None)
    environment["LINATTN_NUMBA_CACHE"] = str(cache)
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM, str(cache)], capture_output=True, text=True,
        env=environment, timeout=300, check=False, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "ok"


def test_a_fused_executor_waiting_for_its_kernels_says_so(background: list[Any]) -> None:
    x = np.zeros((1, 2, 16, 8), np.float32)
    plan = la.plan_attention(x, x, x, la.FeatureMap(8, 16, seed=0), causal=True)
    reasons = dict(plan.rejected)
    assert plan.executor == "portable"
    assert reasons["fused-causal"] == _warm.REASON
    assert reasons["decode"] == "no state to continue"  # (asked before: its own words)
    assert "backend=" not in str(plan)


def test_linattn_compile_compiles_in_the_call(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``linattn compile`` (and ``linattn bench``) run their calls in the foreground:
    under the default mode they took the portable path and compiled nothing."""
    from linattn import cli
    from linattn.cli import _compile

    monkeypatch.setenv(_warm.VARIABLE, "background")
    seen: list[str] = []
    monkeypatch.setattr(
        _compile, "CALLS", {"probe": lambda q, k, v, fm: seen.append(_warm.mode())}
    )
    monkeypatch.setattr(_compile, "SIZES", {"small": (1, 1, 4, 2, 2)})
    assert cli.main(["compile", "--dtypes", "float64", "--format", "json"]) == 0
    capsys.readouterr()
    assert seen == ["foreground"]
    assert os.environ[_warm.VARIABLE] == "background"  # (restored)


def test_at_most_max_jobs_run_at_once(background: list[Any], tmp_path: Path) -> None:
    """Many kinds of calls start at most MAX_JOBS processes; the rest start later."""
    warm = tmp_path / "warm"
    warm.mkdir()
    for i in range(_warm.MAX_JOBS):
        (warm / f"other{i}.pending").write_text("1")
    q, k, v = _window_call()
    la.linear_attention(q, k, v, None, causal=True, window=4)
    assert background == []  # (slots full: portable, no job)
    for marker in warm.glob("*.pending"):
        marker.unlink()
    la.linear_attention(q, k, v, None, causal=True, window=4)
    assert len(background) == 1  # (a later call starts it)
