"""The run's output tables, assembled from the finished chunks' files (`<run_dir>/chunks/`):
the metrics, choices and failures, returned for the summary; the forecast tables (every model's,
the chosen strategy's, every window's) streamed to their files; and the chosen forecasts read
back for what needs them (reconciliation, plots)."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from shardwise.config import ConfigError
from shardwise.manymodel.config import ManyModelsConfig
from shardwise.manymodel.data import FUTURE, SERIES, SeriesTable
from shardwise.manymodel.selection import Selection, forecasts, select

TABLES = ("metrics", "choices", "forecasts", "failures", "backtest")
"""The tables every chunk writes (`runner._write_chunk`)."""


def assemble(
    config: ManyModelsConfig, table: SeriesTable, n_chunks: int
) -> tuple[dict[str, pl.DataFrame], Selection]:
    """Combine the chunks into the run's output tables, with the series' id columns; the
    forecasts are those of the strategy `select` picks (every model's are kept too). The
    forecasts, the largest tables, are streamed from the chunk files to the output files
    without being held in memory; the metrics, choices and failures are returned."""
    run_dir = config.run_dir
    ids = table.frame.select(SERIES, *table.columns.ids).unique(SERIES).sort(SERIES)
    paths = {name: chunk_files(run_dir, name, n_chunks) for name in TABLES}
    outputs = {
        name: ids.join(pl.read_parquet(paths[name]), on=SERIES, how="inner")
        for name in ("metrics", "choices", "failures")
    }
    future = table.frame.filter(pl.col(FUTURE)).select(
        SERIES, table.columns.timestamp, (pl.int_range(pl.len()).over(SERIES) + 1).alias("step")
    )
    rows = pl.scan_parquet(paths["forecasts"])
    bounds = [c for c in rows.collect_schema().names() if c.startswith(("lo_", "hi_"))]
    keys = [SERIES, *table.columns.ids, table.columns.timestamp, "step", "model"]
    by_model = (
        ids.lazy()
        .join(rows, on=SERIES, how="inner")
        .join(future.lazy(), on=[SERIES, "step"], how="left")
        .select(*keys, "forecast", *bounds)
        .sort(SERIES, "model", "step")
    )
    selection = select(
        outputs["metrics"],
        n_windows=config.backtest.n_windows,
        metric=config.backtest.metric,
        requested=config.backtest.selection,
    )
    chosen = forecasts(by_model, outputs["choices"].lazy(), selection)
    by_model.drop(SERIES).sink_parquet(run_dir / "forecasts_by_model.parquet")
    chosen.drop(SERIES).sink_parquet(run_dir / "forecasts.parquet")
    _backtest_forecasts(table, ids, paths["backtest"]).drop(SERIES).sink_parquet(
        run_dir / "backtest_forecasts.parquet"
    )
    files = {"metrics": "backtest_metrics", "choices": "best_models", "failures": "failures"}
    for name, filename in files.items():
        outputs[name].drop(SERIES).write_parquet(run_dir / f"{filename}.parquet")
    table.skipped.write_parquet(run_dir / "skipped.parquet")
    return outputs, selection


def _backtest_forecasts(table: SeriesTable, ids: pl.DataFrame, paths: list[Path]) -> pl.LazyFrame:
    """Every window's forecasts (the chunks' `backtest` tables) with the series' ids, each
    step's timestamp and actual value, in series, model, window and step order."""
    ts, y = table.columns.timestamp, table.columns.target
    observed = table.frame.lazy().filter(~pl.col(FUTURE)).select(SERIES, ts, y)
    observed = observed.with_columns(pl.int_range(pl.len()).over(SERIES).alias("_row"))
    return (
        pl.scan_parquet(paths)
        .with_columns((pl.col("origin") + pl.col("step") - 1).alias("_row"))  # the row forecast
        .join(observed, on=[SERIES, "_row"], how="left")
        .join(ids.lazy(), on=SERIES)
        .select(SERIES, *table.columns.ids, ts, "model", "window", "step", "forecast", y)
        .sort(SERIES, "model", "window", "step")
    )


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
    ids = table.frame.select(SERIES, *table.columns.ids).unique(SERIES)
    chosen = pl.read_parquet(run_dir / "forecasts.parquet")
    return ids.join(chosen, on=list(table.columns.ids), nulls_equal=True).sort(SERIES, "step")
