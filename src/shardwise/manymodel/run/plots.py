"""The plots a forecaster looks at (`shardwise many-models … --plot`, `tracking.plots = true`):
each model's distribution of per-series MASE, and for a random sample of series and for the worst
ones (the highest MASE of the model each series chose) the recent history, the forecast and its
intervals. PNG files under `<run_dir>/plots/`, logged to MLflow with the run.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import polars as pl

from shardwise.manymodel.columns import FUTURE, SERIES
from shardwise.manymodel.data.long_table import SeriesTable
from shardwise.manymodel.run.chunk_result import ENSEMBLE, SELECTED


def write_plots(
    run_dir: Path,
    table: SeriesTable,
    outputs: dict[str, pl.DataFrame],
    *,
    sample: int = 6,
    worst: int = 6,
    seed: int = 0,
) -> list[Path]:
    """Draw the plots; their paths."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    folder = run_dir / "plots"
    (folder / "series").mkdir(parents=True, exist_ok=True)
    metrics, choices = outputs["metrics"], outputs["choices"]
    per_series = (
        metrics.filter(~pl.col("model").is_in([SELECTED, ENSEMBLE]))
        .group_by(SERIES, "model")
        .agg(pl.col("mase").drop_nans().mean())
    )
    paths = [_mase_by_model(plt, per_series, folder / "mase_by_model.png")]
    chosen = per_series.join(choices.select(SERIES, "model"), on=[SERIES, "model"])
    ranked = chosen.filter(pl.col("mase").is_finite()).sort("mase", descending=True)
    worst_ids = ranked[SERIES].head(worst).to_list()
    ids = choices[SERIES].sort().to_list()
    rng = np.random.default_rng(seed)
    sample_ids = sorted(rng.choice(ids, size=min(sample, len(ids)), replace=False).tolist())
    mase = dict(zip(chosen[SERIES], chosen["mase"], strict=True))
    for series in dict.fromkeys([*sample_ids, *worst_ids]):
        kind = "worst" if series in worst_ids else "sample"
        path = folder / "series" / f"{kind}-{_file_name(table, series)}.png"
        paths.append(_series(plt, table, outputs["forecasts"], series, mase.get(series), path))
    return paths


def _mase_by_model(plt: object, per_series: pl.DataFrame, path: Path) -> Path:
    models = sorted(per_series["model"].unique().to_list())
    values = [
        per_series.filter((pl.col("model") == m) & pl.col("mase").is_finite())["mase"].to_numpy()
        for m in models
    ]
    figure, axes = plt.subplots(figsize=(max(5.0, 1.2 * len(models)), 4))  # type: ignore[attr-defined]
    axes.boxplot(values, tick_labels=models, showfliers=True)
    axes.axhline(1.0, color="grey", linestyle=":", linewidth=1)
    axes.set_ylabel("MASE per series (below 1: beats the\nin-sample seasonal naive)")
    axes.set_title("MASE per series, by model")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)  # type: ignore[attr-defined]
    return path


def _series(
    plt: object,
    table: SeriesTable,
    forecasts: pl.DataFrame,
    series: int,
    mase: float | None,
    path: Path,
) -> Path:
    ts, target = table.columns.timestamp, table.columns.target
    rows = table.frame.filter((pl.col(SERIES) == series) & ~pl.col(FUTURE)).sort(ts)
    ahead = forecasts.filter(pl.col(SERIES) == series).sort("step")
    keep = max(4 * table.season_length, 3 * ahead.height, 24)
    history = rows.tail(keep)
    figure, axes = plt.subplots(figsize=(8, 3.5))  # type: ignore[attr-defined]
    axes.plot(history[ts].to_list(), history[target].to_list(), color="black", label="history")
    model = ahead["model"][0] if ahead.height else "–"
    axes.plot(ahead[ts].to_list(), ahead["forecast"].to_list(), color="tab:blue", label=model)
    levels = sorted(
        (int(c.removeprefix("lo_")) for c in ahead.columns if c.startswith("lo_")), reverse=True
    )
    for shade, level in zip((0.15, 0.3), levels, strict=False):
        lower, upper = ahead[f"lo_{level}"], ahead[f"hi_{level}"]
        if lower.is_not_null().any():
            axes.fill_between(
                ahead[ts].to_list(), lower.to_list(), upper.to_list(), color="tab:blue",
                alpha=shade, label=f"{level}% interval",
            )  # fmt: skip
    score = f", MASE {mase:.2f}" if mase is not None and np.isfinite(mase) else ""
    axes.set_title(f"{_label(table, series)} ({model}{score})")
    axes.legend(loc="upper left", fontsize="small")
    figure.autofmt_xdate()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)  # type: ignore[attr-defined]
    return path


def _label(table: SeriesTable, series: int) -> str:
    ids = table.frame.filter(pl.col(SERIES) == series).select(table.columns.ids).row(0)
    return " / ".join(str(v) for v in ids)


def _file_name(table: SeriesTable, series: int) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", _label(table, series))[:80] or str(series)
