"""The error every product raises for a mistake its user can fix."""

from __future__ import annotations


class ConfigError(ValueError):
    """A mistake the user can fix in the job file, the command line or the inputs.

    The CLI prints the message as one line and exits with code 2.
    """
