"""The command-line options every shardwise command that reads a job file shares, defined once."""

from __future__ import annotations

import argparse

Options = argparse.ArgumentParser | argparse._ArgumentGroup
"""A parser, or a group of its options."""


def add_overrides(parser: Options, example: str, note: str = "") -> None:
    """`--set KEY=VALUE` (repeatable): job-file values overridden, into `args.overrides`."""
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override a job-file value, e.g. --set {example} (repeatable){note}",
    )


def add_debug(parser: Options) -> None:
    """`--debug`: a traceback for every error, not the one line."""
    parser.add_argument("--debug", action="store_true", help="show tracebacks for every error")
