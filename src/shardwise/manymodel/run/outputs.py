"""The run's output tables, assembled from the finished chunks' files (`<run_dir>/chunks/`):
the metrics, choices and failures, returned for the summary; the forecast tables (every model's,
the chosen strategy's, every window's) written a few chunks at a time, so the driver's memory
does not grow with them; and the chosen forecasts read back for what needs them (reconciliation,
plots)."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from shardwise.common.errors import ConfigError
from shardwise.manymodel.columns import FUTURE, SERIES
from shardwise.manymodel.config import ManyModelsConfig
from shardwise.manymodel.data.long_table import SeriesTable
from shardwise.manymodel.evaluation.intervals import Calibration, bound_names, calibrate
from shardwise.manymodel.evaluation.selection import Selection, forecasts, select

TABLES = ("metrics", "choices", "forecasts", "failures", "backtest")
"""The tables every chunk writes (`chunk_store.write_chunk`)."""
_PART_SERIES = 2000
"""Series whose forecast tables are assembled and written together (whole chunks, at least
one): few enough to bound the driver's memory, enough that the parts' overhead stays small."""


def assemble(
    config: ManyModelsConfig, table: SeriesTable, n_chunks: int, chunk_size: int
) -> tuple[dict[str, pl.DataFrame], Selection, Calibration | None]:
    """Combine the chunks (`chunk_size` series each, in series order) into the run's output
    tables, with the series' id columns; the forecasts are those of the strategy `select` picks
    (every model's are kept too), with intervals calibrated across series (intervals.py). The
    metrics, choices and failures are returned; the forecast tables, the largest, are written a
    few chunks at a time (`_write_forecasts`)."""
    run_dir = config.run_dir
    ids = table.series_ids()
    paths = {name: chunk_files(run_dir, name, n_chunks) for name in TABLES}
    outputs = {
        name: ids.join(pl.read_parquet(paths[name]), on=SERIES, how="inner")
        for name in ("metrics", "choices", "failures")
    }
    selection = select(
        outputs["metrics"],
        n_windows=config.backtest.n_windows,
        metric=config.backtest.metric,
        requested=config.backtest.selection,
    )
    calibration = None
    if config.backtest.levels:
        chosen = outputs["choices"].lazy().select(SERIES, "model")
        calibration = calibrate(
            _parts(paths["backtest"], chunk_size),
            sorted(set(config.backtest.levels)),
            config.backtest.n_windows,
            config.backtest.intervals,
            sources=lambda rows: forecasts(rows, chosen, selection),
            spacing=config.backtest_step,
        )
    _write_forecasts(
        run_dir, table, (ids, outputs["choices"]), (selection, calibration), paths, chunk_size
    )
    files = {"metrics": "backtest_metrics", "choices": "best_models", "failures": "failures"}
    for name, filename in files.items():
        outputs[name].drop(SERIES).write_parquet(run_dir / f"{filename}.parquet")
    table.skipped.write_parquet(run_dir / "skipped.parquet")
    return outputs, selection, calibration


def _parts(files: list[Path], chunk_size: int) -> list[pl.LazyFrame]:
    """The chunks' `files` read a few at a time (`_PART_SERIES` series)."""
    per_part = max(1, _PART_SERIES // chunk_size)
    return [pl.scan_parquet(files[i : i + per_part]) for i in range(0, len(files), per_part)]


def _write_forecasts(
    run_dir: Path,
    table: SeriesTable,
    series: tuple[pl.DataFrame, pl.DataFrame],
    chosen_by: tuple[Selection, Calibration | None],
    paths: dict[str, list[Path]],
    chunk_size: int,
) -> None:
    """`forecasts_by_model.parquet` (every model's), `forecasts.parquet` (the chosen strategy's)
    and `backtest_forecasts.parquet` (every window's), in series order, written a few chunks at
    a time (`_PART_SERIES`): the driver holds those chunks' results and their rows of the table
    (a slice: the table is in series order), never every chunk's."""
    ids, choices = series
    n_chunks = len(paths["forecasts"])
    per_part = max(1, _PART_SERIES // chunk_size)  # chunks
    size = per_part * chunk_size  # series
    starts = pl.Series([i * size for i in range(-(-n_chunks // per_part) + 1)])
    edges = table.frame.get_column(SERIES).search_sorted(starts, side="left").to_list()
    chosen = choices.select(SERIES, "model")
    chosen_of = chosen.with_columns((pl.col(SERIES) // size).alias("_part")).partition_by(
        "_part", as_dict=True, include_key=False
    )
    calibration = chosen_by[1]
    metadata = calibration.metadata() if calibration is not None else {}
    names = ("forecasts_by_model", "forecasts", "backtest_forecasts")
    with _Appended({name: run_dir / f"{name}.parquet" for name in names}, metadata) as out:
        for i, (start, stop) in enumerate(itertools.pairwise(edges)):
            chunks = range(i * per_part, min((i + 1) * per_part, n_chunks))
            tables = _part_forecasts(
                table,
                table.frame.slice(start, stop - start).lazy(),
                ids.slice(i * size, size).lazy(),
                chosen_of.get((i,), chosen.clear()).lazy(),
                ([paths["forecasts"][c] for c in chunks], [paths["backtest"][c] for c in chunks]),
                chosen_by,
            )
            for name, frame in zip(names, tables, strict=True):
                out.write(name, frame)


def _part_forecasts(
    table: SeriesTable,
    rows: pl.LazyFrame,
    ids: pl.LazyFrame,
    choices: pl.LazyFrame,
    files: tuple[list[Path], list[Path]],
    chosen_by: tuple[Selection, Calibration | None],
) -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame]:
    """A few chunks' forecast tables (`_write_forecasts`) from their `forecasts` and `backtest`
    files, their `rows` of the table, their series' `ids` and `choices`: every model's forecasts
    with each step's timestamp, the chosen strategy's, and every window's with each step's
    timestamp and actual value; `chosen_by`: the strategy, and the intervals (each window's
    from the windows before it)."""
    ts, y = table.columns.timestamp, table.columns.target
    selection, calibration = chosen_by
    bounds = (
        [name for level in calibration.levels for name in bound_names(level)]
        if calibration is not None
        else []
    )

    backtest = pl.scan_parquet(files[1])
    # the part's own widths, made once for both tables
    series = calibration.series_widths(backtest) if calibration is not None else None

    def bounded(frame: pl.LazyFrame) -> pl.LazyFrame:
        return calibration.bounds(frame, series) if calibration is not None else frame

    def finals(frame: pl.LazyFrame) -> pl.LazyFrame:
        return calibration.forecast_bounds(frame, series) if calibration is not None else frame

    future = rows.filter(pl.col(FUTURE)).select(
        SERIES, ts, (pl.int_range(pl.len()).over(SERIES) + 1).alias("step")
    )
    by_model = (
        finals(ids.join(pl.scan_parquet(files[0]), on=SERIES, how="inner"))
        .join(future, on=[SERIES, "step"], how="left")
        .select(SERIES, *table.columns.ids, ts, "step", "model", "forecast", *bounds)
        .sort(SERIES, "model", "step")
        .collect()
    )
    chosen = forecasts(by_model.lazy(), choices, selection).collect()
    observed = rows.filter(~pl.col(FUTURE)).select(
        SERIES, ts, y, pl.int_range(pl.len()).over(SERIES).alias("_row")
    )
    windows = (
        bounded(backtest)
        .with_columns((pl.col("origin") + pl.col("step") - 1).alias("_row"))  # the row forecast
        .join(observed, on=[SERIES, "_row"], how="left")
        .join(ids, on=SERIES)
        .sort(SERIES, "model", "window", "step")
        .select(*table.columns.ids, ts, "model", "window", "step", "forecast", y, *bounds)
        .collect()
    )
    return by_model.drop(SERIES), chosen.drop(SERIES), windows


class _Appended:
    """Parquet files written a part at a time (a row group per part), each under a temporary
    name until every part is in, then renamed into place: an output file is complete or absent
    (the one an earlier run left stays until then)."""

    def __init__(self, paths: dict[str, Path], metadata: dict[str, str] | None = None) -> None:
        self._paths = paths
        self._metadata = metadata or {}
        self._partial = {
            name: path.with_name(f"{path.name}.partial") for name, path in paths.items()
        }
        self._writers: dict[str, pq.ParquetWriter] = {}

    def __enter__(self) -> _Appended:
        return self

    def write(self, name: str, frame: pl.DataFrame) -> None:
        part = with_metadata(frame, self._metadata)
        if name not in self._writers:
            self._writers[name] = pq.ParquetWriter(
                self._partial[name], part.schema, compression="zstd"
            )
        self._writers[name].write_table(part)

    def __exit__(self, kind: object, error: object, trace: object) -> None:
        for writer in self._writers.values():
            writer.close()
        for name, partial in self._partial.items():
            if kind is None:
                os.replace(partial, self._paths[name])
            else:
                partial.unlink(missing_ok=True)


def with_metadata(frame: pl.DataFrame, metadata: dict[str, str]) -> pa.Table:
    """`frame` as Arrow, with `metadata` added to its schema's (what Parquet files keep)."""
    table = frame.to_arrow()
    if not metadata:
        return table
    return table.replace_schema_metadata({**(table.schema.metadata or {}), **metadata})


def chunk_files(run_dir: Path, name: str, n_chunks: int) -> list[Path]:
    """Every chunk's `name` table, each checked readable (its footer), or one line saying how
    to redo the chunk."""
    paths = [run_dir / "chunks" / f"chunk-{i:06d}" / f"{name}.parquet" for i in range(n_chunks)]
    for path in paths:
        try:
            pl.read_parquet_schema(path)
        except (OSError, pl.exceptions.PolarsError) as e:
            raise ConfigError(
                f"{path} cannot be read ({str(e).splitlines()[0][:200]}); remove "
                f"{path.parent} and run again with --resume to redo that chunk"
            ) from None
    return paths


def chosen_forecasts(run_dir: Path, table: SeriesTable) -> pl.DataFrame:
    """`forecasts.parquet` (the chosen strategy's) read back, with each series' number."""
    ids = table.series_ids()
    chosen = pl.read_parquet(run_dir / "forecasts.parquet")
    return ids.join(chosen, on=list(table.columns.ids), nulls_equal=True).sort(SERIES, "step")
