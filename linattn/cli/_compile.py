"""``linattn compile``: compile the kernels typical calls use, before the first call needs
them.

Runs the calls of :data:`CALLS` (the README's examples and the rest of the front door's
usual options) on NumPy arrays of each asked dtype, twice: at the README's size, where
the kernels run in parallel over the heads, and on a few tokens, where they run serial
(a decoding step, small tests; one compiled kernel serves both, so the second loads it).
The kernels save what they compile in their compile cache, so that later processes load
it in about a second; the report lists, per kernel, the seconds it took to compile (or
load), from the ``linattn.numba`` log.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

import linattn as la
from linattn import _dispatch, _warm
from linattn.cli._console import Console
from linattn.cli._machine import import_optional
from linattn.cli._report import compact_table, json_text, key_value_table

__all__ = ["CALLS", "SIZES", "compile_kernels", "warm_up"]

Arrays = tuple[Any, Any, Any]

#: ``(batch, heads, L, d, m)``: the README's size (kernels in parallel) and a few tokens
#: (serial, as every call this small and every decoding step runs).
SIZES = {"README": (1, 4, 2048, 64, 256), "small": (1, 2, 16, 8, 16)}


def _causal(q: Any, k: Any, v: Any, fm: Any) -> None:
    la.linear_attention(q, k, v, fm, causal=True)


def _bidirectional(q: Any, k: Any, v: Any, fm: Any) -> None:
    la.linear_attention(q, k, v, fm)


def _decode(q: Any, k: Any, v: Any, fm: Any, **options: Any) -> None:
    head = (Ellipsis, slice(None, -1), slice(None))
    last = (Ellipsis, slice(-1, None), slice(None))
    _, state = la.linear_attention(
        q[head], k[head], v[head], fm, causal=True, return_state=True, **options
    )
    la.linear_attention(q[last], k[last], v[last], fm, causal=True, state=state, **options)


def _window(causal: bool, features: bool) -> Callable[..., None]:
    def call(q: Any, k: Any, v: Any, fm: Any) -> None:
        la.linear_attention(
            q, k, v, fm if features else None, causal=causal, window=64, sink_keys=4
        )

    return call


#: The calls, by name: ``call(q, k, v, feature_map)`` on ``(batch, heads, L, d)`` arrays.
CALLS: dict[str, Callable[..., None]] = {
    "causal": _causal,
    "causal, prefill + decoding step": _decode,
    "bidirectional": _bidirectional,
    "causal, window 64 + 4 sinks": _window(causal=True, features=True),
    "causal, window 64 + 4 sinks, no feature map": _window(causal=True, features=False),
    "causal, window 64 + 4 sinks, prefill + decoding step": lambda q, k, v, fm: _decode(
        q, k, v, fm, window=64, sink_keys=4
    ),
    "bidirectional, window 64 + 4 sinks": _window(causal=False, features=True),
    "bidirectional, window 64 + 4 sinks, no feature map": _window(causal=False, features=False),
}


class _Records(logging.Handler):
    """Keeps the kernels' log records of compiling and loading."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if hasattr(record, "seconds"):
            self.records.append(record)


@contextmanager
def _recording() -> Iterator[_Records]:
    """The ``linattn.numba`` log's compile records while the block runs (and its notice
    not printed: the report says it)."""
    logger = logging.getLogger("linattn.numba")
    handler, level = _Records(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def warm_up(dtype: str) -> Iterator[dict[str, Any]]:
    """Run every call of :data:`CALLS` at each size of :data:`SIZES` in ``dtype``; yields
    one row per call when it is done: its seconds and the kernels it compiled or loaded
    (``kernel``, ``dtype``, ``source``, ``seconds``).

    Examples
    --------
    >>> list(CALLS)[:3]
    ['causal', 'causal, prefill + decoding step', 'bidirectional']
    >>> row = next(warm_up("float64"))  # doctest: +SKIP
    >>> row["call"], row["size"], row["dtype"]  # doctest: +SKIP
    ('causal', 'README', 'float64')
    """
    for size, (batch, heads, length, d, m) in SIZES.items():
        rng = np.random.default_rng(0)
        shape = (batch, heads, length, d)
        q, k, v = (rng.standard_normal(shape).astype(dtype) for _ in range(3))
        fm = la.FeatureMap(d, m, kind="hyperbolic", seed=0)
        for name, call in CALLS.items():
            with _recording() as log:
                start = time.perf_counter()
                call(q, k, v, fm)
                seconds = time.perf_counter() - start
            kernels = [
                {key: getattr(r, key) for key in ("kernel", "dtype", "source")}
                | {"seconds": round(float(getattr(r, "seconds", 0.0)), 3)}
                for r in log.records
            ]
            row = {"call": name, "size": size, "dtype": dtype, "seconds": round(seconds, 3)}
            yield row | {"kernels": kernels}


def compile_kernels(args: argparse.Namespace) -> int:
    """``linattn compile``: compile (or load) the kernels of typical calls; report times."""
    numba_cpu = _dispatch.kernel_status()["numba-cpu"]
    if import_optional("numba") is None or not numba_cpu.startswith("available"):
        from linattn.cli._options import CommandError

        raise CommandError(f"no kernels to compile: numba-cpu {numba_cpu}; see `linattn info`")
    console = Console(stderr=args.format == "json")
    console.print(key_value_table("linattn compile", {"numba-cpu": numba_cpu}))
    start = time.perf_counter()
    rows = []
    with _warm.foreground():  # (compiling is the command's work, not a background job's)
        for dtype in args.dtypes:
            console.print(f"compiling for {dtype} ...")
            for row in warm_up(dtype):
                rows.append(row)
                compiled = sum(k["source"] == "compiled" for k in row["kernels"])
                console.print(
                    f"  {row['call']} ({row['size']} size): {row['seconds']:.1f} s, "
                    f"{compiled} kernels compiled, {len(row['kernels']) - compiled} loaded"
                )
    total = time.perf_counter() - start
    if args.format == "json":
        print(json_text({"kernels": numba_cpu, "seconds": round(total, 3), "calls": rows}), end="")
        return 0
    table = compact_table("Kernels (compiled, or loaded from the compile cache)")
    for column, right in (("kernel", False), ("dtype", False)):
        table.add_column(column, right=right)
    table.add_column("source")
    table.add_column("seconds", right=True)
    for row in rows:
        for kernel in row["kernels"]:
            table.add_row(
                kernel["kernel"], kernel["dtype"], kernel["source"],
                f"{kernel['seconds']:.2f}",
            )  # fmt: skip
    console.print(table)
    kernels = [kernel for row in rows for kernel in row["kernels"]]
    compiled = [k for k in kernels if k["source"] == "compiled"]
    console.print(
        f"done in {total:.1f} s: {len(compiled)} kernels compiled "
        f"({sum(k['seconds'] for k in compiled):.1f} s), {len(kernels) - len(compiled)} "
        "loaded from the cache"
        + ("" if "compile cache on" in numba_cpu else "; the compile cache is off: "
           "nothing is kept for later processes")
    )  # fmt: skip
    return 0
