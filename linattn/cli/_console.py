"""Standard output for people: rich when it is installed, plain text when it is not.

Tables are built as plain :class:`Table` data and drawn here, so every command can
print without rich (the base install).  Text is never read as rich markup: install
hints such as ``linattn[cuda]`` keep their brackets.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from linattn.cli._machine import import_optional

__all__ = ["Console", "Table", "progress"]


@dataclass
class Table:
    """Rows of text cells under a title; ``None`` in ``rows`` starts a new section."""

    title: str
    columns: list[str] = field(default_factory=list)
    right: list[bool] = field(default_factory=list)
    rows: list[list[str] | None] = field(default_factory=list)
    show_header: bool = True

    def add_column(self, header: str = "", *, right: bool = False) -> None:
        self.columns.append(header)
        self.right.append(right)

    def add_row(self, *cells: str) -> None:
        self.rows.append([str(cell) for cell in cells])

    def add_section(self) -> None:
        self.rows.append(None)


def _rich_table(table: Table) -> Any:
    from rich import box
    from rich.table import Table as RichTable
    from rich.text import Text

    out = RichTable(
        title=Text(table.title, style="bold"),
        title_justify="left",
        show_header=table.show_header,
        box=box.SIMPLE_HEAD if table.show_header else None,
        pad_edge=False,
        collapse_padding=True,
    )
    for index, (header, right) in enumerate(zip(table.columns, table.right, strict=True)):
        bold = not table.show_header and index == 0
        out.add_column(Text(header), justify="right" if right else "left", style="bold" * bold)
    for row in table.rows:
        if row is None:
            out.add_section()
        else:
            out.add_row(*(Text(cell) for cell in row))
    return out


def _plain_table(table: Table) -> str:
    """Columns padded to their widest line; multi-line headers stacked."""
    headers = [header.split("\n") for header in table.columns]
    rows = [row for row in table.rows if row is not None]
    widths = [
        max([len(line) for line in header] * table.show_header + [len(r[i]) for r in rows] + [0])
        for i, header in enumerate(headers)
    ]

    def line(cells: list[str]) -> str:
        padded = (
            cell.rjust(width) if right else cell.ljust(width)
            for cell, width, right in zip(cells, widths, table.right, strict=True)
        )
        return "  ".join(padded).rstrip()

    lines = [table.title]
    if table.show_header:
        height = max((len(h) for h in headers), default=0)
        for level in range(height):
            lines.append(line([h[level] if level < len(h) else "" for h in headers]))
        lines.append("  ".join("-" * w for w in widths))
    for row in table.rows:
        lines.append("  ".join("-" * w for w in widths) if row is None else line(row))
    return "\n".join(lines) + "\n\n"  # a blank line between tables


class Console:
    """Prints text, rules and tables to standard output (or error), rich or plain."""

    def __init__(self, stderr: bool = False) -> None:
        self.stream = sys.stderr if stderr else sys.stdout
        rich_console = import_optional("rich.console")
        self.rich = (
            None
            if rich_console is None
            else rich_console.Console(stderr=stderr, highlight=False, markup=False)
        )

    def print(self, item: str | Table) -> None:
        """Print ``item`` and flush: a pipe shows each line when it is printed.  Rich
        draws on a terminal only: piped or redirected, lines are written as they are
        (rich would wrap them, and tables' headers, at 80 columns)."""
        if self.rich is not None and self.stream.isatty():
            self.rich.print(_rich_table(item) if isinstance(item, Table) else item)
        else:
            self.stream.write(_plain_table(item) if isinstance(item, Table) else f"{item}\n")
        self.stream.flush()

    def rule(self, title: str) -> None:
        if self.rich is not None and self.stream.isatty():
            self.rich.rule(title)
        else:
            self.stream.write(f"== {title} ==\n")
        self.stream.flush()


class _NoProgress:
    def add_task(self, description: str, total: int) -> int:
        return 0

    def advance(self, task: int) -> None:
        return None


class _LineProgress:
    """Progress as lines on standard error, flushed (a pipe, a log file, no rich): each
    task when it starts, at every tenth of its steps, and when it ends.

    Examples
    --------
    >>> import io
    >>> stream = io.StringIO()
    >>> bar = _LineProgress(stream)
    >>> task = bar.add_task("accuracy vs m", total=2)
    >>> bar.advance(task); bar.advance(task)
    >>> print(stream.getvalue().replace(" 0.0 s", ""), end="")
    accuracy vs m: 0/2
    accuracy vs m: 1/2
    accuracy vs m: 2/2
    """

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.tasks: list[list[Any]] = []  # description, total, done, start

    def _line(self, task: int) -> None:
        description, total, done, start = self.tasks[task]
        elapsed = "" if done == 0 else f" {time.perf_counter() - start:.1f} s"
        self.stream.write(f"{description}: {done}/{total}{elapsed}\n")
        self.stream.flush()

    def add_task(self, description: str, total: int) -> int:
        self.tasks.append([description, total, 0, time.perf_counter()])
        self._line(len(self.tasks) - 1)
        return len(self.tasks) - 1

    def advance(self, task: int) -> None:
        entry = self.tasks[task]
        entry[2] += 1
        done, total = entry[2], entry[1]
        if done == total or done * 10 // max(total, 1) > (done - 1) * 10 // max(total, 1):
            self._line(task)


@contextlib.contextmanager
def progress(enabled: bool = True) -> Iterator[Any]:
    """A progress bar on standard error: rich's on a terminal, else lines (flushed, so
    that a pipe or a log shows them as they come); nothing when not ``enabled``."""
    if not enabled:
        yield _NoProgress()
        return
    if import_optional("rich.progress") is None or not sys.stderr.isatty():
        yield _LineProgress(sys.stderr)
        return
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
        console=Console(stderr=True).rich,
        transient=True,
        disable=not enabled,
    ) as bar:
        yield bar
