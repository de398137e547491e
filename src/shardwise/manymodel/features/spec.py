"""Feature engineering declared once (`[features]`), computed by polars or by Spark.

Every target-derived feature at time t summarises target values at t − k or earlier with
k ≥ the forecast horizon, so the features of all `horizon` rows after a forecast origin are known
at the origin, and nothing reads the present or the future
(tests/unit/manymodel/test_features.py perturbs the future and checks). Windows are counted in
rows of a regular series: a rolling window of w exists once it holds w non-empty values;
expanding windows need one (two for std).

The polars backend runs in this process on all cores; the Spark backend expresses the same
features as Spark window functions (no Python UDFs), partitioned by series, so it scales out to a
cluster. Both produce the same table (tests/integration/test_features_spark.py).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from functools import reduce
from typing import Any

import polars as pl

from shardwise.manymodel.columns import SERIES, Columns, run_numbers
from shardwise.manymodel.config import FeaturesSection, ManyModelsConfig

_CALENDAR = {
    "year": lambda ts: ts.dt.year(),
    "quarter": lambda ts: ts.dt.quarter(),
    "month": lambda ts: ts.dt.month(),
    "week": lambda ts: ts.dt.week(),
    "day_of_week": lambda ts: ts.dt.weekday(),  # Monday = 1 … Sunday = 7
    "day_of_month": lambda ts: ts.dt.day(),
    "day_of_year": lambda ts: ts.dt.ordinal_day(),
    "hour": lambda ts: ts.dt.hour(),
}
CALENDAR_PARTS = tuple(_CALENDAR)


@dataclass(frozen=True)
class FeatureSpec:
    """The resolved feature declaration: what to compute, with defaults filled in."""

    lags: tuple[int, ...]
    shift: int
    rolling_windows: tuple[int, ...]
    rolling_stats: tuple[str, ...]
    expanding_stats: tuple[str, ...]
    calendar: tuple[str, ...]
    group_by: tuple[tuple[str, ...], ...]
    group_stats: tuple[str, ...]

    @classmethod
    def from_config(cls, config: ManyModelsConfig, season_length: int) -> FeatureSpec:
        if not config.reads_features:  # no model would read them: nothing to compute
            return cls((), config.window_shift, (), (), (), (), (), ())
        f: FeaturesSection = config.features
        horizon = config.backtest.horizon
        lags = f.lags or list(range(horizon, horizon + max(season_length, 1)))
        return cls(
            lags=tuple(sorted(set(lags))),
            shift=config.window_shift,
            rolling_windows=tuple(sorted(set(f.rolling_windows))),
            rolling_stats=tuple(dict.fromkeys(f.rolling_stats)),
            expanding_stats=tuple(dict.fromkeys(f.expanding_stats)),
            calendar=tuple(dict.fromkeys(f.calendar)),
            group_by=tuple(tuple(g) for g in f.group_by),
            group_stats=tuple(dict.fromkeys(f.group_stats)),
        )

    @property
    def lag_columns(self) -> list[str]:
        return [f"lag{k}" for k in self.lags]

    @property
    def rolling_columns(self) -> list[tuple[str, int, str]]:
        return [
            (f"roll{w}_{stat}", w, stat)
            for w in self.rolling_windows
            for stat in self.rolling_stats
        ]

    @property
    def calendar_columns(self) -> list[tuple[str, str]]:
        return [(f"cal_{part}", part) for part in self.calendar]

    @property
    def expanding_columns(self) -> list[tuple[str, str]]:
        return [(f"expanding_{stat}", stat) for stat in self.expanding_stats]

    @property
    def group_columns(self) -> list[tuple[str, tuple[str, ...], str]]:
        return [
            (f"{'_'.join(g)}_{stat}", g, stat) for g in self.group_by for stat in self.group_stats
        ]

    def columns(self) -> list[str]:
        """Feature column names in table order (covariates come before them)."""
        return [
            *self.lag_columns,
            *(name for name, _, _ in self.rolling_columns),
            *(name for name, _ in self.expanding_columns),
            *(name for name, _ in self.calendar_columns),
            *(name for name, _, _ in self.group_columns),
        ]

    def numeric_columns(self) -> list[str]:
        """Feature columns that are quantities (everything but calendar codes)."""
        calendar = {name for name, _ in self.calendar_columns}
        return [c for c in self.columns() if c not in calendar]

    def target_scaled(self) -> tuple[list[str], list[str]]:
        """Columns that move with the target's level (scaled and shifted with it) and columns
        that measure its spread (scaled only)."""
        level = list(self.lag_columns)
        spread: list[str] = []
        derived = [
            *((n, s) for n, _, s in self.rolling_columns),
            *self.expanding_columns,
            *((n, s) for n, _, s in self.group_columns),
        ]
        for name, stat in derived:
            (spread if stat == "std" else level).append(name)
        return level, spread

    def reach(self) -> int:
        """Rows at the start of a series whose features cannot all exist."""
        reach = max(self.lags, default=0)
        for w in self.rolling_windows:
            reach = max(reach, self.shift + w - 1)
        if self.expanding_stats or self.group_by:
            reach = max(reach, self.shift + (1 if "std" in self.expanding_stats else 0))
        return reach


def polars_features(frame: pl.DataFrame, spec: FeatureSpec, columns: Columns) -> pl.DataFrame:
    """The features with polars. Means and standard deviations are spelt out as sums in a fixed
    order (spark_features.py does the same sums in the same order), so both backends give the same
    floats, not merely close ones: a model's results then do not depend on the backend."""
    return with_groups(series_features(frame, spec, columns), group_features(frame, spec, columns))


def series_features(frame: pl.DataFrame, spec: FeatureSpec, columns: Columns) -> pl.DataFrame:
    """The rows with every feature that reads one series only (all but the group statistics):
    a batch of whole series gets the same values as the whole table."""
    ts, y = columns.timestamp, columns.target
    frame = _in_order(frame, columns)
    exprs: list[pl.Expr] = [_lagged(pl.col(y), k).alias(f"lag{k}") for k in spec.lags]
    for name, w, stat in spec.rolling_columns:
        exprs.append(_rolling(pl.col(_BASE), w, stat).alias(name))
    for name, stat in spec.expanding_columns:
        exprs.append(_expanding(pl.col(_BASE), stat).over(_RUN).alias(name))
    exprs += [
        _CALENDAR[part](pl.col(ts)).cast(pl.Int32).alias(name)
        for name, part in spec.calendar_columns
    ]
    return (
        frame.with_columns(_shifted(spec, columns))
        .with_columns(exprs)
        .drop(_BASE, _RUN)
        .with_columns(pl.col(_per_series(spec)).cast(pl.Float64))
    )


def group_features(
    frame: pl.DataFrame, spec: FeatureSpec, columns: Columns
) -> list[tuple[list[str], pl.DataFrame]]:
    """The group statistics: per group, a table keyed by its columns and the timestamp, to join
    to the rows (`with_groups`). It reads only the keys and the target of every series."""
    if not spec.group_columns:
        return []
    ids, ts = list(columns.ids), columns.timestamp
    numbered = [SERIES] if SERIES in frame.columns else []
    read = [*numbered, *ids, *(c for g in spec.group_by for c in g), ts, columns.target]
    base = _in_order(frame.select(list(dict.fromkeys(read))), columns)  # what it orders by too
    base = base.with_columns(_shifted(spec, columns))
    tables = []
    for group in spec.group_by:
        keys = [*group, ts]
        stats = [(name, stat) for name, g, stat in spec.group_columns if g == group]
        table = base.group_by(keys, maintain_order=True).agg(
            _aggregate(pl.col(_BASE), stat).alias(name) for name, stat in stats
        )
        tables.append((keys, table.with_columns(pl.col(n).cast(pl.Float64) for n, _ in stats)))
    return tables


def with_groups(rows: pl.DataFrame, groups: list[tuple[list[str], pl.DataFrame]]) -> pl.DataFrame:
    """`series_features`' rows with the group statistics (`group_features`) of their groups."""
    order = rows.columns
    for keys, table in groups:
        rows = rows.join(table, on=keys, how="left", nulls_equal=True, maintain_order="left")
        order += [c for c in table.columns if c not in keys]
    return rows.select(order)


_BASE = "_shifted"
_RUN = "_run"


def _in_order(frame: pl.DataFrame, columns: Columns) -> pl.DataFrame:
    """`frame` in series and time order, each series' rows numbered by one integer (`_RUN`):
    windows over it are much cheaper than over the id strings, which polars would hash for every
    feature. A table from `load_series` is in that order already, its series numbered
    (`SERIES`), and is used as it is; any other is sorted by its ids and time."""
    if SERIES in frame.columns and frame[SERIES].is_sorted():
        return frame.with_columns(pl.col(SERIES).alias(_RUN))
    ids = list(columns.ids)
    return frame.sort([*ids, columns.timestamp]).with_columns(run_numbers(ids).alias(_RUN))


def _lagged(x: pl.Expr, k: int) -> pl.Expr:
    """`x` k rows back in the same series (null for a series' first k rows): a shift of the
    whole column with the values of the series before masked."""
    return pl.when(_within(k)).then(x.shift(k))


def _shifted(spec: FeatureSpec, columns: Columns) -> pl.Expr:
    """The target `spec.shift` rows back: what rolling, expanding and group statistics read."""
    return _lagged(pl.col(columns.target), spec.shift).alias(_BASE)


def _per_series(spec: FeatureSpec) -> list[str]:
    """The numeric features `series_features` computes (all but the group statistics)."""
    groups = {name for name, _, _ in spec.group_columns}
    return [c for c in spec.numeric_columns() if c not in groups]


def _rolling(x: pl.Expr, window: int, stat: str) -> pl.Expr:
    """Over the `window` values up to each row of a series, null unless all are there. The sums
    run from the newest value to the oldest, as spark_features.py's do. It runs on the whole
    column (a window per series made polars evaluate the expression series by series: 6× slower
    on 5,000 series): a value from the series before is masked (`_within`)."""
    if stat in ("min", "max"):
        rolled = x.rolling_min if stat == "min" else x.rolling_max
        return pl.when(_within(window - 1)).then(rolled(window, min_samples=window))
    lagged = [x] + [_lagged(x, k) for k in range(1, window)]
    mean, var = window_moments(lagged)
    moment: pl.Expr = mean if stat == "mean" else var.sqrt()
    return moment


def _within(k: int) -> pl.Expr:
    """Whether the row k rows up belongs to the same series (`_RUN`)."""
    return pl.col(_RUN).shift(k) == pl.col(_RUN)


def window_moments(values: list[Any]) -> tuple[Any, Any]:
    """The mean and sample variance of a window's values (polars expressions or Spark columns,
    newest first), as sums in that order, each × the reciprocal of its count: polars divides by
    a constant that way, and spark_features.py calls this too, so both backends give the same
    floats."""
    n = len(values)
    mean = reduce(operator.add, values) * (1.0 / n)
    var = reduce(operator.add, [(v - mean) * (v - mean) for v in values]) * (1.0 / (n - 1))
    return mean, var


def _expanding(x: pl.Expr, stat: str) -> pl.Expr:
    count = x.is_not_null().cum_sum()
    if stat in ("mean", "std"):
        # Centre on the series' first value: variance is shift-invariant and the sums stay small,
        # so the one-pass formula keeps its precision on series with a large level.
        first = x.drop_nulls().first()
        centred = (x - first).fill_null(0.0)
        s1, s2 = centred.cum_sum(), (centred * centred).cum_sum()
        if stat == "mean":
            return pl.when(count > 0).then(s1 / count + first)
        var = (s2 - s1 * s1 / count) / (count - 1)
        return pl.when(count > 1).then(var.clip(lower_bound=0.0).sqrt())
    filled = x.fill_null(float("inf") if stat == "min" else float("-inf"))
    running = filled.cum_min() if stat == "min" else filled.cum_max()
    return pl.when(count > 0).then(running)


def _aggregate(x: pl.Expr, stat: str) -> pl.Expr:
    """A group statistic at one timestamp over its rows in id order (an aggregation): sums
    accumulated in that order (`cum_sum`), as Spark's ordered window does; the std in two
    passes."""
    if stat in ("min", "max"):
        return x.min() if stat == "min" else x.max()
    count = x.is_not_null().sum()
    mean = pl.when(count > 0).then(x.fill_null(0.0).cum_sum().last() / count)
    if stat == "mean":
        return mean
    squares = ((x - mean) * (x - mean)).fill_null(0.0).cum_sum().last()
    return pl.when(count > 1).then((squares / (count - 1)).sqrt())
