"""``linattn``: the command line (``demo``, ``accuracy``, ``bench``, ``info``).

``linattn demo`` is the main job: in under a minute on a laptop-class CPU it shows
how close FAVOR+ comes to exact softmax attention as the number of random
features grows, and how its time and memory grow with sequence length next to
exact attention.  Every option has a default; a bad option prints a message that
names it and exits with status 2.

Needs the ``cli`` extra (``pip install "linattn[cli]"``: rich, matplotlib, psutil).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import linattn as la
from linattn import _dispatch
from linattn._cli_backends import (
    ARRAY_LIBRARIES,
    ArrayLibrary,
    BackendUnavailable,
    import_optional,
    load_library,
    machine_info,
    package_version,
)
from linattn._cli_studies import (
    METHODS,
    MODES,
    BenchSetup,
    Estimator,
    accuracy_study,
    benchmark,
    crossovers,
    parse_estimator,
)

__all__ = ["build_parser", "main"]

DEFAULT_OUT = "linattn-demo"
DEFAULT_ESTIMATORS = "positive-iid,positive-orf,hyperbolic-iid,hyperbolic-orf,trigonometric-orf"
DEFAULT_NUM_FEATURES = "32,64,128,256,512"


class UsageError(Exception):
    """A bad option found after parsing: ``option`` and what is wrong with it."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(f"argument {option}: {message}")


# -- option types (argparse turns ArgumentTypeError into "argument --x: message") ------


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (value > 0 and value < float("inf")):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (value >= 0 and value < float("inf")):
        raise argparse.ArgumentTypeError(f"expected a non-negative number, got {text!r}")
    return value


def _int_list(text: str) -> list[int]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive integers, got {text!r}"
        )
    try:
        values = [int(item) for item in items]
    except ValueError:
        values = [0]
    if min(values) < 1:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive integers, got {text!r}"
        )
    return sorted(set(values))


def _choice_list(choices: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        items = [item.strip() for item in text.split(",") if item.strip()]
        bad = [item for item in items if item not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated subset of {', '.join(choices)}, got {text!r}"
            )
        return list(dict.fromkeys(items))

    return parse


def _estimator_list(text: str) -> list[Estimator]:
    items = [item for item in text.split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected comma-separated estimators, got {text!r}")
    try:
        return list(dict.fromkeys(parse_estimator(item) for item in items))
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


# -- the parser ------------------------------------------------------------------


def _add_out(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(DEFAULT_OUT),
        metavar="DIR",
        help=f"folder for PNG plots and data files (default: ./{DEFAULT_OUT})",
    )


def _add_backend(parser: argparse.ArgumentParser, dtype: str | None) -> None:
    parser.add_argument(
        "--backend",
        choices=ARRAY_LIBRARIES,
        default="numpy",
        help="array library for the inputs (default: numpy; causal attention then runs "
        "on the Numba CPU kernel when it is installed)",
    )
    if dtype is None:
        parser.set_defaults(dtype="float64")
        return
    parser.add_argument(
        "--dtype",
        choices=("float32", "float64"),
        default=dtype,
        help=f"floating dtype of the inputs (default: {dtype})",
    )


def _add_accuracy_options(
    parser: argparse.ArgumentParser, *, seeds: int, full: bool = True
) -> None:
    parser.add_argument(
        "--estimators",
        type=_estimator_list,
        default=_estimator_list(DEFAULT_ESTIMATORS),
        metavar="LIST",
        help="comma-separated KIND-orf or KIND-iid (orthogonal or iid projections), "
        f"KIND one of {', '.join(_random_kinds())} (default: {DEFAULT_ESTIMATORS})",
    )
    parser.add_argument(
        "--num-features",
        type=_int_list,
        default=_int_list(DEFAULT_NUM_FEATURES),
        metavar="LIST",
        help="feature counts m, equal cost for every estimator: hyperbolic and "
        f"trigonometric use m/2 projection rows (default: {DEFAULT_NUM_FEATURES})",
    )
    parser.add_argument(
        "--seeds",
        type=_positive_int,
        default=seeds,
        metavar="N",
        help=f"projection draws averaged, seeds 0..N-1 (default: {seeds})",
    )
    if not full:
        parser.set_defaults(input_scale=0.3, anisotropy=0.0, length=64, head_dim=32, data_seed=0)
        return
    parser.add_argument(
        "--input-scale",
        type=_positive_float,
        default=0.3,
        metavar="S",
        help="queries and keys are S * N(0, 1) (default: 0.3, the seed experiment)",
    )
    parser.add_argument(
        "--anisotropy",
        type=_non_negative_float,
        default=0.0,
        metavar="A",
        help="query coordinate l scaled by exp(A z_l), key coordinate l by exp(-A z_l), "
        "z ~ N(0, 1): unbalanced per-coordinate scales, same logits (default: 0)",
    )
    parser.add_argument(
        "--length", type=_positive_int, default=64, metavar="L", help="tokens (default: 64)"
    )
    parser.add_argument(
        "--head-dim",
        type=_positive_int,
        default=32,
        metavar="D",
        help="head dimension (default: 32)",
    )
    parser.add_argument(
        "--data-seed",
        type=_non_negative_int,
        default=0,
        metavar="SEED",
        help="seed of the data Q, K, V (default: 0)",
    )


def _add_bench_options(
    parser: argparse.ArgumentParser, *, lengths: str, heads: int, repeats: int, full: bool = True
) -> None:
    defaults = BenchSetup()
    parser.add_argument(
        "--lengths",
        type=_int_list,
        default=_int_list(lengths),
        metavar="LIST",
        help=f"sequence lengths L (default: {lengths})",
    )
    parser.add_argument(
        "--repeats",
        type=_positive_int,
        default=repeats,
        metavar="N",
        help=f"timed calls per point, best kept (default: {repeats})",
    )
    parser.add_argument(
        "--max-exact-length",
        type=_positive_int,
        default=defaults.max_exact_length,
        metavar="L",
        help="skip exact attention above this length; it needs L x L memory per head "
        f"(default: {defaults.max_exact_length})",
    )
    if not full:
        parser.set_defaults(
            batch=defaults.batch,
            heads=heads,
            bench_head_dim=defaults.head_dim,
            bench_num_features=defaults.num_features,
            kind=defaults.kind,
            bench_dtype=defaults.dtype,
        )
        return
    parser.add_argument(
        "--batch", type=_positive_int, default=defaults.batch, help="batch size (default: 1)"
    )
    parser.add_argument(
        "--heads", type=_positive_int, default=heads, help=f"attention heads (default: {heads})"
    )
    parser.add_argument(
        "--head-dim",
        dest="bench_head_dim",
        type=_positive_int,
        default=defaults.head_dim,
        metavar="D",
        help=f"head dimension (default: {defaults.head_dim})",
    )
    parser.add_argument(
        "--num-features",
        dest="bench_num_features",
        type=_positive_int,
        default=defaults.num_features,
        metavar="M",
        help=f"random features of linear attention (default: {defaults.num_features})",
    )
    parser.add_argument(
        "--kind",
        choices=list(la.KINDS),
        default=defaults.kind,
        help=f"feature kind of linear attention (default: {defaults.kind})",
    )


def _random_kinds() -> list[str]:
    return [kind for kind, (random, _) in la.KINDS.items() if random]


def build_parser() -> argparse.ArgumentParser:
    """The ``linattn`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="linattn",
        description="Performer-style linear attention (FAVOR+): demo, accuracy study, "
        "benchmarks and installation info.",
    )
    parser.add_argument("--version", action="version", version=f"linattn {la.__version__}")
    commands = parser.add_subparsers(title="commands", dest="command", required=True)

    demo = commands.add_parser(
        "demo",
        help="the main job: accuracy vs m, time and memory vs L, with plots (< 1 minute)",
        description="Approximation error of each estimator against exact softmax attention "
        "as m grows (the seed experiment), then time and peak memory of exact vs FAVOR+ "
        "(bidirectional and causal) as L grows, with the crossover length.",
    )
    _add_out(demo)
    _add_backend(demo, None)
    _add_accuracy_options(demo, seeds=20, full=False)
    _add_bench_options(demo, lengths="256,512,1024,2048,4096", heads=2, repeats=2, full=False)
    demo.set_defaults(run=_demo, parser=demo)

    accuracy = commands.add_parser(
        "accuracy",
        help="error of random-feature estimators against exact softmax attention",
        description="Attention output MSE and total variation of attention rows against "
        "exact softmax attention (NumPy float64 reference), mean and standard error over "
        "projection seeds, for each estimator and feature count.",
    )
    _add_out(accuracy)
    _add_backend(accuracy, "float64")
    _add_accuracy_options(accuracy, seeds=50)
    accuracy.add_argument("--causal", action="store_true", help="causal attention")
    _add_format(accuracy)
    accuracy.set_defaults(run=_accuracy, parser=accuracy)

    bench = commands.add_parser(
        "bench",
        help="time and peak memory vs L: exact vs linear, bidirectional and causal",
        description="Time (best of --repeats) and peak memory of exact softmax attention and "
        "linear attention for each sequence length, with the machine in the header. Writes "
        "bench.csv, bench.json and bench.png to --out.",
    )
    _add_out(bench)
    _add_backend(bench, "float32")
    _add_bench_options(bench, lengths="512,1024,2048,4096,8192", heads=8, repeats=3)
    bench.add_argument(
        "--methods",
        type=_choice_list(METHODS),
        default=list(METHODS),
        metavar="LIST",
        help="comma-separated subset of exact,linear (default: both)",
    )
    bench.add_argument(
        "--modes",
        type=_choice_list(MODES),
        default=list(MODES),
        metavar="LIST",
        help="comma-separated subset of bidirectional,causal (default: both)",
    )
    bench.add_argument(
        "--seed",
        type=_non_negative_int,
        default=0,
        help="seed of data and projection (default: 0)",
    )
    _add_format(bench)
    bench.set_defaults(run=_bench, parser=bench)

    info = commands.add_parser(
        "info",
        help="versions, array backends and compiled kernels, and why one is unavailable",
    )
    _add_format(info, ("table", "json"))
    info.set_defaults(run=_info, parser=info)
    return parser


def _add_format(
    parser: argparse.ArgumentParser, choices: Sequence[str] = ("table", "csv", "json")
) -> None:
    parser.add_argument(
        "--format",
        choices=choices,
        default="table",
        help="what goes to standard output (default: table)",
    )


# -- shared pieces ---------------------------------------------------------------


def _console(stderr: bool = False) -> Any:
    from rich.console import Console

    return Console(stderr=stderr, highlight=False)


@contextlib.contextmanager
def _progress(enabled: bool = True) -> Iterator[Any]:
    """A rich progress bar on standard error (shown only on a terminal)."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=_console(stderr=True),
        transient=True,
        disable=not enabled,
    ) as progress:
        yield progress


def _library(args: argparse.Namespace) -> ArrayLibrary:
    try:
        return load_library(args.backend, args.dtype)
    except BackendUnavailable as error:
        raise UsageError("--backend", f"{error}; see `linattn info`") from None


def _out_dir(args: argparse.Namespace) -> Path:
    out: Path = args.out
    if out.exists() and not out.is_dir():
        raise UsageError("--out", f"{str(out)!r} exists and is not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError("--out", f"cannot create {str(out)!r} ({error.strerror})") from None
    return out


def _check_estimators(args: argparse.Namespace) -> None:
    """Every estimator must accept every feature count (e.g. even m for paired kinds)."""
    for estimator in args.estimators:
        for m in args.num_features:
            try:
                estimator.feature_map(args.head_dim, m, seed=0)
            except ValueError as error:
                raise UsageError(
                    "--estimators/--num-features", f"{estimator.label} with m={m}: {error}"
                ) from None


def _check_environment() -> None:
    try:
        _dispatch.resolve_backend(None)
    except ValueError as error:
        raise UsageError(f"${_dispatch.ENVIRONMENT_VARIABLE}", str(error)) from None


def _bench_setup(args: argparse.Namespace) -> BenchSetup:
    try:
        la.FeatureMap(args.bench_head_dim, args.bench_num_features, kind=args.kind)
    except ValueError as error:
        raise UsageError("--num-features/--kind", str(error)) from None
    return BenchSetup(
        batch=args.batch,
        heads=args.heads,
        head_dim=args.bench_head_dim,
        num_features=args.bench_num_features,
        kind=args.kind,
        dtype=getattr(args, "bench_dtype", args.dtype),
        repeats=args.repeats,
        max_exact_length=args.max_exact_length,
        seed=getattr(args, "seed", 0),
    )


def causal_path(library: ArrayLibrary) -> str:
    """Who runs causal linear attention for this library under the current backend choice."""
    try:
        chosen = _dispatch.resolve_backend(None)
    except ValueError as error:
        return f"error: {error}"
    if chosen == "array_api":
        return "array API ($LINATTN_BACKEND=array_api)"
    kernel, reason = _dispatch.kernel_for(library.asarray(_zeros()))
    if kernel is not None:
        return "compiled Numba kernel"
    return f"array API ({reason})"


def _zeros() -> Any:
    import numpy as np

    return np.zeros((1, 1))


def _machine_header(library: ArrayLibrary, extra: dict[str, str]) -> dict[str, str]:
    pairs = machine_info()
    pairs[library.name] = f"{library.version} on {library.device}"
    pairs["causal path"] = causal_path(library)
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
    return {
        "workload": f"B={setup.batch}, H={setup.heads}, d={setup.head_dim}, "
        f"{setup.dtype}; linear: m={setup.num_features} {setup.kind} orthogonal features",
        "time": f"best of {setup.repeats} calls after a warm-up call (compilation excluded)",
        "peak memory": library.memory_method,
    }


def _run_accuracy(
    args: argparse.Namespace,
    library: ArrayLibrary,
    progress: Any,
    causal: bool,
    metrics: Sequence[str] = ("mse", "tv"),
) -> list[Any]:
    steps = len(args.estimators) * len(args.num_features) * args.seeds
    task = progress.add_task("accuracy vs m", total=steps)
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
        on_step=lambda: progress.advance(task),
    )


def _run_bench(
    args: argparse.Namespace,
    library: ArrayLibrary,
    setup: BenchSetup,
    progress: Any,
    methods: Sequence[str] = METHODS,
    modes: Sequence[str] = MODES,
) -> list[Any]:
    steps = len(args.lengths) * len(methods) * len(modes)
    task = progress.add_task("time and memory vs L", total=steps)
    return benchmark(
        library,
        args.lengths,
        setup,
        methods=methods,
        modes=modes,
        on_step=lambda: progress.advance(task),
    )


def _wrote(console: Any, paths: Sequence[Path]) -> None:
    console.print("wrote: " + ", ".join(str(p) for p in paths))


# -- commands ------------------------------------------------------------------------


def _demo(args: argparse.Namespace) -> int:
    from linattn import _cli_report as report

    start = time.perf_counter()
    _check_estimators(args)
    setup = _bench_setup(args)
    out = _out_dir(args)
    library = _library(args)
    bench_library = load_library(args.backend, setup.dtype)
    console = _console()
    console.rule("[bold]linattn demo[/]: FAVOR+ linear attention against exact softmax attention")
    console.print(report.key_value_table("Machine", _machine_header(bench_library, {})))
    with _progress() as progress:
        phase = time.perf_counter()
        accuracy = _run_accuracy(args, library, progress, causal=False, metrics=("mse",))
        accuracy_seconds = time.perf_counter() - phase
        phase = time.perf_counter()
        bench = _run_bench(args, bench_library, setup, progress)
        bench_seconds = time.perf_counter() - phase
    found = crossovers(bench)
    console.print(
        report.key_value_table(
            "1. Accuracy (the seed experiment)", _accuracy_settings(args, False)
        )
    )
    console.print(
        report.accuracy_table(accuracy, "mse", "Attention output MSE against exact softmax")
    )
    console.print(
        report.key_value_table("2. Speed and memory", _bench_settings(setup, bench_library))
    )
    for table in report.bench_tables(bench, setup.repeats):
        console.print(table)
    console.print(report.crossover_table(found))
    paths = [
        report.plot_accuracy(accuracy, out / "accuracy.png", "Error of random-feature estimators"),
        report.plot_bench(bench, found, out / "bench.png", _bench_title(setup, bench_library)),
        report.plot_demo(accuracy, bench, found, out / "demo.png", "linattn demo"),
        report.write_csv(accuracy, out / "accuracy.csv"),
        report.write_csv(bench, out / "bench.csv"),
    ]
    _wrote(console, paths)
    console.print(
        f"demo finished in {time.perf_counter() - start:.1f} s (accuracy study "
        f"{accuracy_seconds:.1f} s; speed and memory {bench_seconds:.1f} s, including "
        "the first call's kernel compilation)"
    )
    return 0


def _bench_title(setup: BenchSetup, library: ArrayLibrary) -> str:
    return (
        f"{library.name} {setup.dtype} on {library.device}: B={setup.batch}, H={setup.heads}, "
        f"d={setup.head_dim}, m={setup.num_features}"
    )


def _emit(fmt: str, rows: Sequence[Any], payload: dict[str, Any]) -> bool:
    """Write CSV or JSON to standard output; False when the format is a table."""
    if fmt == "csv":
        import csv

        dicts = [r.as_dict() for r in rows]
        writer = csv.DictWriter(sys.stdout, fieldnames=list(dicts[0]) if dicts else [])
        writer.writeheader()
        writer.writerows(dicts)
        return True
    if fmt == "json":
        sys.stdout.write(json.dumps(payload, indent=2, default=str) + "\n")
        return True
    return False


def _accuracy(args: argparse.Namespace) -> int:
    from linattn import _cli_report as report

    _check_estimators(args)
    out = _out_dir(args)
    library = _library(args)
    with _progress(args.format == "table") as progress:
        rows = _run_accuracy(args, library, progress, causal=args.causal)
    settings = _accuracy_settings(args, args.causal)
    payload = {"settings": settings, "results": [r.as_dict() for r in rows]}
    paths = [
        report.plot_accuracy(rows, out / "accuracy.png", "Error of random-feature estimators"),
        report.write_csv(rows, out / "accuracy.csv"),
        report.write_json(payload, out / "accuracy.json"),
    ]
    if not _emit(args.format, rows, payload):
        console = _console()
        console.print(report.key_value_table("Accuracy study", settings))
        for metric, title in (
            ("mse", "Attention output MSE against exact softmax"),
            ("tv", "Total variation of attention rows against exact softmax"),
        ):
            console.print(report.accuracy_table(rows, metric, title))
        _wrote(console, paths)
    return 0


def _bench(args: argparse.Namespace) -> int:
    from linattn import _cli_report as report

    setup = _bench_setup(args)
    out = _out_dir(args)
    library = _library(args)
    header = _machine_header(library, _bench_settings(setup, library))
    with _progress(args.format == "table") as progress:
        rows = _run_bench(args, library, setup, progress, args.methods, args.modes)
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
        report.plot_bench(rows, found, out / "bench.png", _bench_title(setup, library)),
        report.write_csv(rows, out / "bench.csv"),
        report.write_json(payload, out / "bench.json"),
    ]
    if not _emit(args.format, rows, payload):
        console = _console()
        console.print(report.key_value_table("linattn bench", header))
        for table in report.bench_tables(rows, setup.repeats):
            console.print(table)
        console.print(report.crossover_table(found))
        _wrote(console, paths)
    return 0


PACKAGES = (
    "linattn",
    "numpy",
    "array-api-compat",
    "numba",
    "numba-cuda",
    "threadpoolctl",
    "torch",
    "jax",
    "jaxlib",
    "cupy",
    "dask",
    "distributed",
    "array-api-strict",
    "rich",
    "matplotlib",
    "psutil",
)


def _cupy_version() -> str | None:
    import importlib.metadata

    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name == "cupy" or name.startswith("cupy-cuda"):
            return f"{dist.version} ({name})"
    return None


def _backend_report() -> list[dict[str, str]]:
    """For each array library: installed?, devices, and who runs causal attention."""
    rows = []
    for name in ARRAY_LIBRARIES:
        row = {"backend": name}
        try:
            library = load_library(name, "float32")
        except BackendUnavailable as error:
            row.update(available="no", device="", causal=str(error))
        except Exception as error:  # a broken install must not break `info`
            row.update(available="no", device="", causal=f"{type(error).__name__}: {error}")
        else:
            row.update(available="yes", device=library.device, causal=causal_path(library))
        rows.append(row)
    return rows


def _info(args: argparse.Namespace) -> int:
    from linattn import _cli_report as report

    versions = {
        name: (_cupy_version() if name == "cupy" else package_version(name)) or "not installed"
        for name in PACKAGES
    }
    versions["linattn"] = f"{la.__version__} ({Path(la.__file__).parent})"
    backends = _backend_report()
    kernels = _dispatch.kernel_status()
    settings = {
        "$LINATTN_BACKEND": os.environ.get(_dispatch.ENVIRONMENT_VARIABLE, "(unset: auto)"),
        "numba threads": _numba_threads(),
    }
    payload = {
        "versions": versions,
        "backends": backends,
        "kernels": kernels,
        "settings": settings,
        "machine": machine_info(),
    }
    if _emit(args.format, [], payload):
        return 0
    console = _console()
    console.print(report.key_value_table("Packages", versions))
    table = report.compact_table("Array backends")
    for column in ("backend", "available", "device", "causal linear attention runs on"):
        table.add_column(column)
    for row in backends:
        table.add_row(row["backend"], row["available"], row["device"], row["causal"])
    console.print(table)
    console.print(report.key_value_table("Compiled kernels", kernels))
    console.print(report.key_value_table("Settings", settings))
    console.print(report.key_value_table("Machine", machine_info()))
    return 0


def _numba_threads() -> str:
    numba = import_optional("numba")
    if numba is None:
        return "numba not installed"
    return str(numba.config.NUMBA_NUM_THREADS)


# -- entry point ------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``linattn`` command line; returns the exit status (2 for bad options).

    Examples
    --------
    >>> main(["--version"])  # doctest: +SKIP
    linattn 0.1.0
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 2
    try:
        if args.command != "info":
            _check_environment()
        return int(args.run(args))
    except UsageError as error:
        args.parser.print_usage(sys.stderr)
        sys.stderr.write(f"{args.parser.prog}: error: {error}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130
