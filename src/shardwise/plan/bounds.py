"""The range each number the planner takes must fall in, and the one check that holds a value to
it: command-line flags (typed text) and hardware-file fields (TOML or JSON values) alike; and the
check of a flag that names one of a few options.

A value out of range is the user's to fix, so the check raises `ConfigError` with one line naming
the flag or field, the value and what is allowed. NaN, infinities, text and a fraction where a
whole number belongs fail the same way. The maxima are far past any model or machine built; they
keep every count the layout search enumerates finite and small. This module only checks: which
number means what, and what follows from it, belongs to the modules that use it.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Sequence
from dataclasses import dataclass

from shardwise.common.errors import ConfigError


@dataclass(frozen=True)
class Bound:
    """Numbers from `low` to `high` (`low` itself excluded when `above`), whole ones only when
    `whole`; `means` says what the number is, for the message."""

    low: float
    high: float
    whole: bool = False
    above: bool = False
    means: str = ""

    def parse(self, text: str, label: str) -> int | float:
        """`text` as typed on the command line, as the number it denotes (an int when `whole`:
        "1e3" is 1000); ConfigError naming `label` unless it is in range."""
        value: float | None
        try:
            value = int(text) if self.whole else float(text)
        except ValueError:
            try:
                value = float(text)  # a whole number may be written 1e3
            except ValueError:
                value = None
        return self._checked(value, label, message_text(text))

    def check(self, value: object, label: str) -> int | float:
        """A value read from a file (a bool is not a number), in range, or ConfigError."""
        number = value if isinstance(value, int | float) and not isinstance(value, bool) else None
        return self._checked(number, label, message_text(repr(value)))

    def _checked(self, value: float | None, label: str, display: str) -> int | float:
        if value is None or (isinstance(value, float) and not math.isfinite(value)):
            raise self._error(label, display)  # (an int of 400 digits is compared, not converted)
        if self.whole and isinstance(value, float):
            if not value.is_integer():
                raise self._error(label, display)
            value = int(value)
        low_ok = value > self.low if self.above else value >= self.low
        if not (low_ok and value <= self.high):
            raise self._error(label, display)
        return value

    def _error(self, label: str, display: str) -> ConfigError:
        means = f" ({self.means})" if self.means else ""
        return ConfigError(f"{label} {display}: must be {self.allowed()}{means}")

    def allowed(self) -> str:
        """E.g. "a whole number from 1 to 1,024" or "a number above 0 and at most 1"."""
        kind = "a whole number" if self.whole else "a number"
        if self.above:
            return f"{kind} above {_number(self.low)} and at most {_number(self.high)}"
        return f"{kind} from {_number(self.low)} to {_number(self.high)}"


def one_of(text: str, options: Sequence[str], label: str) -> str:
    """`text` if it is one of `options`; ConfigError naming `label` and the nearest otherwise."""
    if text in options:
        return text
    near = difflib.get_close_matches(text, options, n=1)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    raise ConfigError(f"{label} {message_text(text)}: must be one of {', '.join(options)}{hint}")


def message_text(text: str) -> str:
    """`text` as the message shows it: on one line, at most about 40 characters."""
    text = text if text.isprintable() else repr(text)
    return text if len(text) <= 40 else text[:40] + "…"


def _number(value: float) -> str:
    if float(value).is_integer() and abs(value) < 1e9:
        return f"{value:,.0f}"
    return f"{value:.3g}".replace("e+", "e")
