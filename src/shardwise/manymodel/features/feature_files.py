"""The feature table on disk, one directory per chunk of series, so the driver never holds all
of it: polars computes it a batch of chunks at a time, Spark's executors write it themselves, and
the runner reads a chunk back when it submits the chunk's task.

Layout: `<root>/chunks/chunk=<i>/*.parquet` (the shape of Spark's partitioned output too); chunk
i holds series i·size … (i+1)·size − 1. Spark reads the user's Parquet file itself where it can
(`spark.SourceFile`: with `<root>/keys.parquet` and `<root>/future.parquet`, the series kept and
the rows added by the driver's checks), and otherwise `<root>/input.parquet`, the driver's checked
copy (from the driver's disk locally; on a cluster `job.run_dir` must be storage every executor
sees).
"""

from __future__ import annotations

import itertools
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from shardwise.common.errors import ConfigError
from shardwise.manymodel.columns import CHUNK_KEY, FUTURE, SERIES, Columns
from shardwise.manymodel.features.spark_features import (
    FIRST,
    LAST,
    SourceFile,
    source_file_problem,
    spark_features,
)
from shardwise.manymodel.features.spec import (
    FeatureSpec,
    group_features,
    series_features,
    with_groups,
)

BATCH_ROWS = 500_000
"""Rows of input the polars backend turns into features at a time (≈ 100 MB of features with
twenty columns): what bounds the driver's memory for features, whatever the number of series."""


@dataclass(frozen=True)
class FeatureChunks:
    """Where the chunks' features are, and what the runner needs to know of each chunk without
    reading it."""

    root: Path
    size: int
    """Series per chunk."""
    series: int
    rows: tuple[int, ...]
    """Input rows per chunk: the work grows with them (`ray_tasks.run_chunks` runs long ones
    first)."""
    schema: pl.Schema
    timestamp: str
    made_by: str = "polars"
    """Which backend computed the features, and from what (Spark: the user's file or the
    driver's copy, and why)."""

    def __len__(self) -> int:
        return len(self.rows)

    def series_of(self, index: int) -> range:
        return range(index * self.size, min((index + 1) * self.size, self.series))

    def read(self, index: int) -> pl.DataFrame:
        """Chunk `index`'s feature rows, in series and time order, with the polars backend's
        column types (Spark writes some types its own way)."""
        files = sorted((self.root / "chunks" / f"{CHUNK_KEY}={index}").glob("*.parquet"))
        frame = pl.read_parquet(files, hive_partitioning=False)
        return (
            frame.select(self.schema.names())
            .cast(self.schema)
            .sort(SERIES, self.timestamp, maintain_order=True)
        )


def write_features(
    frame: pl.DataFrame,
    spec: FeatureSpec,
    columns: Columns,
    root: Path,
    size: int,
    chunks: Iterable[int] | None = None,
    *,
    backend: str = "polars",
    spark_master: str = "",
    source: str | None = None,
    batch_rows: int = BATCH_ROWS,
) -> FeatureChunks:
    """Compute the features of `frame` (load_series' table: series numbered 0 … n − 1) and write
    them under `root`, chunk by chunk (`chunks`: only those; all by default). `source`: the file
    `frame` was read from (data.source), which Spark reads itself where it can; None when `frame`
    is not the file's rows (a built-in source, a hierarchy's sums)."""
    if not frame[SERIES].is_sorted():
        frame = frame.sort(SERIES, columns.timestamp, maintain_order=True)
    n_series = int(frame[SERIES].max()) + 1 if frame.height else 0  # type: ignore[arg-type]
    n_chunks = -(-n_series // size)
    counts = frame.group_by(pl.col(SERIES) // size).len().sort(SERIES)
    rows = dict(zip(counts[SERIES].to_list(), counts["len"].to_list(), strict=True))
    wanted = sorted(set(range(n_chunks) if chunks is None else chunks))
    shutil.rmtree(root, ignore_errors=True)
    (root / "chunks").mkdir(parents=True)
    made_by = backend
    if wanted and backend == "spark":
        kind = frame.schema[columns.timestamp]  # the file's, when Spark reads the file
        nanos = isinstance(kind, pl.Datetime) and kind.time_unit == "ns"
        readable, zone = _for_spark(frame, columns.timestamp)
        spark_input, made_by = _spark_input(readable, columns, root, source, nanos=nanos)
        spark_features(
            spark_input, spec, columns, master=spark_master,
            out=root / "chunks", size=size, chunks=wanted, time_zone=zone,
        )  # fmt: skip
        _check_rows(root / "chunks", wanted, rows, made_by)
    elif wanted:  # none when a resumed run has every chunk done
        _polars_files(
            frame, spec, columns, root / "chunks", size, _batches(wanted, rows, batch_rows)
        )
    return FeatureChunks(
        root=root,
        size=size,
        series=n_series,
        rows=tuple(rows.get(i, 0) for i in range(n_chunks)),
        schema=feature_schema(frame.schema, spec),
        timestamp=columns.timestamp,
        made_by=made_by,
    )


def _spark_input(
    readable: pl.DataFrame, columns: Columns, root: Path, source: str | None, *, nanos: bool
) -> tuple[Path | SourceFile, str]:
    """What Spark reads the checked table from, and a phrase saying so: the user's file with the
    driver's two small tables beside it where `spark.source_file_problem` finds none, or else the
    driver's checked copy."""

    problem = source_file_problem(source, columns) if source else None
    if source is None or problem is not None:
        readable.write_parquet(root / "input.parquet")
        why = f": data.source is {problem}" if source else ""
        return root / "input.parquet", f"spark, from the driver's copy{why}"
    ids, ts = list(columns.ids), columns.timestamp
    observed = readable.filter(~pl.col(FUTURE))
    keys = observed.group_by(SERIES, maintain_order=True).agg(
        pl.col(ids).first(), pl.col(ts).first().alias(FIRST), pl.col(ts).last().alias(LAST)
    )
    keys.write_parquet(root / "keys.parquet")
    readable.filter(pl.col(FUTURE)).write_parquet(root / "future.parquet")
    path = str(Path(source).resolve())
    return SourceFile(path, root / "keys.parquet", root / "future.parquet", nanos), (
        f"spark, read {source} itself"
    )


def _check_rows(out: Path, wanted: list[int], rows: dict[int, int], made_by: str) -> None:
    """Spark wrote as many rows for each chunk as the checked table has (the user's file read
    again by the executors could have changed since the driver read it)."""
    for index in wanted:
        files = sorted((out / f"{CHUNK_KEY}={index}").glob("*.parquet"))
        got = pl.scan_parquet(files).select(pl.len()).collect().item() if files else 0
        if got != rows.get(index, 0):
            raise ConfigError(
                f"features ({made_by}): chunk {index} has {got} rows where the checked table "
                f"has {rows.get(index, 0)}; did data.source change during the run? Run again, "
                "or set features.backend = 'polars'"
            )


def _for_spark(frame: pl.DataFrame, ts: str) -> tuple[pl.DataFrame, str | None]:
    """`frame` as Spark's Parquet reader takes it, and its timestamps' zone (where Spark takes
    the calendar parts). Spark refuses nanosecond timestamps (pandas' unit), so they are written
    in microseconds (`FeatureChunks.read` casts them back)."""
    kind = frame.schema[ts]
    if not isinstance(kind, pl.Datetime):
        return frame, None
    if kind.time_unit == "ns":
        frame = frame.with_columns(pl.col(ts).cast(pl.Datetime("us", kind.time_zone)))
    return frame, kind.time_zone


def feature_schema(input_schema: pl.Schema, spec: FeatureSpec) -> pl.Schema:
    """The feature table's columns and types: the input's, then the features (calendar codes
    Int32, every other feature Float64)."""
    calendar = {name for name, _ in spec.calendar_columns}
    features = {c: pl.Int32() if c in calendar else pl.Float64() for c in spec.columns()}
    return pl.Schema({**dict(input_schema), **features})


def _polars_files(
    frame: pl.DataFrame,
    spec: FeatureSpec,
    columns: Columns,
    out: Path,
    size: int,
    batches: list[list[int]],
) -> None:
    groups = group_features(frame, spec, columns)  # small: one row per group and timestamp
    for batch in batches:
        start = frame[SERIES].search_sorted(batch[0] * size, side="left")
        stop = frame[SERIES].search_sorted((batch[-1] + 1) * size, side="left")
        part = with_groups(series_features(frame.slice(start, stop - start), spec, columns), groups)
        keyed = part.with_columns((pl.col(SERIES) // size).alias(CHUNK_KEY))
        for (index,), rows_of in keyed.partition_by(CHUNK_KEY, as_dict=True).items():
            directory = out / f"{CHUNK_KEY}={index}"
            directory.mkdir()
            rows_of.drop(CHUNK_KEY).write_parquet(directory / "part-0.parquet")


def _batches(wanted: list[int], rows: dict[int, int], limit: int) -> list[list[int]]:
    """Runs of consecutive wanted chunks of at most `limit` rows (one chunk may be more)."""
    batches: list[list[int]] = []
    for _, run in itertools.groupby(enumerate(wanted), key=lambda p: p[1] - p[0]):
        current: list[int] = []
        total = 0
        for _, index in run:
            if current and total + rows.get(index, 0) > limit:
                batches.append(current)
                current, total = [], 0
            current.append(index)
            total += rows.get(index, 0)
        if current:
            batches.append(current)
    return batches
