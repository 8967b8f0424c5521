"""The ``linattn`` command line: every subcommand at tiny sizes, files written, bad options.

Commands run in-process through ``main([...])``; each returns its exit status.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("rich")
pytest.importorskip("matplotlib")

import linattn as la
from linattn import cli
from linattn.cli import _backends
from linattn.cli._accuracy import accuracy_study, parse_estimator, seed_data
from linattn.cli._backends import BackendUnavailable, load_library
from linattn.cli._benchmark import BenchRow, _crossing, crossovers

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _is_png(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == PNG_MAGIC


def test_demo_writes_tables_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "demo"
    status = cli.main(
        [
            "demo",
            "--out",
            str(out),
            "--seeds",
            "2",
            "--num-features",
            "8,16",
            "--estimators",
            "positive-iid,hyperbolic-orf",
            "--lengths",
            "16,32",
            "--repeats",
            "1",
        ]
    )
    captured = capsys.readouterr()
    printed = captured.out
    assert status == 0
    # Not a terminal: progress as lines on standard error (a pipe shows them as they come).
    assert "accuracy vs m: 0/8\n" in captured.err
    assert "time and memory vs L: 8/8 " in captured.err
    for name in ("accuracy.png", "bench.png", "demo.png"):
        assert _is_png(out / name), name
    for heading in ("Attention output MSE", "Bidirectional", "Causal", "Crossover"):
        assert heading in printed
    with (out / "bench.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert {(r["method"], r["mode"]) for r in rows} == {
        (method, mode) for method in ("exact", "linear") for mode in ("bidirectional", "causal")
    }
    assert {int(r["length"]) for r in rows} == {16, 32}


def test_accuracy_json_matches_direct_computation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status = cli.main(
        [
            "accuracy",
            "--out",
            str(tmp_path),
            "--estimators",
            "positive-orf",
            "--num-features",
            "16",
            "--length",
            "12",
            "--head-dim",
            "8",
            "--seeds",
            "1",
            "--input-scale",
            "0.5",
            "--data-seed",
            "3",
            "--format",
            "json",
        ]
    )
    assert status == 0
    results = json.loads(capsys.readouterr().out)["results"]
    mse = next(r for r in results if r["metric"] == "mse")
    q, k, v = seed_data(12, 8, 0.5, 3)
    feature_map = la.FeatureMap(8, 16, kind="positive", orthogonal=True, seed=0)
    expected = np.mean(
        (la.linear_attention(q, k, v, feature_map) - la.softmax_attention(q, k, v)) ** 2
    )
    assert mse["mean"] == pytest.approx(expected, rel=1e-9)
    assert mse["draws"] == 1
    assert _is_png(tmp_path / "accuracy.png")
    assert (tmp_path / "accuracy.csv").is_file()
    assert json.loads((tmp_path / "accuracy.json").read_text())["results"] == results


def test_accuracy_table_and_causal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["accuracy", "--out", str(tmp_path), "--num-features", "8,16", "--seeds", "2"]
    args += ["--length", "16", "--head-dim", "8", "--causal", "--estimators", "trigonometric-iid"]
    assert cli.main(args) == 0
    printed = capsys.readouterr().out
    assert "Total variation" in printed
    assert "causal" in printed
    assert "slope" in printed


def test_total_variation_is_zero_for_an_exact_kernel() -> None:
    """With q = 0 every kernel value is 1: each estimator's attention rows are exact."""
    rows = accuracy_study(
        load_library("numpy", "float64"),
        [parse_estimator("positive-iid")],
        [8],
        length=6,
        head_dim=4,
        input_scale=1e-12,
        draws=2,
    )
    tv = next(r for r in rows if r.metric == "tv")
    assert tv.mean < 1e-9


def test_bench_csv_and_skipped_exact(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status = cli.main(
        [
            "bench",
            "--out",
            str(tmp_path),
            "--lengths",
            "16,32",
            "--heads",
            "1",
            "--head-dim",
            "8",
            "--num-features",
            "16",
            "--repeats",
            "1",
            "--max-exact-length",
            "16",
            "--modes",
            "causal",
            "--format",
            "csv",
        ]
    )
    assert status == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [(r["length"], r["method"], r["mode"]) for r in rows] == [
        ("16", "exact", "causal"),
        ("16", "linear", "causal"),
        ("32", "exact", "causal"),
        ("32", "linear", "causal"),
    ]
    assert rows[2]["seconds"] == ""
    assert "skipped" in rows[2]["note"]
    assert float(rows[3]["seconds"]) > 0
    assert int(rows[3]["peak_bytes"]) > 0
    payload = json.loads((tmp_path / "bench.json").read_text())
    assert {"cpu", "cores", "numpy", "causal path", "workload"} <= set(payload["machine"])
    assert _is_png(tmp_path / "bench.png")


def test_bench_table_has_machine_header(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["bench", "--out", str(tmp_path), "--lengths", "8", "--heads", "1", "--head-dim", "4"]
    args += ["--num-features", "8", "--repeats", "1", "--methods", "linear"]
    assert cli.main(args) == 0
    printed = capsys.readouterr().out
    assert "cpu" in printed
    assert "peak memory" in printed
    assert "tracemalloc" in printed


def test_info(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["info"]) == 0
    printed = capsys.readouterr().out
    assert "numba-cpu" in printed
    assert "Array backends" in printed
    assert cli.main(["info", "--format", "json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert set(payload["kernels"]) == {"numba-cpu", "numba-cuda"}
    numpy_row = next(r for r in payload["backends"] if r["backend"] == "numpy")
    assert numpy_row["available"] == "yes"
    assert payload["versions"]["numpy"] == np.__version__


def test_compile_reports_each_kernel(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``linattn compile`` runs its calls and reports each kernel compiled (here one small
    kernel of the test's own, uncached: compiled on the first run, not on the second)."""
    pytest.importorskip("numba")
    from linattn.cli import _compile
    from linattn_numba import _cache, _machinery

    monkeypatch.setattr(_machinery, "CACHE_SETTING", _cache.Setting(None, "off (test)"))

    def double(x):  # type: ignore[no-untyped-def]
        return x * 2

    kernel = _machinery.jit()(double)
    monkeypatch.setattr(_compile, "CALLS", {"tiny call": lambda q, k, v, fm: kernel(q)})
    monkeypatch.setattr(_compile, "SIZES", {"small": (1, 1, 4, 2, 2)})
    assert cli.main(["compile", "--dtypes", "float64", "--format", "json"]) == 0
    captured = capsys.readouterr()
    payload = json.loads(captured.out)
    assert payload["kernels"].startswith("available; ") and "kernel thread" in payload["kernels"]
    (row,) = payload["calls"]
    assert (row["call"], row["size"], row["dtype"]) == ("tiny call", "small", "float64")
    (compiled,) = row["kernels"]
    assert compiled["kernel"].endswith("double")
    assert (compiled["dtype"], compiled["source"]) == ("float64", "compiled")
    assert "tiny call (small size): " in captured.err  # (progress, flushed)
    assert cli.main(["compile", "--dtypes", "float64"]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "tiny call (small size): " in printed
    assert "0 kernels compiled (0.0 s), 0 loaded from the cache" in printed


def test_python_dash_m() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "linattn", "--version"], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0
    assert la.__version__ in done.stdout


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        ([], "command"),
        (["demo", "--lengths", "8,x"], "--lengths"),
        (["demo", "--seeds", "0"], "--seeds"),
        (["accuracy", "--num-features", "0,8"], "--num-features"),
        (["accuracy", "--estimators", "bogus-orf"], "--estimators"),
        (["accuracy", "--estimators", "hyperbolic-orf", "--num-features", "7"], "--num-features"),
        (["accuracy", "--input-scale", "-1"], "--input-scale"),
        (["accuracy", "--dtype", "float16"], "--dtype"),
        (["bench", "--backend", "tensorflow"], "--backend"),
        (["bench", "--modes", "sideways"], "--modes"),
        (["bench", "--methods", ""], "--methods"),
        (["bench", "--kind", "elu", "--num-features", "16"], "--num-features"),
        (["bench", "--repeats", "-2"], "--repeats"),
        (["info", "--format", "yaml"], "--format"),
    ],
)
def test_bad_options_exit_2_naming_the_option(
    argv: list[str], option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(argv) == 2
    error = capsys.readouterr().err
    assert option in error
    assert "error" in error


def test_out_that_is_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert cli.main(["bench", "--out", str(blocker), "--lengths", "8"]) == 2
    assert "--out" in capsys.readouterr().err


def test_unavailable_backend_exits_2(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def unavailable(name: str, dtype: str) -> None:
        raise BackendUnavailable(f"{name} is installed but finds no GPU")

    monkeypatch.setattr(_backends, "load_library", unavailable)
    assert cli.main(["bench", "--backend", "cupy", "--out", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert "--backend" in error
    assert "no GPU" in error


def test_bad_environment_variable_exits_2(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("LINATTN_BACKEND", "gpu")
    assert cli.main(["accuracy", "--out", str(tmp_path), "--seeds", "1"]) == 2
    assert "$LINATTN_BACKEND" in capsys.readouterr().err


def test_crossing_is_interpolated_in_log_log() -> None:
    # ratio linear/exact falls from 2 to 1/2 between L=100 and L=400: crosses at 200.
    length, text = _crossing([(100, 2.0), (400, 0.5)])
    assert length == pytest.approx(200.0)
    assert "200" in text
    assert _crossing([(100, 0.5)])[0] is None
    assert "≤ 100" in _crossing([(100, 0.5)])[1]
    assert "> 400" in _crossing([(100, 2.0), (400, 1.5)])[1]
    # The whole table decides: a win at 256 that 512 takes back is no crossover (the
    # demo said "<= 256, linear wins at every length" beside its own 0.53x row).
    length, text = _crossing([(256, 0.9), (512, 1.9), (1024, 0.5)])
    assert length is not None and 512 < length < 1024
    assert text.endswith("(linear also won at 256, then lost)")
    assert _crossing([(256, 0.9), (512, 1.9)])[1] == (
        "> 512 (exact wins at the longest length measured; linear won at 256 only)"
    )


def test_crossovers_by_mode_and_quantity() -> None:
    rows = [
        BenchRow(100, "exact", "causal", 1.0, 100),
        BenchRow(100, "linear", "causal", 4.0, 25),
        BenchRow(400, "exact", "causal", 16.0, 1600),
        BenchRow(400, "linear", "causal", 1.0, 100),
    ]
    found = {(c.mode, c.quantity): c for c in crossovers(rows)}
    assert set(found) == {("causal", "time"), ("causal", "peak memory")}
    # time ratio 4 -> 1/16: log-linear crossing at 100 * 4**(log 4 / log 64) = 100 * 4**(1/3)
    assert found[("causal", "time")].length == pytest.approx(100 * 4 ** (1 / 3))
    assert found[("causal", "peak memory")].length is None


@pytest.mark.parametrize(
    ("text", "label"),
    [
        ("positive-iid", "positive-iid"),
        ("hyperbolic", "hyperbolic-orf"),
        (" positive-orf", "positive-orf"),
        ("hyperbolic_oprf-orf-rebalanced", "hyperbolic_oprf-orf-rebalanced"),
        ("oprf-rebalanced", "oprf-orf-rebalanced"),
    ],
)
def test_parse_estimator(text: str, label: str) -> None:
    assert parse_estimator(text).label == label


def test_rebalancing_needs_a_softmax_kind() -> None:
    with pytest.raises(ValueError, match="optionally followed by -rebalanced"):
        parse_estimator("random_relu-orf-rebalanced")


def test_accuracy_calibrates_and_tilts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Calibrated estimators run in the study; with a tilt, rebalancing undoes it exactly."""
    common = ["accuracy", "--out", str(tmp_path), "--num-features", "16", "--seeds", "2"]
    common += ["--length", "16", "--head-dim", "8", "--format", "json"]
    estimators = ["--estimators", "hyperbolic_oprf-orf-rebalanced"]
    assert cli.main([*common, *estimators, "--anisotropy", "1"]) == 0
    tilted = json.loads(capsys.readouterr().out)["results"]
    assert cli.main([*common, *estimators]) == 0
    plain = json.loads(capsys.readouterr().out)["results"]
    for a, b in zip(tilted, plain, strict=True):
        assert a["metric"] == b["metric"]
        assert a["mean"] == pytest.approx(b["mean"], rel=1e-8)


def test_fitted_slope_of_exact_power_law() -> None:
    from linattn.cli._accuracy import AccuracyRow, fitted_slope

    rows = [AccuracyRow("e", m, "mse", 3.0 / m, 0.0, 0.0, 1) for m in (8, 16, 64)]
    assert fitted_slope(rows, "e") == pytest.approx(-1.0)
    assert math.isnan(fitted_slope(rows[:1], "e"))


README = Path(__file__).resolve().parents[1] / "README.md"


def _readme_blocks() -> list[str]:
    text = README.read_text(encoding="utf-8")
    return re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)


@pytest.mark.parametrize("index", range(len(_readme_blocks())))
def test_readme_example_runs(index: int) -> None:
    source = _readme_blocks()[index]
    for library in ("torch", "jax", "cupy"):
        if f"import {library}" in source:
            module = pytest.importorskip(library)
            if library == "cupy" and module.cuda.runtime.getDeviceCount() == 0:
                pytest.skip("cupy needs a CUDA GPU")
    exec(compile(source, f"README.md block {index}", "exec"), {})


# -- requests that cannot run end in a message and exit status 2 -------------------------


def _error_of(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert cli.main(argv) == 2
    error = capsys.readouterr().err
    assert "Traceback" not in error
    return " ".join(error.split())


@pytest.mark.parametrize("kind", ["oprf", "hyperbolic_oprf"])
def test_bench_calibrates_oprf_kinds(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Causal OPRF needs fixed statistics: the benchmark calibrates on its own inputs."""
    args = ["bench", "--out", str(tmp_path), "--lengths", "16", "--heads", "1", "--head-dim"]
    args += ["4", "--num-features", "8", "--repeats", "1", "--kind", kind, "--format", "json"]
    assert cli.main(args) == 0
    payload = json.loads(capsys.readouterr().out)
    assert {(r["method"], r["mode"]) for r in payload["results"]} == {
        (method, mode) for method in ("exact", "linear") for mode in ("bidirectional", "causal")
    }
    assert all(r["seconds"] > 0 for r in payload["results"])
    assert (
        "calibrated on each length's generated queries and keys"
        in (payload["machine"]["calibration"])
    )


@pytest.mark.parametrize(
    ("argv", "option", "asked", "limit"),
    [
        (["--input-scale", "1e200"], "--input-scale", "1e+200", "709.8"),
        (["--anisotropy", "1000"], "--anisotropy", "1000", "709.8"),
        (["--input-scale", "20", "--dtype", "float32"], "--input-scale", "20", "88.7"),
    ],
)
def test_overflowing_inputs_exit_2_with_the_largest_allowed(
    argv: list[str],
    option: str,
    asked: str,
    limit: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    common = ["accuracy", "--out", str(tmp_path), "--seeds", "1", "--num-features", "8"]
    common += ["--length", "8", "--head-dim", "4", "--format", "json"]
    error = _error_of([*common, *argv], capsys)
    assert f"argument {option}: {asked} gives" in error
    assert limit in error
    largest = re.search(r"may be at most (\S+)$", error)
    assert largest is not None, error
    # The largest value the message allows runs, and gives finite errors.
    allowed = [*argv[:-1], largest.group(1)] if len(argv) == 2 else [option, largest.group(1)]
    allowed += argv[2:] if len(argv) > 2 else []
    assert cli.main([*common, *allowed]) == 0
    results = json.loads(capsys.readouterr().out)["results"]
    assert all(math.isfinite(r["mean"]) for r in results)


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["bench", "--lengths", "1000000000"], "--lengths"),
        (["bench", "--lengths", "1e9"], "--lengths"),
        (["bench", "--heads", "1e7"], "--heads"),
        (["bench", "--batch", "100000000000", "--lengths", "8"], "--batch"),
        (["accuracy", "--length", "10000000"], "--length"),
        (["demo", "--lengths", "10000000"], "--lengths"),
    ],
)
def test_sizes_beyond_memory_exit_2_before_allocating(
    argv: list[str], option: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    error = _error_of([*argv, "--out", str(tmp_path)], capsys)
    assert f"argument {option}: L=" in error
    assert re.search(r"needs about [\d.]+ [GPTE]iB", error), error
    assert "of available host memory" in error


def test_memory_check_uses_what_is_available(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from linattn.cli import _preflight

    monkeypatch.setattr(_preflight, "available_memory", lambda: (2**20, "test memory"))
    args = ["bench", "--out", str(tmp_path), "--lengths", "64,1024", "--heads", "2"]
    error = _error_of(args, capsys)
    assert "argument --lengths: L=1,024 with B=1, H=2, d=64, m=256 in float32" in error
    assert "more than the 1.0 MiB of test memory" in error


def test_available_memory_without_psutil(monkeypatch: pytest.MonkeyPatch) -> None:
    from linattn.cli._machine import available_memory

    if not Path("/proc/meminfo").is_file():
        pytest.skip("needs /proc/meminfo")
    monkeypatch.setitem(sys.modules, "psutil", None)
    found, source = available_memory()
    assert found is not None and found > 0
    assert "MemAvailable" in source


def test_info_keeps_the_brackets_of_install_hints(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from linattn import _dispatch

    hint = "numba-cuda is not installed; install linattn[cuda]"
    monkeypatch.setattr(_dispatch, "kernel_status", lambda: {"numba-cpu": "x", "numba-cuda": hint})
    assert cli.main(["info"]) == 0
    assert "install linattn[cuda]" in " ".join(capsys.readouterr().out.split())


BLOCK_IMPORTS = """
import importlib.abc, runpy, sys

class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ImportError(f"No module named {{name!r}} (blocked by the test)")
        return None

sys.meta_path.insert(0, Blocker())
sys.argv = ["linattn", *{argv!r}]
runpy.run_module("linattn", run_name="__main__")
"""


def _run_without(modules: set[str], argv: list[str]) -> subprocess.CompletedProcess[str]:
    code = BLOCK_IMPORTS.format(blocked=modules, argv=argv)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=300
    )


def test_info_with_the_base_install_only() -> None:
    """No rich, matplotlib, psutil, threadpoolctl or numba: plain text and install hints."""
    optional = {"rich", "matplotlib", "psutil", "threadpoolctl", "numba", "linattn_numba"}
    done = _run_without(optional, ["info"])
    assert done.returncode == 0, done.stderr
    printed = done.stdout
    assert "Array backends" in printed
    assert re.search(r"^backend +available +device", printed, flags=re.MULTILINE), printed
    assert "numba is not installed; install linattn[numba]" in printed
    assert "install linattn[cuda]" in printed


def test_plotting_commands_without_matplotlib_exit_2(tmp_path: Path) -> None:
    done = _run_without({"matplotlib"}, ["bench", "--out", str(tmp_path), "--lengths", "8"])
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert 'pip install "linattn[cli]"' in done.stderr


def test_the_library_never_imports_the_cli() -> None:
    code = "import sys, linattn; print(sorted(m for m in sys.modules if 'cli' in m))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "linattn.cli" not in done.stdout


def test_convert_names_its_bad_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing.txt"
    error = _error_of(["convert", "--model", "minilm", "--texts", str(missing)], capsys)
    assert f"--texts {missing}" in error
    one = tmp_path / "one.txt"
    one.write_text("a single text\n")
    error = _error_of(["convert", "--model", "minilm", "--texts", str(one)], capsys)
    assert "needs at least 2 non-empty lines" in error
    error = _error_of(
        ["convert", "--model", "minilm", "--texts", str(one), "--window", "0"], capsys
    )
    assert "--window" in error
    error = _error_of(
        ["convert", "--model", "minilm", "--texts", str(one), "--sink-keys", "-1"], capsys
    )
    assert "--sink-keys" in error
    folder = tmp_path / "empty"
    folder.mkdir()
    error = _error_of(["accuracy", "--model", "minilm", "--fitted", str(folder)], capsys)
    assert f"--fitted {folder}" in error


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"--num-features": "63"}, "--num-features must be an even integer"),
        ({"--out": "FILE"}, "must be a folder"),
        ({"--model-out": "FILE"}, "--model-out"),
        ({"--texts": "LATIN1"}, "must be UTF-8 text"),
    ],
)  # fmt: skip
def test_convert_names_a_bad_option_before_any_work(
    change: dict[str, str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """(Each ended in a traceback, two of them after a layer had been fitted.)"""
    texts = tmp_path / "texts.txt"
    texts.write_text("one text\nanother text\n")
    latin = tmp_path / "latin1.txt"
    latin.write_bytes(b"\xff is no UTF-8\nsecond\n")
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    values = {"--texts": str(texts), "--out": str(tmp_path / "out"), "--num-features": "8"}
    values.update(
        {k: {"FILE": str(a_file), "LATIN1": str(latin)}.get(v, v) for k, v in change.items()}
    )
    argv = ["convert", "--model", "minilm", *(x for pair in values.items() for x in pair)]
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_accuracy_takes_a_texts_file_and_a_fitted_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``accuracy --texts`` takes a file as ``convert --texts`` does (a count otherwise),
    and ``--fitted`` the folder or the file ``convert`` printed; each is read, and its
    mistakes named, before the model loads."""
    absent = tmp_path / "absent-model"
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    error = _error_of(["accuracy", "--model", str(absent), "--texts", str(empty)], capsys)
    assert f"--texts {empty}: needs at least 1 non-empty line; got 0" in error
    texts = tmp_path / "texts.txt"
    texts.write_text("one held-out text\n")
    error = _error_of(["accuracy", "--model", str(absent), "--texts", str(texts)], capsys)
    assert f"--model {absent}" in error  # (the texts were fine)
    not_maps = tmp_path / "fitted.safetensors"
    not_maps.write_bytes(b"not a safetensors file")
    for given in (tmp_path, not_maps):  # the folder, or the file itself
        error = _error_of(["accuracy", "--model", str(absent), "--fitted", str(given)], capsys)
        assert f"--fitted {given}: path must be a linattn fitted-maps file" in error
