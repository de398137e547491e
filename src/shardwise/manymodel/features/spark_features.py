"""The Spark backend of the feature spec: the same columns as `features.polars_features`, written
with Spark's window functions (lag, rows-between frames, partition aggregates), so the work is
distributed by series over the cluster with no Python UDFs. The executors read the input from
Parquet and write the features to Parquet (`feature_files`): no row passes through the driver.

The input is the user's own Parquet file where its column types let Spark read the same values
the driver's checks kept (`SourceFile`), and otherwise the driver's checked copy of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import polars as pl

from shardwise.common.spark_session import session
from shardwise.manymodel.columns import CHUNK_KEY, FUTURE, SERIES, Columns
from shardwise.manymodel.features.spec import FeatureSpec, window_moments

FIRST, LAST = "_first", "_last"
"""`SourceFile.keys`' columns: the times of a series' first and last observations."""


@dataclass(frozen=True)
class SourceFile:
    """The user's Parquet file, which the executors read themselves, and what the driver's checks
    (`data.load_series`) made of it, in two small tables: `keys`, one row per series kept (its
    ids, its number `SERIES`, and the times of its first and last observations, `FIRST` and
    `LAST`), and `future`, the rows the driver adds after them (the horizon's, in the checked
    table's columns). The rows of a kept series between those times, typed as the checks type
    them, and then the future rows, are the checked table."""

    path: str
    keys: Path
    future: Path
    nanos: bool
    """Its timestamps are in nanoseconds (pandas' unit), which Spark reads only as integers."""


def source_file_problem(source: str, columns: Columns) -> str | None:
    """Why the executors cannot read `source` (data.source) themselves and get the values the
    driver's checks kept (None when they can): only a local Parquet file (on a cluster, a path on
    storage every executor sees) whose column types both read alike; text the driver parses, and
    decimals, are not."""
    if "://" in source:
        return "a URL, which Spark may not reach as fsspec does"
    if PurePosixPath(source).suffix.lower() not in (".parquet", ".pq"):
        return "not Parquet"
    schema = pl.read_parquet_schema(source)
    ts = schema.get(columns.timestamp)
    if not isinstance(ts, pl.Date | pl.Datetime):
        return f"its column '{columns.timestamp}' is {ts}, not a date or time"
    for name in columns.ids:
        if not (schema[name] in (pl.String, pl.Categorical) or schema[name].is_integer()):
            return f"its id column '{name}' is {schema[name]}, not text or integers"
    for name in (columns.target, *columns.covariates):
        kind = schema[name]
        if not (kind.is_integer() or kind in (pl.Float32, pl.Float64, pl.Null)):
            return f"its column '{name}' is {kind}, not integers or floats"
    return None


def spark_features(
    source: Path | SourceFile,
    spec: FeatureSpec,
    columns: Columns,
    *,
    master: str,
    out: Path,
    size: int,
    chunks: list[int],
    time_zone: str | None = None,
) -> None:
    """Read the input table from `source` (the driver's checked copy, or the user's file),
    compute the features and write them to `out`, one directory per chunk of `size` series
    (`feature_files`' layout), only `chunks`. The rows go from files to files through the
    executors, never through this process. `time_zone`: the timestamps' zone, where the calendar
    parts are taken (as polars does)."""
    spark = session(master)
    settings = {"spark.sql.session.timeZone": time_zone or "UTC"}
    if isinstance(source, SourceFile) and source.nanos:
        settings["spark.sql.legacy.parquet.nanosAsLong"] = "true"
    before = {key: spark.conf.get(key, None) for key in settings}
    for key, value in settings.items():
        spark.conf.set(key, value)
    try:
        data = _input(spark, source, columns, naive=time_zone is None)
        _write_features(data, spec, columns, out=out, size=size, chunks=chunks)
    finally:
        for key, value in before.items():
            if value is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, value)


def _input(spark: Any, source: Path | SourceFile, columns: Columns, *, naive: bool) -> Any:
    """The checked table (`data.load_series`' columns and values): the driver's copy as it is,
    or the user's file typed as the checks type it (ids as text, numbers as doubles, NaN as
    missing, nanoseconds as whole microseconds rounded down, as polars casts them), its kept
    series' rows between their first and last observations, and the future rows."""
    if not isinstance(source, SourceFile):
        return spark.read.parquet(str(source))
    from pyspark.sql import functions as F  # noqa: N812 (the conventional name)

    ids, ts = list(columns.ids), columns.timestamp
    numbers = [columns.target, *columns.covariates]
    when = F.col(ts)
    if source.nanos:
        name = f"`{ts}`"
        when = F.timestamp_micros(F.expr(f"({name} - pmod({name}, 1000)) div 1000"))
        when = when.cast("timestamp_ntz") if naive else when
    missing = F.lit(None).cast("double")
    rows = spark.read.parquet(source.path).select(
        *(F.col(c).cast("string").alias(c) for c in ids),
        when.alias(ts),
        *(F.nanvl(F.col(c).cast("double"), missing).alias(c) for c in numbers),
    )
    kept = rows.join(F.broadcast(spark.read.parquet(str(source.keys))), on=ids)
    kept = kept.filter(F.col(ts).between(F.col(FIRST), F.col(LAST)))
    kept = kept.select(SERIES, *ids, ts, *numbers, F.lit(False).alias(FUTURE))
    return kept.unionByName(spark.read.parquet(str(source.future)))


def _write_features(
    data: Any,
    spec: FeatureSpec,
    columns: Columns,
    *,
    out: Path,
    size: int,
    chunks: list[int],
) -> None:
    from pyspark.sql import Window
    from pyspark.sql import functions as F  # noqa: N812 (the conventional name)

    # a series is its number (SERIES, in id order), not its id strings: cheaper to hash and sort
    ts, y = columns.timestamp, columns.target
    by_time = Window.partitionBy(SERIES).orderBy(ts)
    chunk = F.floor(F.col(SERIES) / size).cast("long")
    if not spec.group_columns:  # a group statistic reads the other chunks' series too
        data = data.filter(chunk.isin(chunks))
    data = data.repartition(SERIES)
    base = "_shifted"
    data = data.withColumn(base, F.lag(y, spec.shift).over(by_time))
    shifted = F.col(base)
    exprs = [F.lag(y, k).over(by_time).alias(f"lag{k}") for k in spec.lags]
    for name, window, stat in spec.rolling_columns:
        exprs.append(_rolling(F, shifted, by_time, window, stat).alias(name))
    whole = by_time.rowsBetween(Window.unboundedPreceding, Window.unboundedFollowing)
    for name, stat in spec.expanding_columns:
        exprs.append(_expanding(F, Window, shifted, by_time, whole, stat).alias(name))
    exprs += [
        _calendar(F, F.col(ts), part).cast("int").alias(name)
        for name, part in spec.calendar_columns
    ]
    data = data.select("*", *exprs)
    exprs = []
    for name, group, stat in spec.group_columns:
        # every series at one timestamp, in id order: the order polars sums them in
        keyed = Window.partitionBy(*group, ts).orderBy(SERIES)
        keyed = keyed.rowsBetween(Window.unboundedPreceding, Window.unboundedFollowing)
        exprs.append(_aggregate(F, shifted, keyed, stat).alias(name))
    data = data.select("*", *exprs, chunk.alias(CHUNK_KEY)).drop(base)
    data = data.filter(F.col(CHUNK_KEY).isin(chunks))
    # one task per chunk, so each chunk's directory gets one file
    data.repartition(CHUNK_KEY).write.partitionBy(CHUNK_KEY).mode("append").parquet(str(out))


def _rolling(F: Any, x: Any, by_time: Any, window: int, stat: str) -> Any:  # noqa: N803
    """features._rolling: the same window_moments over the same values, newest first."""
    if stat in ("min", "max"):
        frame_w = by_time.rowsBetween(-(window - 1), 0)
        full = F.count(x).over(frame_w) == window
        return F.when(full, (F.min if stat == "min" else F.max)(x).over(frame_w))
    mean, var = window_moments([x, *(F.lag(x, k).over(by_time) for k in range(1, window))])
    return mean if stat == "mean" else F.sqrt(var)


def _expanding(F: Any, Window: Any, x: Any, by_time: Any, whole: Any, stat: str) -> Any:  # noqa: N803
    """features._expanding's running sums (Spark adds a growing frame's rows in time order, as
    polars' cum_sum does)."""
    growing = by_time.rowsBetween(Window.unboundedPreceding, 0)
    count = F.count(x).over(growing)
    if stat in ("min", "max"):
        return F.when(count > 0, (F.min if stat == "min" else F.max)(x).over(growing))
    first = F.first(x, ignorenulls=True).over(whole)
    centred = F.coalesce(x - first, F.lit(0.0))
    s1, s2 = F.sum(centred).over(growing), F.sum(centred * centred).over(growing)
    if stat == "mean":
        return F.when(count > 0, s1 / count + first)
    var = (s2 - s1 * s1 / count) / (count - 1)
    return F.when(count > 1, F.sqrt(F.greatest(var, F.lit(0.0))))


def _aggregate(F: Any, x: Any, keyed: Any, stat: str) -> Any:  # noqa: N803
    """features._aggregate: sums over the group's rows in id order; the std in two passes."""
    if stat in ("min", "max"):
        return (F.min if stat == "min" else F.max)(x).over(keyed)
    count = F.count(x).over(keyed)
    mean = F.when(count > 0, F.sum(x).over(keyed) / count)
    if stat == "mean":
        return mean
    squares = F.sum((x - mean) * (x - mean)).over(keyed)
    return F.when(count > 1, F.sqrt(squares / (count - 1)))


def _calendar(F: Any, ts: Any, part: str) -> Any:  # noqa: N803
    if part == "day_of_week":
        return (F.dayofweek(ts) + 5) % 7 + 1  # Spark: Sunday = 1; polars and ISO: Monday = 1
    return {
        "year": F.year,
        "quarter": F.quarter,
        "month": F.month,
        "week": F.weekofyear,
        "day_of_month": F.dayofmonth,
        "day_of_year": F.dayofyear,
        "hour": F.hour,
    }[part](ts)
