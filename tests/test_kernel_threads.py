"""The CPU kernels in real programs: forked children, thread pools, the compile cache and
small work (``linattn_numba._machinery``).

The fork and thread-pool cases run in a subprocess with a timeout, with the compile cache
off and on: on failure a kernel kills the process, hangs ``multiprocessing.Pool`` or
aborts the interpreter (as Numba's GNU OpenMP layer did after ``fork`` and its
``workqueue`` layer from several threads, while the kernels ran on Numba's
``parallel=True``), which must fail one test, not end the suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("numba")

import numba

import linattn as la
from linattn import cli
from linattn_numba import _cache, _machinery
from linattn_numba.cpu import fused_causal

ROOT = Path(__file__).resolve().parents[1]

#: Tiny shapes (compiling dominates); the parent forces the parallel variant, so that
#: its thread pool is running when it forks or hands work to threads.  The kernel is the
#: exact window's (``linattn_numba.cpu.window``): the same machinery (``Variants``, the
#: variant chosen per call, the pool) as every CPU kernel, at a tenth of the fused causal
#: pass's compile time, which each program pays again.
PROGRAM = """
import concurrent.futures, multiprocessing, sys
import numpy as np
import linattn as la

try:
    from linattn_numba import _cache, _machinery
    _machinery.SERIAL_WORK = 0
except ImportError:  # (a version without the serial variants)
    pass


def attend(seed):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((4, 24, 8)) for _ in range(3))
    return la.linear_attention(q, k, v, None, causal=True, window=4)


if __name__ == "__main__":
    seeds = list(range(8))
    expected = [attend(s) for s in seeds]
    from linattn_numba.cpu import window
    if window._forward.launches["parallel"] != len(seeds):
        sys.exit(f"the parallel window kernel did not run: {window._forward.launches}")
    if sys.argv[1] == "fork":
        with multiprocessing.get_context("fork").Pool(2) as pool:
            got = pool.map(attend, seeds)
    else:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            got = [y for _ in range(3) for y in pool.map(attend, seeds)]
    wrong = [i for i, (a, b) in enumerate(zip(got, expected * 3)) if not np.array_equal(a, b)]
    print("wrong:", wrong)
    sys.exit(1 if wrong else 0)
"""


@pytest.fixture(scope="module")
def cache_directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One compile cache for the programs below, empty at first: the first program with
    the cache on compiles into it, the next loads from it."""
    return tmp_path_factory.mktemp("numba-cache")


def _run(
    argv: list[str], env: dict[str, str], timeout: float, cache: Path | None
) -> subprocess.CompletedProcess[str]:
    """``argv`` in a fresh interpreter, with the compile cache in ``cache`` (``None``:
    off), whatever this process's setting."""
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    environment.pop("NUMBA_CACHE_DIR", None)
    environment.pop("LINATTN_BACKEND", None)  # (the kernel, whatever this process runs)
    environment[_machinery.CACHE_VARIABLE] = "0" if cache is None else str(cache)
    environment.update(env)
    try:
        return subprocess.run(
            [sys.executable, *argv], capture_output=True, text=True, env=environment,
            timeout=timeout, check=False, cwd=ROOT,
        )  # fmt: skip
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"{argv} did not finish in {timeout} s (hung): {error.stderr!r}")


@pytest.mark.parametrize("cache", ["on", "off"])
def test_forked_children_compute_like_their_parent(
    cache: str, cache_directory: Path, tmp_path: Path
) -> None:
    """A ``fork`` Pool after the parent ran the parallel kernel (GNU OpenMP killed the
    children and the pool hung)."""
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    directory = cache_directory if cache == "on" else None
    done = _run([str(script), "fork"], {}, timeout=240, cache=directory)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("cache", ["on", "off"])
def test_a_thread_pool_of_callers(cache: str, cache_directory: Path, tmp_path: Path) -> None:
    """Four threads calling the kernel at once (with Numba's ``workqueue`` layer, which
    is not thread-safe, this aborted the interpreter; the setting stays to show it is
    not used)."""
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    directory = cache_directory if cache == "on" else None
    env = {"NUMBA_THREADING_LAYER": "workqueue"}
    done = _run([str(script), "threads"], env, timeout=240, cache=directory)
    assert done.returncode == 0, done.stdout + done.stderr


STATE = 256 * 65  # one head's state entries at m = 256, d_v = 64


def test_small_work_runs_serial() -> None:
    assert _machinery.choose_variant(4, 1, STATE) == "serial"  # a one-token decode step
    assert _machinery.choose_variant(1, 10**6, STATE) == "serial"  # one head: no pool
    assert "small work" in str(_machinery.serial_reason(8, 1, STATE))
    large = _machinery.choose_variant(64, 4096, STATE)
    assert large == ("parallel" if _machinery.threads() > 1 else "serial")


def test_a_decode_step_launches_the_serial_variant() -> None:
    rng = np.random.default_rng(0)
    fm = la.FeatureMap(16, 32, seed=0)
    x = rng.standard_normal((4, 1, 16))
    before = dict(fused_causal._forward_fused.launches)
    la.linear_attention(x, x, x, fm, causal=True, backend="numba")
    after = fused_causal._forward_fused.launches
    assert after["serial"] == before.get("serial", 0) + 1
    assert after["parallel"] == before.get("parallel", 0)


def test_one_compiled_kernel_runs_both_variants(monkeypatch: pytest.MonkeyPatch) -> None:
    """Serial and parallel runs share one compiled kernel (``parallel=True`` compiled a
    second, through the parfor passes: 17.1 s against 11.4 s for the fused causal
    pass); the parallel run cuts the heads into shares, each on its own thread, and
    gives the serial run's results."""
    monkeypatch.setattr(_machinery, "threads", lambda: 3)
    rng = np.random.default_rng(1)
    fm = la.FeatureMap(8, 16, seed=0)
    q, k, v = (rng.standard_normal((7, 12, 8)) for _ in range(3))
    kernel = fused_causal._forward_fused
    ran: list[tuple[str, int]] = []
    dispatcher = kernel.dispatcher

    def recorded(*args: object) -> None:
        ran.append((threading.current_thread().name, args[0].shape[0]))  # type: ignore[attr-defined]
        dispatcher(*args)

    monkeypatch.setattr(kernel, "dispatcher", recorded)
    monkeypatch.setattr(_machinery, "SERIAL_WORK", 2**62)
    serial = la.linear_attention(q, k, v, fm, causal=True, backend="numba")
    assert ran == [(threading.current_thread().name, 7)]
    compiled = len(dispatcher.signatures)
    ran.clear()
    monkeypatch.setattr(_machinery, "SERIAL_WORK", 0)
    parallel = la.linear_attention(q, k, v, fm, causal=True, backend="numba")
    assert sorted(size for _, size in ran) == [2, 2, 3]  # (7 heads, 3 threads)
    names = [name for name, _ in ran]
    assert names[0] == threading.current_thread().name  # (the caller runs a share)
    assert all(name.startswith(_machinery.POOL_NAME) for name in names[1:])
    np.testing.assert_array_equal(parallel, serial)
    assert len(dispatcher.signatures) == compiled  # (no second compile for the parallel run)


def test_kernel_threads_follow_numba_num_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(numba.config, "NUMBA_NUM_THREADS", 1)
    assert _machinery.threads() == 1
    assert _machinery.serial_reason(64, 4096, STATE) == "one kernel thread"


def test_concurrent_kernels_leave_blas_threads_as_they_were() -> None:
    """The BLAS limit is process-wide: overlapping calls (thread pools) must restore it."""
    controller = _machinery._blas_controller()
    if controller is None:
        pytest.skip("threadpoolctl is not installed")
    original = [lib.num_threads for lib in controller.select(user_api="blas").lib_controllers]
    if max(original) < 2:
        pytest.skip("BLAS runs one thread here anyway")
    first, second = _machinery.single_threaded_blas(), _machinery.single_threaded_blas()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)  # (the first call ends while the second runs)
    pinned = [lib.num_threads for lib in controller.select(user_api="blas").lib_controllers]
    second.__exit__(None, None, None)
    restored = [lib.num_threads for lib in controller.select(user_api="blas").lib_controllers]
    assert max(pinned) == 1
    assert restored == original


@pytest.mark.parametrize("cache", [False, True])
def test_info_shows_the_kernel_threads_and_cache(
    cache: bool,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # (the setting is read at import)
    (tmp_path / "kernel.nbc").write_bytes(b"0" * 2**20)
    setting = (
        _cache.Setting(tmp_path, "NUMBA_CACHE_DIR")
        if cache
        else _cache.Setting(None, "off (LINATTN_NUMBA_CACHE=0)")
    )
    monkeypatch.setattr(_machinery, "CACHE_SETTING", setting)
    assert cli.main(["info", "--format", "json"]) == 0
    cpu_kernel = json.loads(capsys.readouterr().out)["kernels"]["numba-cpu"]
    assert cpu_kernel.startswith("available; ")
    assert f"{_machinery.threads()} kernel thread" in cpu_kernel
    if cache:
        assert f"compile cache on: {tmp_path} (NUMBA_CACHE_DIR; 1.0 MB; " in cpu_kernel
        assert f"clear: rm -rf '{tmp_path}'" in cpu_kernel
    else:
        assert "compile cache off (LINATTN_NUMBA_CACHE=0)" in cpu_kernel
