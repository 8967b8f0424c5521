"""``linattn demo``, ``accuracy`` and ``bench``: check the options, run the study, report."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from linattn import _dispatch, _warm
from linattn._dispatch import Backend
from linattn.cli import _preflight as preflight
from linattn.cli import _report as report
from linattn.cli._accuracy import accuracy_study
from linattn.cli._backends import ArrayLibrary
from linattn.cli._benchmark import (
    METHODS,
    MODES,
    BenchSetup,
    benchmark,
    calibration_note,
    crossovers,
)
from linattn.cli._console import Console, progress
from linattn.cli._machine import machine_info
from linattn.cli._plans import plan_line

__all__ = ["accuracy", "bench", "causal_path", "demo"]


def causal_path(library: ArrayLibrary) -> str:
    """Who runs causal linear attention for this library: the plan's path and reason."""
    import numpy as np

    try:
        plan = _dispatch.causal_plan(library.asarray(np.zeros((1, 1))))
    except ValueError as error:
        return f"error: {error}"
    return f"{plan.path} ({plan.reason})"


def _machine_header(library: ArrayLibrary, extra: dict[str, str]) -> dict[str, str]:
    pairs = machine_info()
    pairs[library.name] = f"{library.version} on {library.device}"
    pairs["causal path"] = causal_path(library)
    pairs["plan"] = plan_line(library)
    pairs.update(extra)
    return pairs


def _accuracy_settings(args: argparse.Namespace, causal: bool) -> dict[str, str]:
    return {
        "data": f"L={args.length}, d={args.head_dim}, Q,K ~ {args.input_scale:g}·N(0,1), "
        f"V ~ N(0,1), data seed {args.data_seed}"
        + (f", anisotropy {args.anisotropy:g}" if args.anisotropy else ""),
        "attention": ("causal" if causal else "bidirectional")
        + f", {args.backend} {args.dtype}; reference: exact softmax, NumPy float64",
        "averaged over": f"{args.seeds} projection seeds (cells: mean ± standard error)",
        "slope": "least-squares slope of log(error) vs log(m); Monte Carlo gives -1 for MSE",
    }


def _bench_settings(setup: BenchSetup, library: ArrayLibrary) -> dict[str, str]:
    settings = {
        "workload": f"B={setup.batch}, H={setup.heads}, d={setup.head_dim}, "
        f"{setup.dtype}; linear: m={setup.num_features} {setup.kind} orthogonal features",
        "time": f"median of {setup.repeats} calls after a warm-up call (compilation excluded)",
        "peak memory": library.memory_method,
    }
    note = calibration_note(setup)
    if note is not None:
        settings["calibration"] = note
    return settings


def _bench_title(setup: BenchSetup, library: ArrayLibrary) -> str:
    return (
        f"{library.name} {setup.dtype} on {library.device}: B={setup.batch}, H={setup.heads}, "
        f"d={setup.head_dim}, m={setup.num_features}"
    )


def _run_accuracy(
    args: argparse.Namespace,
    library: ArrayLibrary,
    bar: Any,
    causal: bool,
    metrics: Sequence[str] = ("mse", "tv"),
    backend: Backend | None = None,
) -> list[Any]:
    task = bar.add_task(
        "accuracy vs m", total=len(args.estimators) * len(args.num_features) * args.seeds
    )
    return accuracy_study(
        library,
        args.estimators,
        args.num_features,
        length=args.length,
        head_dim=args.head_dim,
        input_scale=args.input_scale,
        anisotropy=args.anisotropy,
        draws=args.seeds,
        data_seed=args.data_seed,
        causal=causal,
        metrics=metrics,
        on_step=lambda: bar.advance(task),
        backend=backend,
    )


def _start_compiling(setup: BenchSetup) -> bool:
    """Start compiling the timed calls' kernels in the background (where
    :mod:`linattn._warm` applies and they are not ready): they compile while the
    accuracy study runs; whether any is compiling."""
    import numpy as np

    import linattn as la
    from linattn import _plan
    from linattn._call import normalise_call

    x = np.zeros((setup.batch, setup.heads, 256, setup.head_dim), setup.dtype)
    fm = la.FeatureMap(setup.head_dim, setup.num_features, seed=0)
    started = [
        _plan.start_compiling(normalise_call(x, x, x, fm, causal=causal))
        for causal in (False, True)
    ]
    return any(started)


def _run_bench(
    args: argparse.Namespace,
    library: ArrayLibrary,
    setup: BenchSetup,
    bar: Any,
    methods: Sequence[str] = METHODS,
    modes: Sequence[str] = MODES,
) -> list[Any]:
    task = bar.add_task(
        "time and memory vs L", total=len(args.lengths) * len(methods) * len(modes)
    )
    return benchmark(
        library,
        args.lengths,
        setup,
        methods=methods,
        modes=modes,
        on_step=lambda: bar.advance(task),
    )


def _wrote(console: Console, paths: Sequence[Path]) -> None:
    console.print("wrote: " + ", ".join(str(p) for p in paths))


def _emit(fmt: str, rows: Sequence[Any], payload: dict[str, Any]) -> bool:
    """Write CSV or JSON to standard output; False when the format is a table."""
    if fmt == "table":
        return False
    sys.stdout.write(report.csv_text(rows) if fmt == "csv" else report.json_text(payload))
    return True


def demo(args: argparse.Namespace) -> int:
    """``linattn demo``: the accuracy study, then time and memory against L."""
    from linattn.cli import _plots as plots

    start = time.perf_counter()
    preflight.needs_plotting("demo")
    preflight.check_estimators(args)
    setup = preflight.bench_setup(args)
    out = preflight.out_dir(args)
    library = preflight.library_for(args)
    bench_library = preflight.library_for(args, setup.dtype)
    preflight.check_accuracy_limits(args, library)
    preflight.check_bench_limits(args, setup, bench_library)
    console = Console()
    console.rule("linattn demo: FAVOR+ linear attention against exact softmax attention")
    console.print(report.key_value_table("Machine", _machine_header(bench_library, {})))
    # NumPy kernels compile in the background (linattn._warm): the timed ones start now,
    # the accuracy study runs on the array API meanwhile, and nothing is timed until
    # every background compile has ended (a compiling core slows what runs beside it).
    background = bench_library.name == "numpy" and _warm.mode() == "background"
    if background:
        _start_compiling(setup)
    with progress() as bar:
        phase = time.perf_counter()
        accuracy_rows = _run_accuracy(
            args, library, bar, causal=False, metrics=("mse",),
            backend="array_api" if background else None,
        )  # fmt: skip
        accuracy_seconds = time.perf_counter() - phase
        # (nothing is timed while a kernel compiles beside it)
        waited = _warm.wait() if background else 0.0
        phase = time.perf_counter()
        bench_rows = _run_bench(args, bench_library, setup, bar)
        bench_seconds = time.perf_counter() - phase
    found = crossovers(bench_rows)
    settings = _accuracy_settings(args, False)
    console.print(report.key_value_table("1. Accuracy (the seed experiment)", settings))
    console.print(
        report.accuracy_table(accuracy_rows, "mse", "Attention output MSE against exact softmax")
    )
    console.print(
        report.key_value_table("2. Speed and memory", _bench_settings(setup, bench_library))
    )
    for table in report.bench_tables(bench_rows, setup.repeats):
        console.print(table)
    console.print(report.crossover_table(found))
    title = _bench_title(setup, bench_library)
    paths = [
        plots.plot_accuracy(
            accuracy_rows, out / "accuracy.png", "Error of random-feature estimators"
        ),
        plots.plot_bench(bench_rows, found, out / "bench.png", title),
        plots.plot_demo(accuracy_rows, bench_rows, found, out / "demo.png", "linattn demo"),
        report.write_csv(accuracy_rows, out / "accuracy.csv"),
        report.write_csv(bench_rows, out / "bench.csv"),
    ]
    _wrote(console, paths)
    compiling = (
        f"; the kernels compiled in the background meanwhile, then {waited:.1f} s waiting for them"
        if background
        else ", including any first call's kernel compilation"
    )
    console.print(
        f"demo finished in {time.perf_counter() - start:.1f} s (accuracy study "
        f"{accuracy_seconds:.1f} s; speed and memory {bench_seconds:.1f} s{compiling})"
    )
    return 0


def accuracy(args: argparse.Namespace) -> int:
    """``linattn accuracy``: error of each estimator against exact softmax attention."""
    from linattn.cli import _plots as plots

    if args.model is not None:
        from linattn.cli import _model_accuracy

        if args.plot is not None:
            preflight.needs_plotting("accuracy --plot")
        return _model_accuracy.run(args)

    preflight.needs_plotting("accuracy")
    preflight.check_estimators(args)
    out = preflight.out_dir(args)
    library = preflight.library_for(args)
    preflight.check_accuracy_limits(args, library)
    with progress(args.format == "table") as bar:
        rows = _run_accuracy(args, library, bar, causal=args.causal)
    settings = _accuracy_settings(args, args.causal)
    payload = {"settings": settings, "results": [r.as_dict() for r in rows]}
    paths = [
        plots.plot_accuracy(rows, out / "accuracy.png", "Error of random-feature estimators"),
        report.write_csv(rows, out / "accuracy.csv"),
        report.write_json(payload, out / "accuracy.json"),
    ]
    if not _emit(args.format, rows, payload):
        console = Console()
        console.print(report.key_value_table("Accuracy study", settings))
        for metric, title in (
            ("mse", "Attention output MSE against exact softmax"),
            ("tv", "Total variation of attention rows against exact softmax"),
        ):
            console.print(report.accuracy_table(rows, metric, title))
        _wrote(console, paths)
    return 0


def bench(args: argparse.Namespace) -> int:
    """``linattn bench``: time and peak memory of exact and linear attention against L."""
    from linattn.cli import _plots as plots

    preflight.needs_plotting("bench")
    setup = preflight.bench_setup(args)
    out = preflight.out_dir(args)
    library = preflight.library_for(args)
    preflight.check_bench_limits(args, setup, library)
    header = _machine_header(library, _bench_settings(setup, library))
    with progress(args.format == "table") as bar, _warm.foreground():  # (timed: the kernels)
        rows = _run_bench(args, library, setup, bar, args.methods, args.modes)
    found = crossovers(rows)
    payload = {
        "machine": header,
        "results": [r.as_dict() for r in rows],
        "crossovers": [
            {"mode": c.mode, "quantity": c.quantity, "length": c.length, "text": c.text}
            for c in found
        ],
    }
    paths = [
        plots.plot_bench(rows, found, out / "bench.png", _bench_title(setup, library)),
        report.write_csv(rows, out / "bench.csv"),
        report.write_json(payload, out / "bench.json"),
    ]
    if not _emit(args.format, rows, payload):
        console = Console()
        console.print(report.key_value_table("linattn bench", header))
        for table in report.bench_tables(rows, setup.repeats):
            console.print(table)
        console.print(report.crossover_table(found))
        _wrote(console, paths)
    return 0
