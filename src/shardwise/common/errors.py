"""The error every product raises for a mistake its user can fix."""

from __future__ import annotations


class ConfigError(ValueError):
    """A mistake the user can fix in the job file, the command line or the inputs.

    The CLI prints the message as one line and exits with code 2.
    """


def first_line(error: BaseException) -> str:
    """What `error` says, in one line: its message's first line, or its type where it says
    nothing."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
