"""A hierarchical run's reconciliation (`[hierarchy]`): the chosen forecasts of every level are
reconciled by each of `hierarchy.methods` (hierarchy.py) into `forecasts_reconciled.parquet`, the
error-weighted methods with the same strategy's backtest forecasts."""

from __future__ import annotations

import polars as pl
from rich.console import Console

from shardwise.manymodel.backtest import failure_message
from shardwise.manymodel.config import ManyModelsConfig
from shardwise.manymodel.data import FUTURE, SERIES, SeriesTable
from shardwise.manymodel.hierarchy import FROM_ERRORS, incoherence, reconcile
from shardwise.manymodel.selection import Selection, forecasts


def reconcile_run(
    config: ManyModelsConfig,
    table: SeriesTable,
    chosen: pl.DataFrame,
    choice: tuple[pl.DataFrame, Selection],
    console: Console,
) -> None:
    """Reconcile the run's `chosen` forecasts (runner.chosen_forecasts), with the backtest
    forecasts of the same `choice` (each series' choices, and the strategy) where a method
    needs them."""
    past = chosen_backtest(config, table, *choice)
    _reconcile(config, table, chosen, past, console)


def chosen_backtest(
    config: ManyModelsConfig, table: SeriesTable, choices: pl.DataFrame, selection: Selection
) -> pl.DataFrame | None:
    """The backtest windows' forecasts of the strategy `forecasts.parquet` holds, with each
    series' number; None when no hierarchy method needs them."""
    if not FROM_ERRORS & set(config.hierarchy.methods):
        return None
    ids = table.frame.select(SERIES, *table.columns.ids).unique(SERIES)
    rows = pl.scan_parquet(config.run_dir / "backtest_forecasts.parquet")
    numbered = ids.lazy().join(rows, on=list(table.columns.ids), nulls_equal=True)
    chosen = forecasts(numbered, choices.lazy(), selection)
    return chosen.select(SERIES, table.columns.timestamp, "forecast").collect()


def _reconcile(
    config: ManyModelsConfig,
    table: SeriesTable,
    forecast: pl.DataFrame,
    past: pl.DataFrame | None,
    console: Console,
) -> None:
    """Reconcile the chosen forecasts (`chosen_forecasts`) of every level (hierarchy.py), the
    error-weighted methods with the same strategy's backtest forecasts `past`:
    `forecasts_reconciled.parquet`. A method hierarchicalforecast cannot apply to these series
    is reported and left out; the others are still written."""
    missing = table.num_series - forecast[SERIES].n_unique()
    if missing:
        console.print(
            f"forecasts not reconciled: {missing} series of the hierarchy have none (see "
            "failures.parquet)"
        )
        return
    levels, methods = config.hierarchy.levels, list(config.hierarchy.methods)
    history = table.frame.filter(~pl.col(FUTURE))
    try:
        reconciled = reconcile(forecast, history, table.columns, levels, methods, past)
    except Exception:  # which method: each alone
        parts, failed = [], []
        for method in methods:
            try:
                parts.append(reconcile(forecast, history, table.columns, levels, [method], past))
            except Exception as e:
                failed.append(method)
                console.print(f"hierarchy.methods: {method} failed: {failure_message(e)}")
        if not parts:
            return
        reconciled = parts[0].with_columns(part[m] for part in parts[1:] for m in part.columns[-1:])
        methods = [m for m in methods if m not in failed]
    reconciled.drop(SERIES).write_parquet(config.run_dir / "forecasts_reconciled.parquet")
    gaps = {m: incoherence(reconciled, m, table.columns, levels) for m in methods}
    shown = ", ".join(f"{m} {gap:.0e}" for m, gap in gaps.items())
    console.print(
        f"reconciled forecasts ({len(levels) + 2} levels; largest gap to the sum of the "
        f"series below: {shown}): {config.run_dir / 'forecasts_reconciled.parquet'}"
    )
