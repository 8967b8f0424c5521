"""``benchmarks/gpu_check.py``: the prepared first GPU run passes under the CUDA simulator.

The whole script runs as a user would start it (a subprocess, from outside the
repository, without ``PYTHONPATH``), with ``--simulator --tiny``; its JSON lines and
summary are checked.  The bootstrap (wheels, library paths), the NaN poisoning
and the section timeout are checked on their own.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

if importlib.util.find_spec("numba_cuda") is None:
    pytest.skip("numba-cuda is not installed", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_check = _load()


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def simulated_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("gpu-check")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["NUMBA_ENABLE_CUDASIM"] = "1"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--simulator", "--tiny", "--out", str(out)],
        cwd=out,  # not the repository: the script finds the root itself
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    return done, out


def test_simulated_run_passes_every_section(simulated_run) -> None:
    done, out = simulated_run
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    records = _records(out)
    sections = {r["check"]: r for r in records if r["section"] == "run"}
    for name in ("preflight", "correctness", "long", "timing"):
        assert sections[f"section {name}"]["ok"] is True, sections
        assert (out / f"{name}.log").is_file()
    assert not [r for r in records if r["ok"] is False]
    checks = {(r["section"], r["check"]) for r in records}
    for expected in [
        ("preflight", "probe kernel"),
        ("correctness", "forward float64"),
        ("correctness", "forward float32 run twice bit-identical"),
        ("correctness", "backward float32 vs torch float64 autograd"),
        ("correctness", "backward float32 run twice bit-identical"),
        ("correctness", "causality float32 bit-exact"),
        ("long", "long float32 vs host float64, worst head"),
        ("timing", "kernel forward"),
        ("timing", "kernel forward+backward"),
        ("timing", "kernel chunk_increments (fwd+bwd)"),
    ]:
        assert expected in checks, expected
    imported = {r["check"]: r["detail"] for r in records if r["check"].startswith("import ")}
    assert imported["import linattn"].startswith(str(ROOT)), imported  # this checkout's


def test_simulated_run_prints_the_summary_last(simulated_run) -> None:
    done, out = simulated_run
    tail = done.stdout[done.stdout.rindex("== summary") :]
    assert tail.rstrip().endswith("all checks passed")
    assert "timing (ms)" in tail
    assert (out / "summary.txt").read_text().strip().endswith("all checks passed")


def test_summary_fails_on_a_failed_check(tmp_path) -> None:
    lines = [
        {"section": "correctness", "check": "forward float32", "ok": True, "value": 1e-7},
        {"section": "correctness", "check": "causality float32 bit-exact", "ok": False},
    ]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert gpu_check.summary(tmp_path) == 1
    assert "1 check(s) failed" in (tmp_path / "summary.txt").read_text()


def test_a_section_past_its_timeout_is_killed_and_keeps_its_results(tmp_path) -> None:
    opts = gpu_check.argparse.Namespace(
        out=tmp_path, site=tmp_path / "site", tiny=True, simulator=True
    )
    env = gpu_check.section_env(opts.site, simulator=True)
    env.pop("PYTHONPATH")
    env["PYTHONPATH"] = str(ROOT)
    ok, seconds, detail = gpu_check.run_one("correctness", 6, opts, env)
    assert not ok and "timed out" in detail
    assert seconds < 30
    assert (tmp_path / "correctness.log").is_file()


def _wheel(folder: Path, name: str) -> Path:
    wheel = folder / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(f"{name}/__init__.py", "VALUE = 42\n")
        archive.writestr(f"{name}-1.0.dist-info/METADATA", f"Name: {name}\nVersion: 1.0\n")
        archive.writestr(f"{name}-1.0.dist-info/RECORD", "")
        archive.writestr(
            f"{name}-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\n"
        )
    return wheel


def test_missing_wheels_are_installed_into_the_site_folder(tmp_path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "linattn_fake_dependency")
    _wheel(wheels, "numpy")  # present already: left alone
    assert gpu_check.wheel_distribution(wheels / "numpy-1.0-py3-none-any.whl") == "numpy"
    site = tmp_path / "site"
    added = gpu_check.install_wheels(wheels, site, print)
    assert added == ["linattn_fake_dependency-1.0-py3-none-any.whl"]
    assert (site / "linattn_fake_dependency" / "__init__.py").is_file()
    assert not (site / "numpy").exists()


def test_nvidia_wheel_libraries_go_on_the_loader_path(tmp_path) -> None:
    site = tmp_path / "site"
    lib = site / "nvidia" / "cu13" / "lib"
    lib.mkdir(parents=True)
    (lib / "libnvrtc.so.13").write_bytes(b"")
    (site / "nvidia" / "cu13" / "include").mkdir()
    assert gpu_check.library_dirs(site) == [str(lib)]
    env = gpu_check.section_env(site, simulator=False)
    assert env["LD_LIBRARY_PATH"].split(os.pathsep)[0] == str(lib)
    paths = env["PYTHONPATH"].split(os.pathsep)
    assert paths[:2] == [str(ROOT), str(site)]


@pytest.mark.skipif(
    os.environ.get("NUMBA_ENABLE_CUDASIM") != "1", reason="needs NUMBA_ENABLE_CUDASIM=1"
)
def test_poisoned_outputs_start_as_nan() -> None:
    from linattn_numba import gpu

    lib = gpu.LIBRARIES["numpy"]
    try:
        gpu_check.Library("numpy").poison()
        x = lib.empty((2, 3), "float32", 0).copy_to_host()
        assert np.all(np.isnan(x))
    finally:
        vars(lib).pop("empty", None)
