"""A hierarchical run's reconciliation (`[hierarchy]`): the chosen forecasts of every level are
reconciled by each of `hierarchy.methods` (levels.py) into `forecasts_reconciled.parquet`, the
error-weighted methods with the backtest forecasts of the model (or ensemble) each series'
forecast comes from.

Each method is also scored on the backtest, so that a forecaster can see whether reconciling
helps and which method to use: those models' forecasts of each window are reconciled with
the history before the window (and, for the error-weighted methods, the earlier windows' errors:
they are scored from the second window on, and then so are the others) and scored against the
window's actual values, per series: `reconciled_metrics.parquet`, and the mean MASE per level in
the run's output. Every method reconciles the same forecasts, so they compare fairly with each
other and with the unreconciled `base`; the per-series choices in those forecasts were made on
all windows, as the final forecasts' are.
"""

from __future__ import annotations

from collections.abc import Sequence

import polars as pl
import pyarrow.parquet as pq
from rich.console import Console
from rich.table import Table

from shardwise.manymodel.columns import FUTURE, SERIES, Columns
from shardwise.manymodel.config import ManyModelsConfig
from shardwise.manymodel.data.long_table import SeriesTable
from shardwise.manymodel.evaluation.backtest import failure_message
from shardwise.manymodel.evaluation.intervals import Calibration, calibrate, describe
from shardwise.manymodel.hierarchy.levels import FROM_ERRORS, incoherence, reconcile, unique_ids
from shardwise.manymodel.run.outputs import with_metadata


def reconcile_run(
    config: ManyModelsConfig, table: SeriesTable, chosen: pl.DataFrame, console: Console
) -> None:
    """Reconcile the run's `chosen` forecasts (outputs.chosen_forecasts), with the same models'
    backtest forecasts where a method needs them, and score every method on the backtest."""
    rows = chosen_backtest(config, table, chosen)
    weighted = bool(FROM_ERRORS & set(config.hierarchy.methods))
    past = latest(rows, table.columns.timestamp) if weighted else None
    paths = series_paths(config, table)
    windows = _score(config, table, paths, rows, console)
    calibration = None
    if config.backtest.levels and windows is not None:
        method = config.backtest.intervals
        calibration = calibrate(
            [windows.lazy()],
            sorted(set(config.backtest.levels)),
            config.backtest.n_windows,
            "pooled" if method == "model" else method,  # a reconciliation has none of its own
            sources=lambda frame: frame,
            spacing=config.backtest_step,
        )
        console.print("reconciled " + describe(calibration.levels))
    calibrated = (calibration, windows) if calibration is not None and windows is not None else None
    _reconcile(config, table, paths, (chosen, past), calibrated, console)


def series_paths(config: ManyModelsConfig, table: SeriesTable) -> pl.DataFrame:
    """Every series' number, ids and path in the hierarchy (`hierarchy.unique_ids`): made once
    per run, for each of its reconciliations."""
    return unique_ids(table.series_ids(), list(table.columns.ids), config.hierarchy.levels)


def chosen_backtest(
    config: ManyModelsConfig, table: SeriesTable, chosen: pl.DataFrame
) -> pl.DataFrame:
    """The backtest windows' forecasts of the model (or ensemble) each series' `chosen`
    forecasts come from: each series' number, window, timestamp, forecast and actual value."""
    ids = table.series_ids()
    rows = pl.scan_parquet(config.run_dir / "backtest_forecasts.parquet")
    numbered = ids.lazy().join(rows, on=list(table.columns.ids), nulls_equal=True)
    used = chosen.lazy().select(SERIES, "model").unique()
    ts, y = table.columns.timestamp, table.columns.target
    own = numbered.join(used, on=[SERIES, "model"], how="semi")
    return own.select(SERIES, "window", ts, "forecast", y).sort(SERIES, ts, "window").collect()


def latest(rows: pl.DataFrame, ts: str) -> pl.DataFrame:
    """One backtest forecast per series and timestamp `ts` (`rows` sorted by series, time and
    window): the latest window's, for MinTrace's errors. Windows overlap when `backtest.step` is
    shorter than the horizon."""
    return rows.unique([SERIES, ts], keep="last", maintain_order=True)


def reconcile_each(
    forecast: pl.DataFrame,
    history: pl.DataFrame,
    columns: Columns,
    levels: list[list[str]],
    methods: Sequence[str],
    past: pl.DataFrame | None,
    paths: pl.DataFrame,
) -> tuple[pl.DataFrame | None, dict[str, str]]:
    """`hierarchy.reconcile` with every method, or, when that fails, with each method alone:
    the methods that ran (None if none did), and why each other one failed."""
    try:
        return reconcile(forecast, history, columns, levels, methods, past, paths=paths), {}
    except Exception:  # which method: each alone
        parts, failed = [], {}
        for method in methods:
            try:
                parts.append(
                    reconcile(forecast, history, columns, levels, [method], past, paths=paths)
                )
            except Exception as e:
                failed[method] = failure_message(e)
    if not parts:
        return None, failed
    return parts[0].with_columns(part[m] for part in parts[1:] for m in part.columns[-1:]), failed


def _reconcile(
    config: ManyModelsConfig,
    table: SeriesTable,
    paths: pl.DataFrame,
    forecasts: tuple[pl.DataFrame, pl.DataFrame | None],
    calibrated: tuple[Calibration, pl.DataFrame] | None,
    console: Console,
) -> None:
    """Reconcile the chosen forecasts (`chosen_forecasts`) of every level (levels.py), the
    error-weighted methods with the same models' backtest forecasts `past`:
    `forecasts_reconciled.parquet`, with each method's intervals (`<method>_lo_80`, …) from
    its reconciled backtest forecasts' errors (`calibrated`: their calibration and rows). A
    method hierarchicalforecast cannot apply to these series is reported and left out; the
    others are still written."""
    forecast, past = forecasts
    missing = table.num_series - forecast[SERIES].n_unique()
    if missing:
        console.print(
            f"forecasts not reconciled: {missing} series of the hierarchy have none (see "
            "failures.parquet)"
        )
        return
    levels, methods = config.hierarchy.levels, list(config.hierarchy.methods)
    history = table.frame.filter(~pl.col(FUTURE))
    reconciled, failed = reconcile_each(
        forecast, history, table.columns, levels, methods, past, paths
    )
    for method, why in failed.items():
        console.print(f"hierarchy.methods: {method} failed: {why}")
    if reconciled is None:
        return
    methods = [m for m in methods if m not in failed]
    metadata = {}
    if calibrated is not None:
        scale = _seasonal_naive_mae(history, table.columns, table.season_length)
        reconciled = _with_intervals(reconciled, scale, calibrated, table.columns)
        metadata = calibrated[0].metadata()
    written = with_metadata(reconciled.drop(SERIES), metadata)
    pq.write_table(written, config.run_dir / "forecasts_reconciled.parquet")
    gaps = {m: incoherence(reconciled, m, table.columns, levels) for m in methods}
    shown = ", ".join(f"{m} {gap:.0e}" for m, gap in gaps.items())
    console.print(
        f"reconciled forecasts ({len(levels) + 2} levels; largest gap to the sum of the "
        f"series below: {shown}): {config.run_dir / 'forecasts_reconciled.parquet'}"
    )


def _with_intervals(
    reconciled: pl.DataFrame,
    scale: pl.DataFrame,
    calibrated: tuple[Calibration, pl.DataFrame],
    columns: Columns,
) -> pl.DataFrame:
    """`reconciled` (a column per method) with each method's interval columns
    (`bottom_up_lo_80`, …), from the errors of its reconciliations of the backtest windows."""
    methods = reconciled.columns[reconciled.columns.index("base") :]
    long = _long(reconciled, scale, columns)
    calibration, windows = calibrated
    series = calibration.series_widths(windows.lazy())
    bounded = calibration.forecast_bounds(long.lazy(), series).collect()
    names = [c for c in bounded.columns if c.startswith(("lo_", "hi_"))]
    wide = bounded.pivot(
        "model", index=[SERIES, columns.timestamp], values=names, separator="|"
    ).rename(lambda c: "_".join(reversed(c.split("|"))) if "|" in c else c)
    shown = [f"{m}_{n}" for m in methods for n in names if f"{m}_{n}" in wide.columns]
    return reconciled.join(
        wide.select(SERIES, columns.timestamp, *shown),
        on=[SERIES, columns.timestamp],
        how="left",
    )


def _long(reconciled: pl.DataFrame, scale: pl.DataFrame, columns: Columns) -> pl.DataFrame:
    """A row per series, method (as `model`) and timestamp, with the series' ids, its step (the
    timestamp's rank in the series) and the series' `scale`, as the backtest's rows are
    (intervals.py)."""
    methods = reconciled.columns[reconciled.columns.index("base") :]
    ts = columns.timestamp
    return (
        reconciled.unpivot(
            methods, index=[SERIES, *columns.ids, ts], variable_name="model", value_name="forecast"
        )
        .join(scale.rename({"_scale": "scale"}), on=SERIES, how="left")
        .with_columns(pl.col(ts).rank("dense").over(SERIES, "model").cast(pl.Int64).alias("step"))
    )


def _score(
    config: ManyModelsConfig,
    table: SeriesTable,
    paths: pl.DataFrame,
    rows: pl.DataFrame,
    console: Console,
) -> pl.DataFrame | None:
    """Score the base forecasts and each method's reconciliation of them on the backtest
    windows (module docstring): `reconciled_metrics.parquet` and a table of mean MASE per level
    and method. Returns those reconciled forecasts as the backtest's rows (intervals.py), for
    the intervals; None if no window was reconciled."""
    columns, levels = table.columns, config.hierarchy.levels
    ids, ts, y = list(columns.ids), columns.timestamp, columns.target
    methods = list(config.hierarchy.methods)
    first = 1 if FROM_ERRORS & set(methods) else 0
    observed = table.frame.filter(~pl.col(FUTURE))
    scored, failed, windows = [], {}, []
    for window in range(first, config.backtest.n_windows):
        these = rows.filter(pl.col("window") == window)
        if these[SERIES].n_unique() < table.num_series:  # a series without a forecast there
            continue
        history = observed.filter(pl.col(ts) < these[ts].min())
        earlier = latest(rows.filter(pl.col("window") < window), ts) if first else None
        reconciled, failures = reconcile_each(
            these, history, columns, levels, methods, earlier, paths
        )
        failed.update(failures)
        if reconciled is not None:
            actual = these.select(SERIES, ts, pl.col(y).alias("actual"))
            scale = _seasonal_naive_mae(history, columns, table.season_length)
            long = _long(reconciled, scale, columns).join(actual, on=[SERIES, ts], how="left")
            scored.append(_errors(long, columns).with_columns(window=window))
            windows.append(
                long.select(SERIES, "model", pl.lit(window, pl.Int64).alias("window"), "step",
                            "forecast", "actual", "scale")
            )  # fmt: skip
    for method, why in failed.items():
        console.print(f"hierarchy.methods: {method} not scored on the backtest: {why}")
    if not scored:
        console.print(
            "reconciliation not scored on the backtest: "
            + (
                "mint_wls_var and mint_shrink need an earlier window's errors; use "
                "backtest.n_windows ≥ 2"
                if first and config.backtest.n_windows < 2
                else "no window has a forecast for every series of the hierarchy"
            )
        )
        return None
    metrics = pl.concat(scored, how="diagonal_relaxed")
    metrics = metrics.filter(~pl.col("method").is_in(list(failed)))  # only what every window has
    level = pl.lit("total")
    for named in [*levels, ids]:
        present = (pl.col(c).is_not_null() if c in named else pl.col(c).is_null() for c in ids)
        level = pl.when(pl.all_horizontal(present)).then(pl.lit("/".join(named))).otherwise(level)
    metrics = metrics.with_columns(level.alias("level"))
    metrics = metrics.select(*ids, "level", "window", "method", "mae", "mase")
    metrics.write_parquet(config.run_dir / "reconciled_metrics.parquet")
    order = ["total", *("/".join(level) for level in levels), "/".join(ids)]
    console.print(_table(metrics, ["base", *(m for m in methods if m not in failed)], order))
    kept = pl.concat(windows).filter(~pl.col("model").is_in(list(failed)))
    return kept.with_columns(pl.col("actual").cast(pl.Float64), pl.col("scale").cast(pl.Float64))


def _table(metrics: pl.DataFrame, methods: list[str], levels: list[str]) -> Table:
    """Mean MASE per method (rows) and level (columns)."""
    windows = ", ".join(map(str, sorted(metrics["window"].unique().to_list())))
    shown = Table(title=f"reconciled: backtest MASE, windows {windows}")
    shown.add_column("method")
    for name in levels:
        shown.add_column(name, justify="right")
    means = mean_mase(metrics)
    for method in methods:
        values = dict(means.filter(pl.col("method") == method).select("level", "mase").iter_rows())
        shown.add_row(method, *(f"{values.get(name, float('nan')):.3f}" for name in levels))
    return shown


def _seasonal_naive_mae(history: pl.DataFrame, columns: Columns, season: int) -> pl.DataFrame:
    """Each series' MASE scale, as the backtest computes it (`backtest.seasonal_mae`, one series
    at a time), for every series at once: the mean absolute difference between values `season`
    apart (1 apart in a series no longer than a season), missing ones skipped."""
    y = pl.col(columns.target).cast(pl.Float64).fill_nan(None)

    def mean_difference(lag: int) -> pl.Expr:
        return (y - y.shift(lag)).abs().mean().fill_null(float("nan"))

    lag = max(season, 1)
    return history.group_by(SERIES).agg(
        pl.when(pl.len() > season)
        .then(mean_difference(lag))
        .otherwise(mean_difference(1))
        .alias("_scale")
    )


def _errors(long: pl.DataFrame, columns: Columns) -> pl.DataFrame:
    """Per series and method (`base` included), MAE and MASE of the reconciled forecasts in
    `long` (`_long`'s rows, with their `actual` values)."""
    mae = (pl.col("forecast") - pl.col("actual")).abs().mean()
    naive = pl.col("scale").first()
    mase = pl.when(naive > 0).then(mae / naive)  # a constant history has no MASE (NaN there)
    return long.group_by(SERIES, *columns.ids, pl.col("model").alias("method")).agg(
        mae.alias("mae"), mase.alias("mase")
    )


def mean_mase(metrics: pl.DataFrame) -> pl.DataFrame:
    """`reconciled_metrics.parquet`'s mean MASE per level and method: over each series' windows,
    then over the level's series."""
    ids = [c for c in metrics.columns if c not in ("level", "window", "method", "mae", "mase")]
    return (
        metrics.group_by("level", "method", *ids)
        .agg(pl.col("mase").drop_nans().mean())
        .group_by("level", "method")
        .agg(pl.col("mase").drop_nans().mean())
        .sort("level", "method")
    )
