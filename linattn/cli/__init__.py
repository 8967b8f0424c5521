"""``linattn``: the command line (``demo``, ``accuracy``, ``bench``, ``info``, ``compile``,
``convert``).

``linattn demo`` is the main job: in under a minute on a laptop-class CPU it shows
how close FAVOR+ comes to exact softmax attention as the number of random
features grows, and how its time and memory grow with sequence length next to
exact attention.  Every option has a default; a bad option, or a request that
cannot run here, prints a message that names it and exits with status 2.

``linattn info`` works with the base install, ``linattn compile`` (the kernels of typical
calls compiled ahead, into their compile cache) with ``linattn[numba]``; the other
commands draw plots and need the ``cli`` extra (``pip install "linattn[cli]"``: rich,
matplotlib, psutil).  The library never imports this package.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from linattn.cli import _commands, _compile, _convert, _info, _options, _preflight
from linattn.cli._options import CommandError

__all__ = ["build_parser", "main"]

COMMANDS = {
    "demo": _commands.demo,
    "accuracy": _commands.accuracy,
    "bench": _commands.bench,
    "info": _info.info,
    "compile": _compile.compile_kernels,
    "convert": _convert.convert,
}


def build_parser() -> argparse.ArgumentParser:
    """The ``linattn`` argument parser.

    Examples
    --------
    >>> build_parser().parse_args(["info"]).command
    'info'
    """
    return _options.build_parser(COMMANDS)


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
            _preflight.check_environment()
        return int(args.run(args))
    except CommandError as error:
        args.parser.print_usage(sys.stderr)
        sys.stderr.write(f"{args.parser.prog}: error: {error}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130
