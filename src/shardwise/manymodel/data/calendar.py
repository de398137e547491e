"""How far apart a table's timestamps are: its frequency (`data.freq`, a polars duration), whether
every series steps by it, and the times after a series' last.

Months, quarters and years are calendar steps: a step moves the month by 1, 3 or 12 and keeps the
series' day of the month, clipped to the month's length (a series on the 31st is on the 30th in
June and the 28th or 29th in February). So month-end and quarter-end dates (pandas' `ME`, `QE`),
common in business data, are as regular as month starts, and the future rows end months too.
Adding a month to the date before (02-29 + 1mo = 03-29) would call them irregular. Other units
(weeks, days, hours, …) are fixed lengths of time.
"""

from __future__ import annotations

import polars as pl

from shardwise.common.errors import ConfigError
from shardwise.manymodel.columns import SERIES

MONTHS = {"mo": 1, "q": 3, "y": 12}
"""The calendar units, in months."""
ANCHOR = "_day"
"""A series' day of the month (its largest: month ends are the 31st clipped), for calendar
steps."""


def split(freq: str) -> tuple[int, str]:
    """`3mo` → (3, "mo")."""
    digits = len(freq) - len(freq.lstrip("0123456789"))
    return int(freq[:digits] or 1), freq[digits:]


def months_per_step(freq: str) -> int | None:
    """How many months a step of `freq` moves (None: not a calendar unit)."""
    count, unit = split(freq)
    return count * MONTHS[unit] if unit in MONTHS else None


def times(freq: str, k: int) -> str:
    """A polars duration for k steps of `freq` (`1mo` × 3 = `3mo`)."""
    count, unit = split(freq)
    return f"{count * k}{unit}"


def anchor(ts: str) -> pl.Expr:
    """Each row's series' day of the month (`ANCHOR`)."""
    return pl.col(ts).dt.day().max().over(SERIES)


def infer(frame: pl.DataFrame, ts: str) -> str:
    """The spacing of the timestamps of `frame` (sorted by series and time): calendar months,
    quarters or years where the most common step moves the month by 1, 3 or 12 and every
    timestamp is on its series' day, else the most common gap."""
    col = pl.col(ts)
    steps = frame.select(
        _month(col).diff().over(SERIES).alias("months"),
        (col.dt.day() == _clipped(col, anchor(ts))).alias("on_day"),
        col.diff().over(SERIES).alias("gap"),
    ).drop_nulls()
    if steps.height == 0:
        raise ConfigError("cannot infer the frequency from one row per series; set data.freq")
    months = steps["months"].mode().sort()[0]
    if months in (1, 3, 12) and steps["on_day"].all() and _one_time_of_day(frame, ts):
        return {1: "1mo", 3: "3mo", 12: "1y"}[int(months)]
    gap = steps["gap"].mode().sort()[0]
    seconds = int(gap.total_seconds())
    if seconds % 86400 == 0:
        days = seconds // 86400
        return "1w" if days == 7 else f"{days}d"
    if seconds % 3600 == 0:
        return f"{seconds // 3600}h"
    return f"{seconds}s"


def off_step(ts: str, freq: str, before: pl.Expr) -> pl.Expr:
    """True on a row that does not follow its series' row before (`before`: that row's time,
    null on a series' first) by one step of `freq`."""
    col = pl.col(ts)
    months = months_per_step(freq)
    if months is None:
        return before.is_not_null() & (col != before.dt.offset_by(freq))
    moved = _month(col) - _month(before)
    same_time = _time_of_day(col) == _time_of_day(before)
    on_day = col.dt.day() == _clipped(col, anchor(ts))
    return before.is_not_null() & ((moved != months) | ~on_day | ~same_time)


def after(last: pl.Expr, freq: str, k: int, day: pl.Expr) -> pl.Expr:
    """The time k steps of `freq` after `last`, on day of the month `day` (clipped) where the
    step is a calendar one."""
    months = months_per_step(freq)
    if months is None:
        return last.dt.offset_by(times(freq, k))
    start = last.dt.month_start().dt.offset_by(f"{months * k}mo")
    return start.dt.offset_by(pl.format("{}d", _clipped(start, day) - 1))


def _month(col: pl.Expr) -> pl.Expr:
    return col.dt.year().cast(pl.Int64) * 12 + col.dt.month().cast(pl.Int64)


def _clipped(col: pl.Expr, day: pl.Expr) -> pl.Expr:
    """`day`, or the last day of `col`'s month where that month is shorter."""
    return pl.min_horizontal(day, col.dt.days_in_month())


def _time_of_day(col: pl.Expr) -> pl.Expr:
    return col - col.dt.truncate("1d")


def _one_time_of_day(frame: pl.DataFrame, ts: str) -> bool:
    """Whether every timestamp of a series is at the same time of day as the one before."""
    if frame.schema[ts] == pl.Date:
        return True
    differs = _time_of_day(pl.col(ts)) != _time_of_day(pl.col(ts)).shift(1).over(SERIES)
    return not frame.select(differs.fill_null(False).any()).item()
