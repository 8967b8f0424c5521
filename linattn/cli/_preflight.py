"""Checks before a run: options that cannot work end in a message, not a traceback.

Every check runs before the study allocates anything large: a request that cannot
work (too big for memory, inputs whose exponentials overflow, a missing library)
ends in a :class:`UsageError` or :class:`CommandError` (exit status 2).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import linattn as la
from linattn import _dispatch
from linattn.cli import _backends, _limits
from linattn.cli._backends import ArrayLibrary, BackendUnavailable
from linattn.cli._benchmark import METHODS, MODES, BenchSetup
from linattn.cli._machine import available_memory, import_optional
from linattn.cli._options import CommandError, UsageError

__all__ = [
    "bench_setup",
    "check_accuracy_limits",
    "check_bench_limits",
    "check_environment",
    "check_estimators",
    "library_for",
    "needs_plotting",
    "out_dir",
]


# -- checks ------------------------------------------------------------------------


def needs_plotting(command: str) -> None:
    if import_optional("matplotlib") is None:
        raise CommandError(
            f"`linattn {command}` draws PNG plots and needs matplotlib, which is not "
            'installed; install it with: pip install "linattn[cli]"'
        )


def library_for(args: argparse.Namespace, dtype: str | None = None) -> ArrayLibrary:
    try:
        return _backends.load_library(args.backend, dtype or args.dtype)
    except BackendUnavailable as error:
        raise UsageError("--backend", f"{error}; see `linattn info`") from None


def out_dir(args: argparse.Namespace) -> Path:
    out: Path = args.out
    if out.exists() and not out.is_dir():
        raise UsageError("--out", f"{str(out)!r} exists and is not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError("--out", f"cannot create {str(out)!r} ({error.strerror})") from None
    return out


def check_estimators(args: argparse.Namespace) -> None:
    """Every estimator must accept every feature count (e.g. even m for paired kinds)."""
    for estimator in args.estimators:
        for m in args.num_features:
            try:
                estimator.feature_map(args.head_dim, m, seed=0)
            except ValueError as error:
                raise UsageError(
                    "--estimators/--num-features", f"{estimator.label} with m={m}: {error}"
                ) from None


def _check_fits(option: str, asked: str, need: _limits.MemoryNeed, library: ArrayLibrary) -> None:
    """``need`` must fit in free host memory, and device memory for accelerator arrays."""
    device_free = library.free_memory()
    host = need.host + (need.device if device_free is None else 0)
    places = [(host, *available_memory())]
    if device_free is not None:
        places.append((need.device, device_free, f"free memory on {library.device}"))
    for needed, free, where in places:
        if free is not None and needed > free:
            raise UsageError(
                option,
                f"{asked} needs about {_limits.format_bytes(needed)} ({need.what}), more than "
                f"the {_limits.format_bytes(free)} of {where}; ask for a smaller {option}",
            )


def check_accuracy_limits(args: argparse.Namespace, library: ArrayLibrary) -> None:
    parser = args.parser
    sizes = [
        (name, getattr(args, dest), parser.get_default(dest) or 0)
        for name, dest in (("--length", "length"), ("--head-dim", "head_dim"))
    ]
    m = max(args.num_features)
    sizes.append(("--num-features", m, max(parser.get_default("num_features") or [0])))
    need = _limits.accuracy_memory(args.length, args.head_dim, m, _itemsize(args.dtype))
    asked = f"L={args.length:,} with d={args.head_dim:,}, m={m:,}"
    _check_fits(_limits.oversized(sizes), asked, need, library)
    _check_input_range(args)


def _check_input_range(args: argparse.Namespace) -> None:
    """Queries and keys whose exponentials overflow ``--dtype`` give NaN, not a result."""
    limit = _limits.largest_logit_scale(args.dtype)
    shape = (args.length, args.head_dim)
    found = _limits.log_exponent(*shape, args.input_scale, args.anisotropy, args.data_seed)
    if found <= math.log(limit):
        return
    untilted = _limits.log_exponent(*shape, args.input_scale, 0.0, args.data_seed)
    reach = (
        f"gives queries and keys whose largest (|q|^2 + |k|^2)/(2 sqrt(d)) is "
        f"{_limits.power_of_ten(found)}, beyond {limit:.1f} = log of the largest {args.dtype}: "
        f"exp of the logits and the features' exp(-|x|^2/(2 sqrt(d))) would overflow"
    )
    if args.anisotropy and untilted <= math.log(limit):
        largest = _limits.largest_anisotropy(
            *shape, args.input_scale, args.anisotropy, args.data_seed, limit
        )
        raise UsageError(
            "--anisotropy",
            f"{args.anisotropy:g} {reach}; at --input-scale {args.input_scale:g} it may be at "
            f"most {_limits.round_down(largest)}",
        )
    unit = _limits.log_exponent(*shape, 1.0, args.anisotropy, args.data_seed)
    largest = math.exp(0.5 * (math.log(limit) - unit))
    raise UsageError(
        "--input-scale",
        f"{args.input_scale:g} {reach}; with this --length, --head-dim, --anisotropy and "
        f"--data-seed it may be at most {_limits.round_down(largest)}",
    )


def check_bench_limits(args: argparse.Namespace, setup: BenchSetup, library: ArrayLibrary) -> None:
    """The largest length's inputs and attention must fit (exact only up to its limit)."""
    methods = getattr(args, "methods", METHODS)
    causal = "causal" in getattr(args, "modes", MODES)
    needs = [
        _limits.bench_memory(
            setup.batch,
            setup.heads,
            length,
            setup.head_dim,
            setup.num_features,
            _itemsize(setup.dtype),
            exact="exact" in methods and length <= setup.max_exact_length,
            causal=causal,
        )
        for length in args.lengths
    ]
    need = max(needs, key=lambda n: n.host + n.device)
    default = args.parser.get_default
    sizes = [
        ("--lengths", max(args.lengths), max(default("lengths"))),
        ("--batch", setup.batch, default("batch")),
        ("--heads", setup.heads, default("heads")),
        ("--head-dim", setup.head_dim, default("bench_head_dim")),
        ("--num-features", setup.num_features, default("bench_num_features")),
    ]
    asked = (
        f"L={need.length:,} with B={setup.batch:,}, H={setup.heads:,}, d={setup.head_dim:,}, "
        f"m={setup.num_features:,} in {setup.dtype}"
    )
    _check_fits(_limits.oversized(sizes), asked, need, library)


def _itemsize(dtype: str) -> int:
    return 4 if dtype == "float32" else 8


def check_environment() -> None:
    try:
        _dispatch.resolve_backend(None)
    except ValueError as error:
        raise UsageError(f"${_dispatch.ENVIRONMENT_VARIABLE}", str(error)) from None


def bench_setup(args: argparse.Namespace) -> BenchSetup:
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
