"""What shardwise says outside the progress display reads the same everywhere: an error is
`shardwise: error: …` on one line (the CLI), a warning `shardwise: warning: …` on one line, on
every rank and in every command, without the file, line and source line Python's warnings print.

shardwise's own warnings are `ShardwiseWarning`s; others (torch's, a library's) print as Python
prints them. This module must not import anything of shardwise's: everything may use it.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Iterator
from typing import TextIO


class ShardwiseWarning(UserWarning):
    """Something the user should know that does not stop the run (a checkpoint skipped, a
    setting ignored, a tracker that could not finish)."""


@contextlib.contextmanager
def one_line_warnings() -> Iterator[None]:
    """While inside, a `ShardwiseWarning` is printed as one line to stderr."""
    previous = warnings.showwarning

    def show(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        if issubclass(category, ShardwiseWarning):
            print(f"shardwise: warning: {message}", file=file or sys.stderr, flush=True)
        else:
            previous(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = previous


def warn(message: str, *, stacklevel: int = 2) -> None:
    """Issue a `ShardwiseWarning` (`stacklevel` as `warnings.warn`'s, counted from the caller)."""
    warnings.warn(message, ShardwiseWarning, stacklevel=stacklevel + 1)


def human_bytes(value: float) -> str:
    """A byte count as a person reads it: B, KiB, MiB or GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:,.0f} {unit}" if unit == "B" else f"{value:,.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"
