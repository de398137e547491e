"""The many-models run's report: the summary (per model, held-out scores of each selection
strategy), the MLflow run, and the table printed at the end."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl
from rich.console import Console
from rich.table import Table

from shardwise.common.job_files import flatten
from shardwise.manymodel.columns import SERIES
from shardwise.manymodel.config import ManyModelsConfig
from shardwise.manymodel.data.long_table import SeriesTable
from shardwise.manymodel.evaluation.intervals import Calibration, Level, describe
from shardwise.manymodel.evaluation.selection import STRATEGIES, Selection
from shardwise.manymodel.run.chunk_result import ENSEMBLE, SELECTED


@dataclass
class Summary:
    run_dir: Path
    series: int
    completed: int
    failed: int
    skipped: int
    chunks_run: int
    chunks_reused: int
    overall: dict[str, float]
    per_model: pl.DataFrame
    peak_concurrency: int
    seconds: dict[str, float]
    mlflow_run_id: str | None
    selection: Selection
    """What the forecasts use, and the held-out scores it was picked by."""
    intervals: dict[int, Level] = field(default_factory=dict)
    """Each interval level's method and scores (intervals.py)."""
    model_uri: str | None = None
    """Where `tracking.registered_model` registered the forecasts (`models:/NAME/VERSION`)."""


def summarise(
    config: ManyModelsConfig,
    table: SeriesTable,
    outputs: dict[str, pl.DataFrame],
    selection: Selection,
    calibration: Calibration | None,
    *,
    chunks_run: int,
    chunks_reused: int,
    peak: int,
    seconds: dict[str, float],
) -> Summary:
    metrics, choices = outputs["metrics"], outputs["choices"]
    models = metrics.filter(~pl.col("model").is_in([SELECTED, ENSEMBLE]))
    per_series_model = models.group_by(SERIES, "model").agg(pl.col("mase", "smape").mean())
    chosen = per_series_model.join(choices.select(SERIES, "model"), on=[SERIES, "model"])
    wins = choices.group_by("model").len("wins")
    held = pl.DataFrame(
        [{"model": m, "held_out_mase": v["mase"]} for m, v in selection.held_out.items()],
        schema={"model": pl.String, "held_out_mase": pl.Float64},
    )
    per_model = (
        per_series_model.group_by("model")
        .agg(
            pl.len().alias("series"),
            pl.col("mase").drop_nans().mean().alias("mean_mase"),
            pl.col("smape").drop_nans().mean().alias("mean_smape"),
        )
        .join(wins, on="model", how="left")
        .with_columns(pl.col("wins").fill_null(0))
        .with_columns((pl.col("wins") / max(choices.height, 1)).alias("win_share"))
        .join(held, on="model", how="left")
        .sort("model")
    )
    overall = {
        "best_mean_mase": _mean(chosen["mase"]),
        "best_mean_smape": _mean(chosen["smape"]),
    }
    for strategy in STRATEGIES:
        if strategy in selection.held_out:
            for name, value in selection.held_out[strategy].items():
                overall[f"held_out/{strategy}_{name}"] = value
    levels = calibration.levels if calibration is not None else {}
    for level in levels.values():
        overall |= {f"intervals/{name}": value for name, value in level.scores.items()}
        overall[f"intervals/honoured_{level.level}"] = float(level.honoured)
    return Summary(
        run_dir=config.run_dir,
        series=table.num_series,
        completed=choices.height,
        failed=table.num_series - choices.height,
        skipped=table.skipped.height,
        chunks_run=chunks_run,
        chunks_reused=chunks_reused,
        overall=overall,
        per_model=per_model,
        peak_concurrency=peak,
        seconds=seconds,
        mlflow_run_id=None,
        selection=selection,
        intervals=levels,
    )


def _mean(column: pl.Series) -> float:
    values = column.drop_nans().drop_nulls()
    return float(values.mean()) if values.len() else float("nan")  # type: ignore[arg-type]


def start_tracking(config: ManyModelsConfig, run_dir: Path) -> Any:
    """Start the MLflow process early, so its start-up overlaps the work."""
    if not config.tracking.mlflow:
        return None
    from shardwise.common.mlflow import MlflowTracker

    return MlflowTracker(
        uri=config.tracking_uri,
        experiment=config.tracking.experiment or config.job.name,
        run_name=config.job.name,
        artifact_dir=run_dir / "mlartifacts",
    )


def _reconciled(config: ManyModelsConfig, run_dir: Path) -> dict[str, float]:
    """With a hierarchy, each method's mean backtest MASE per level (reconciliation.py)."""
    path = run_dir / "reconciled_metrics.parquet"
    if not (config.hierarchy.levels and path.exists()):
        return {}
    from shardwise.manymodel.hierarchy.reconciliation import mean_mase

    means = mean_mase(pl.read_parquet(path))
    return {f"reconciled/{level}/{method}_mase": mase for level, method, mase in means.iter_rows()}


def track(tracker: Any, config: ManyModelsConfig, summary: Summary, run_dir: Path) -> str | None:
    """One MLflow run: the config, aggregate metrics overall and per model, the tables."""
    if tracker is None:
        return None
    tracker.log_params(flatten(config))
    metrics = {
        **summary.overall,
        "series": float(summary.series),
        "series_failed": float(summary.failed),
        "series_skipped": float(summary.skipped),
    }
    for row in summary.per_model.iter_rows(named=True):
        for key in ("mean_mase", "mean_smape", "win_share", "held_out_mase"):
            value = row[key]
            if value is not None and math.isfinite(value):
                metrics[f"{row['model']}/{key}"] = float(value)
    metrics.update(_reconciled(config, run_dir))
    tracker.log_metrics({k: v for k, v in metrics.items() if math.isfinite(v)}, step=0)
    names = (
        "backtest_metrics", "backtest_forecasts", "best_models", "forecasts", "forecasts_by_model",
        "failures",
    )  # fmt: skip
    for name in (*names, "skipped"):
        tracker.log_artifact(run_dir / f"{name}.parquet")
    for name in ("forecasts_reconciled", "reconciled_metrics"):  # with a hierarchy
        if config.hierarchy.levels and (run_dir / f"{name}.parquet").exists():
            tracker.log_artifact(run_dir / f"{name}.parquet")
    tracker.log_artifact(run_dir / "job.toml")
    if config.tracking.plots:
        tracker.log_artifact(run_dir / "plots")
    tracker.close("FINISHED")
    run_id: str | None = tracker.run_id
    return run_id


def print_summary(console: Console, summary: Summary) -> None:
    held = summary.selection.held_out
    table = Table(title=f"{summary.completed} of {summary.series} series forecast")
    columns = ["model", "series", "won", "mean MASE", "mean sMAPE"]
    if held:
        columns.append("held-out MASE")
    for column in columns:
        table.add_column(column, justify="left" if column == "model" else "right")
    for row in summary.per_model.iter_rows(named=True):
        cells = [row["model"], str(row["series"]), f"{row['win_share']:.0%}"]
        cells += [_fmt(row["mean_mase"]), _fmt(row["mean_smape"])]
        table.add_row(*cells, *([_fmt(row["held_out_mase"])] if held else []))
    table.add_row(
        "best per series (in-sample)",
        str(summary.completed),
        "",
        _fmt(summary.overall["best_mean_mase"]),
        _fmt(summary.overall["best_mean_smape"]),
        *([""] if held else []),
    )
    names = {  # each chosen on the windows before the one it is scored on
        "per_series": "nested: per series",
        "ensemble": "nested: ensemble",
        "best_model": f"nested: one model ({summary.selection.fallback or '–'})",
    }
    for strategy in STRATEGIES:
        if strategy in held:
            table.add_row(names[strategy], "", "", "", "", _fmt(held[strategy]["mase"]))
    console.print(table)
    used = summary.selection.strategy
    why = f" (best on the held-out windows: MASE {held[used]['mase']:.3f})" if used in held else ""
    if used == "best_model":
        used = f"best_model ({summary.selection.best_model})"
    console.print(f"forecasts use: {used}{why}; every model's are in forecasts_by_model.parquet")
    if summary.intervals:
        console.print(describe(summary.intervals))
    console.print(
        f"failed {summary.failed}, skipped {summary.skipped}; chunks run {summary.chunks_run}, "
        f"reused {summary.chunks_reused}; at most {summary.peak_concurrency} tasks at once; "
        f"features {summary.seconds['features']:.1f} s, models {summary.seconds['models']:.1f} s, "
        f"outputs {summary.seconds['outputs']:.1f} s"
    )
    console.print(f"results: {summary.run_dir}")
    if summary.mlflow_run_id:
        console.print(f"mlflow run: {summary.mlflow_run_id}")


def _fmt(value: float | None) -> str:
    return "–" if value is None or not math.isfinite(value) else f"{value:.3f}"
