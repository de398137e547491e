"""Reading and checking the long table: one row per series and timestamp.

`load_series` returns the observed rows plus `horizon` future rows per series (empty target,
covariates when the input has them), sorted by series and time, with an integer series index
`_series`. Mistakes in the input (an empty or unreadable file, missing columns, empty ids or
timestamps, text or infinite values in the target, duplicate rows, gaps, a season or horizon
longer than every series) are one-line `ConfigError`s, found before any work that grows with
them; series too short for the backtest are dropped and listed, not fatal.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

import polars as pl

from shardwise.common.errors import ConfigError
from shardwise.manymodel.columns import FUTURE, SERIES, Columns, run_numbers
from shardwise.manymodel.config import BUILTIN_SOURCES, ManyModelsConfig
from shardwise.manymodel.data import calendar

_SEASONS = {"1mo": 12, "3mo": 4, "1q": 4, "1w": 52, "7d": 52, "1d": 7, "1h": 24, "1y": 1}


@dataclass
class SeriesTable:
    frame: pl.DataFrame
    columns: Columns
    freq: str
    season_length: int
    skipped: pl.DataFrame
    """Series left out, with their number of observations and the reason."""

    @property
    def num_series(self) -> int:
        """The series are numbered 0 … n − 1 in row order: the last row's number + 1."""
        return int(self.frame[SERIES][-1]) + 1 if self.frame.height else 0

    def series_ids(self) -> pl.DataFrame:
        """One row per series, its number and ids; row i is series i (the frame is in series
        order: the first row of each)."""
        first = (pl.col(SERIES) != pl.col(SERIES).shift(1)).fill_null(True)
        return self.frame.select(SERIES, *self.columns.ids).filter(first)


def read_table(config: ManyModelsConfig) -> tuple[pl.DataFrame, Columns]:
    """The raw long table and its column roles, from a built-in source or a file/URL."""
    data = config.data
    if data.source in BUILTIN_SOURCES:
        from shardwise.manymodel.data import datasets

        if data.source == "us_employment":
            builtin = datasets.us_employment()
        else:
            builtin = datasets.retail_synthetic(
                data.num_series or 1000,
                data.periods,
                future=config.backtest.horizon,
                seed=config.job.seed,
            )
        columns = Columns(
            ids=tuple(data.id_columns) or builtin.ids,
            timestamp=data.timestamp or builtin.timestamp,
            target=data.target or builtin.target,
            covariates=tuple(data.covariates) or builtin.covariates,
        )
        return builtin.frame, columns
    if not (data.id_columns and data.timestamp and data.target):
        raise ConfigError(
            f"data.source = '{data.source}' is a file: set data.id_columns, data.timestamp "
            "and data.target to its column names"
        )
    columns = Columns(tuple(data.id_columns), data.timestamp, data.target, tuple(data.covariates))
    return _read_file(data.source, columns), columns


def _read_file(source: str, columns: Columns) -> pl.DataFrame:
    """The file's rows; of a Parquet file, only the job's columns, its ids as categoricals
    (`_parquet_rows`)."""
    import fsspec

    suffix = PurePosixPath(source.split("?")[0]).suffix.lower()
    if suffix not in (".csv", ".parquet", ".pq"):
        raise ConfigError(
            f"data.source = '{source}': expected a .csv or .parquet file, or a built-in source "
            f"({', '.join(BUILTIN_SOURCES)})"
        )
    try:
        with fsspec.open(source, "rb") as handle:
            if suffix == ".csv":
                # ids are names as written ("007" is not "07" or 7)
                text = dict.fromkeys(columns.ids, pl.String)
                frame = pl.read_csv(handle, try_parse_dates=True, schema_overrides=text)
            else:
                frame = _parquet_rows(handle, columns)
    except FileNotFoundError:
        raise ConfigError(f"data.source = '{source}' does not exist; check the path") from None
    except pl.exceptions.NoDataError:
        raise ConfigError(
            f"data.source = '{source}' is empty; it needs a header and one row per series and "
            "timestamp"
        ) from None
    except (pl.exceptions.PolarsError, OSError) as e:
        raise ConfigError(f"data.source = '{source}' could not be read: {_one_line(e)}") from None
    if frame.height == 0:
        raise ConfigError(
            f"data.source = '{source}' has column names but no rows; it needs one row per series "
            "and timestamp"
        )
    return frame


def _parquet_rows(handle: Any, columns: Columns) -> pl.DataFrame:
    """A Parquet file's rows of the job's columns (the others are not read), read in batches
    that each turn their ids into categoricals: the id strings, most of the file's bytes once
    decoded, are never all in memory at once."""
    scan = pl.scan_parquet(handle)
    _check_columns(scan.collect_schema().names(), columns)
    return (
        scan.select(columns.named)
        .with_columns(_categories(columns.ids))
        .collect(engine="streaming")
    )


def _one_line(error: BaseException, limit: int = 300) -> str:
    """A library's multi-line message as one trimmed line, cut at `limit` characters (a CSV
    parser quotes the offending field, which can be the rest of the file)."""
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def load_series(config: ManyModelsConfig) -> SeriesTable:
    """Read, check and prepare the series for features and backtesting.

    Each row gets its series' number (`SERIES`, in id order) first, and the id columns are set
    aside, one row per series, until the end: the sorting, filtering and checks in between move
    and hash integers, not the id strings, which are most of a long table's bytes (the driver's
    memory peaks here)."""
    raw, columns = read_table(config)
    _check_groups(config, columns)
    frame = _typed(raw, columns)
    del raw
    ids, ts, y = list(columns.ids), columns.timestamp, columns.target
    frame, names = _numbered(frame, ids)
    frame = frame.sort(SERIES, ts)
    _check_duplicates(frame, columns, names)
    # Rows before a series' first observation carry nothing; rows after its last observation are
    # the future (they may hold known covariates).
    observed = pl.col(y).is_not_null()
    started = observed.cum_max().over(SERIES)
    more_to_come = observed.reverse().cum_max().reverse().over(SERIES)
    planned = frame.filter(started & ~more_to_come)
    frame = frame.filter(started & more_to_come)
    if config.data.num_series:
        keep = frame[SERIES].unique(maintain_order=True).head(config.data.num_series)
        frame = frame.filter(pl.col(SERIES).is_in(keep.implode()))
    if frame.height == 0:
        raise ConfigError(f"the table has no rows with a value in '{y}'")
    freq = config.data.freq or calendar.infer(frame, columns.timestamp)
    _check_regular(frame, columns, freq, bool(config.data.freq), names)
    season = config.data.season_length or _SEASONS.get(freq, 1)
    frame, skipped = _drop_short(frame, columns, config, season, names)
    frame = _append_future(frame, planned, columns, freq, config.backtest.horizon)
    del planned
    frame = _with_ids(frame, names)  # and numbered 0 … n − 1 again, after the series dropped
    if config.hierarchy.levels:  # the sums of every level become series too
        from shardwise.manymodel.hierarchy.levels import aggregate, check_levels

        check_levels(config.hierarchy.levels, columns)
        if config.features.group_by:
            raise ConfigError(
                "features.group_by cannot be combined with hierarchy.levels: a group's "
                "statistics would mix its series with the sums of them; drop one"
            )
        frame = aggregate(frame.drop(SERIES), columns, config.hierarchy.levels)
        # an aggregate series has nulls in the id columns it sums over
        frame = frame.with_columns(run_numbers(ids).alias(SERIES))
    table = SeriesTable(
        frame=frame.select(SERIES, *ids, ts, y, *columns.covariates, FUTURE),
        columns=columns,
        freq=freq,
        season_length=season,
        skipped=skipped,
    )
    if config.hierarchy.levels:  # what the reconcilers would need, before any model runs
        from shardwise.manymodel.hierarchy.levels import check_methods

        check_methods(config.hierarchy.methods, table.num_series)
    return table


def _numbered(frame: pl.DataFrame, ids: list[str]) -> tuple[pl.DataFrame, pl.DataFrame]:
    """`frame` with its series' numbers (`SERIES`: 0 … n − 1, in the ids' lexical order) instead
    of its id columns, and those columns, one row per series, in a table whose row i is series
    i. The ids are ranked as the categoricals `_typed` leaves them (lexical order, as strings
    sort): integer codes are a quarter of the bytes of the strings, and ranking them is faster."""
    frame = frame.with_columns((pl.struct(ids).rank("dense") - 1).cast(pl.Int64).alias(SERIES))
    names = frame.group_by(SERIES).agg(pl.col(ids).first()).sort(SERIES)
    return frame.drop(ids), names.with_columns(pl.col(ids).cast(pl.String))


def _with_ids(frame: pl.DataFrame, names: pl.DataFrame) -> pl.DataFrame:
    """`frame` (sorted by `SERIES`, some series dropped) numbered 0 … n − 1 again, with each
    row's ids from `names` (`_numbered`'s table)."""
    ids = names.drop(SERIES)
    return frame.with_columns(
        *(ids[c].gather(frame[SERIES]) for c in ids.columns),
        pl.col(SERIES).rle_id().cast(pl.Int64),
    )


def _ids_of(names: pl.DataFrame, series: int) -> str:
    """A series' ids as `store=n, item=3`, for messages."""
    return ", ".join(f"{k}={v}" for k, v in names.row(series, named=True).items() if k != SERIES)


def _check_groups(config: ManyModelsConfig, columns: Columns) -> None:
    """Group features aggregate over series that share id or covariate values."""
    allowed = (*columns.ids, *columns.covariates)
    for group in config.features.group_by:
        for name in group:
            if name not in allowed:
                raise ConfigError(
                    f"features.group_by names '{name}', which is not one of data.id_columns or "
                    f"data.covariates ({', '.join(allowed)}); group by those columns"
                )


def _typed(raw: pl.DataFrame, columns: Columns) -> pl.DataFrame:
    _check_columns(raw.columns, columns)
    ts = columns.timestamp
    frame = raw.select(columns.named)
    if frame.schema[ts] == pl.String:
        frame = frame.with_columns(_parsed_times(frame[ts]))
    if not frame.schema[ts].is_temporal():
        raise ConfigError(f"column '{ts}' is {frame.schema[ts]}, not a date or time")
    numbers = [columns.target, *columns.covariates]
    for name in numbers:
        if frame.schema[name] == pl.String:  # a column CSV could not read as numbers
            frame = frame.with_columns(_parsed_numbers(frame[name]))
        if not (frame.schema[name].is_numeric() or frame.schema[name] == pl.Null):
            raise ConfigError(f"column '{name}' is {frame.schema[name]}; it must be numeric")
    text = [c for c in columns.ids if frame.schema[c] != pl.Categorical]
    frame = frame.with_columns(_categories(text), pl.col(numbers).cast(pl.Float64))
    for name in (*columns.ids, ts):
        _refuse_rows(frame, pl.col(name).is_null(), f"no value in column '{name}'", "fill or drop")
    for name in numbers:
        infinite = f"an infinite value (inf or -inf) in column '{name}'"
        _refuse_rows(frame, pl.col(name).is_infinite(), infinite, "leave empty (missing) or drop")
    return frame.with_columns(pl.col(numbers).fill_nan(None))


def _categories(ids: Sequence[str]) -> pl.Expr:
    """Id columns as categoricals of their text (integer ids too: `10` sorts before `9`)."""
    return pl.col(ids).cast(pl.String).cast(pl.Categorical)


def _check_columns(names: list[str], columns: Columns) -> None:
    """Every column the job names is among the table's `names`."""
    missing = [c for c in columns.named if c not in names]
    if missing:
        raise ConfigError(
            f"the table has no column{'s' if len(missing) > 1 else ''} "
            f"{', '.join(repr(c) for c in missing)}; its columns are {', '.join(names)} "
            "(set data.id_columns, data.timestamp, data.target, data.covariates)"
        )


def _refuse_rows(frame: pl.DataFrame, bad: pl.Expr, what: str, fix: str) -> None:
    rows = frame.with_row_index("_row", offset=1).filter(bad)["_row"]
    if rows.len():
        count = "1 row has" if rows.len() == 1 else f"{rows.len()} rows have"
        raise ConfigError(f"{count} {what}, e.g. row {rows[0]} of the table; {fix} those values")


def _parsed_times(text: pl.Series) -> pl.Series:
    """Dates or times from text, or a one-line error naming a value that is neither."""
    try:
        return text.str.to_datetime()
    except pl.exceptions.PolarsError:
        pass
    try:  # polars takes the format from the first value: find the values not in it
        parsed = text.str.to_datetime(strict=False)
        bad = text.filter(parsed.is_null() & text.is_not_null())
    except pl.exceptions.PolarsError:  # the first value has no known format
        bad = text.drop_nulls()
    example = f"e.g. {bad[0]!r} in {bad.len()} rows" if bad.len() else f"first value {text[0]!r}"
    raise ConfigError(
        f"column '{text.name}' holds text that is not a date or time ({example}); use ISO dates "
        "such as 2024-01-31 throughout"
    )


def _parsed_numbers(text: pl.Series) -> pl.Series:
    """Numbers from a text column whose every value reads as one (CSV reads a column with no
    values as text), or a one-line error naming a value that is not a number."""
    parsed = text.cast(pl.Float64, strict=False)
    bad = text.filter(parsed.is_null() & text.is_not_null())
    if bad.len():
        count = f"{bad.len()} values are not numbers" if bad.len() > 1 else "1 is not a number"
        raise ConfigError(
            f"column '{text.name}' is String; it must be numeric ({count}, e.g. {bad[0]!r}; "
            "leave missing values empty)"
        )
    return parsed


def _check_duplicates(frame: pl.DataFrame, columns: Columns, names: pl.DataFrame) -> None:
    """`frame` is sorted by series and time: a duplicate is a row equal to the one before."""
    ts = columns.timestamp
    repeated = (pl.col(SERIES) == pl.col(SERIES).shift(1)) & (pl.col(ts) == pl.col(ts).shift(1))
    marked = frame.select(SERIES, ts, repeated.fill_null(False).alias("_again"))
    # a run of equal rows is one duplicated pair: count the runs' first repeats
    runs = marked.filter(pl.col("_again") & ~pl.col("_again").shift(1).fill_null(False))
    if runs.height:
        first = runs.row(0, named=True)
        rows = frame.filter((pl.col(SERIES) == first[SERIES]) & (pl.col(ts) == first[ts]))
        where = f"{_ids_of(names, first[SERIES])}, {ts}={first[ts]}"
        raise ConfigError(
            f"{runs.height} (series, {ts}) pairs appear more than once, e.g. "
            f"{where} ({rows.height} rows); aggregate or deduplicate the table first"
        )


def _check_regular(
    frame: pl.DataFrame, columns: Columns, freq: str, given: bool, names: pl.DataFrame
) -> None:
    """Every row follows its series' row before by one step of `freq` (`given`: data.freq set,
    else inferred); a one-line error naming the first that does not, and what to change."""
    ts = columns.timestamp
    before = (
        pl.col(ts).shift(1).over(SERIES).alias("_before")
    )  # computed once, kept for the message
    bad = frame.with_columns(before).filter(calendar.off_step(ts, freq, pl.col("_before")))
    if not bad.height:
        return
    row = bad.row(0, named=True)
    where = (
        f"{bad.height} {'rows do' if bad.height > 1 else 'row does'} not follow the previous "
        f"one by {freq} "
        f"({'data.freq' if given else 'inferred from the data'}), e.g. series "
        f"{_ids_of(names, row[SERIES])} at {row[ts]} (after {row['_before']})"
    )
    own = calendar.infer(frame, ts) if given else freq
    if own != freq:
        raise ConfigError(
            f'{where}; the data steps by {own}: set data.freq = "{own}" or leave it empty to '
            "infer it"
        )
    fix = "" if given else " or set data.freq"
    raise ConfigError(f"{where}; add the missing rows (empty target){fix}")


def _append_future(
    frame: pl.DataFrame, planned: pl.DataFrame, columns: Columns, freq: str, horizon: int
) -> pl.DataFrame:
    ts = columns.timestamp
    last = frame.group_by(SERIES).agg(
        pl.col(ts).max().alias("_last"), pl.col(ts).dt.day().max().alias(calendar.ANCHOR)
    )
    steps = [
        last.select(
            SERIES,
            calendar.after(pl.col("_last"), freq, k, pl.col(calendar.ANCHOR)).alias(ts),
        )
        for k in range(1, horizon + 1)
    ]
    future = pl.concat(steps).with_columns(pl.lit(None, dtype=pl.Float64).alias(columns.target))
    if columns.covariates:
        future = future.join(
            planned.select(SERIES, ts, *columns.covariates), on=[SERIES, ts], how="left"
        )
    else:
        future = future.select(SERIES, ts, columns.target)
    future = future.with_columns(
        pl.col(ts).cast(frame.schema[ts]), pl.lit(True).alias(FUTURE)
    ).select(*frame.columns, FUTURE)
    # both sorted by series and time: merged, not sorted again (a copy of the table less)
    observed = frame.with_columns(pl.lit(False).alias(FUTURE))
    return observed.merge_sorted(future.sort(SERIES, ts), key=[SERIES, ts])


def required_observations(config: ManyModelsConfig, reach: int, season: int) -> int:
    """Observations a series needs: feature warm-up + training rows + every backtest window."""
    bt = config.backtest
    min_train = bt.min_train or max(2 * season, 10)
    return reach + min_train + bt.horizon + (bt.n_windows - 1) * config.backtest_step


def _drop_short(
    frame: pl.DataFrame,
    columns: Columns,
    config: ManyModelsConfig,
    season: int,
    names: pl.DataFrame,
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Drop the series too short for the backtest, before any work that grows with the horizon,
    the season or the lags: values too large for every series fail here, in one line. The
    series dropped, by their ids, with their number of observations and the reason."""
    from shardwise.manymodel.features.spec import FeatureSpec

    counts = frame.group_by(SERIES, maintain_order=True).agg(pl.len().alias("observations"))
    longest = int(counts["observations"].max())  # type: ignore[arg-type]
    if config.data.season_length > longest:
        raise ConfigError(
            f"data.season_length = {config.data.season_length} is longer than the longest series "
            f"({longest} observations); set the steps in one season (12 for monthly data, 7 "
            "for daily) or 0 to derive it from the frequency"
        )
    if config.backtest.horizon >= longest:
        raise ConfigError(
            f"backtest.horizon = {config.backtest.horizon} is not shorter than the longest series "
            f"({longest} observations); the backtest needs training rows before every window: "
            "lower backtest.horizon"
        )
    reach = FeatureSpec.from_config(config, season).reach()  # 0 where no model reads features
    need = required_observations(config, reach, season)
    short = counts.filter(pl.col("observations") < need).with_columns(
        pl.format("{} observations, the backtest needs {}", "observations", pl.lit(need)).alias(
            "reason"
        )
    )
    if short.height == counts.height:
        warm_up, lower = (
            ("feature warm-up + ", "the longest lag or window, ") if reach else ("", "")
        )
        raise ConfigError(
            f"every series is too short: the backtest needs {need} observations ({warm_up}"
            f"backtest.min_train + the windows) and the longest has {longest}; lower {lower}"
            "backtest.min_train, n_windows or horizon"
        )
    dropped = names.join(short, on=SERIES, maintain_order="left").drop(SERIES)
    return frame.filter(~pl.col(SERIES).is_in(short[SERIES].implode())), dropped
