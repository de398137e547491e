"""What the forecasts use, decided on a window no choice was made on.

The backtest (backtest.py) scores, on each window after the first, each series' model chosen on
the windows before it (`selected`) and the mean of its k best there (`ensemble`). Here the same is
done for the one model best over all series on those earlier windows (`best_model`, the fallback
when choosing per series does not pay). The strategy with the best mean held-out score wins
(`backtest.selection = "auto"`), and the forecasts are assembled from it: the per-series choice,
the ensemble, or the best model (a series where it failed keeps its own choice).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import polars as pl

from shardwise.manymodel.columns import SERIES
from shardwise.manymodel.run.chunk_result import ENSEMBLE, METRICS, SELECTED

STRATEGIES = ("best_model", "per_series", "ensemble")
INTERVAL_SCORES = ("coverage_", "winkler_", "msis_")
"""Prefixes of the metrics tables' interval-score columns (intervals.py), one per level."""


@dataclass(frozen=True)
class Selection:
    strategy: str
    """per_series, ensemble or best_model: what forecasts.parquet holds."""
    best_model: str
    """The model best over all series on every window (what best_model forecasts with)."""
    fallback: str
    """The model best over all series on the windows before the last (each held-out window has
    its own, scored as `best_model`); "" with one window."""
    held_out: dict[str, dict[str, float]]
    """Per strategy and per model: each metric's mean over series (of its mean over the windows
    after the first), each window's choice made on the windows before it (empty with one
    window)."""


def select(metrics: pl.DataFrame, *, n_windows: int, metric: str, requested: str) -> Selection:
    """Score the strategies on the held-out windows and pick one (`requested`, unless `auto`)."""
    models = metrics.filter(~pl.col("model").is_in([SELECTED, ENSEMBLE]))
    held: dict[str, dict[str, float]] = {}
    fallback = ""
    if n_windows > 1:
        later = [models.filter(pl.col("window") == w) for w in range(1, n_windows)]
        fallbacks = [
            _best(models.filter(pl.col("window") < w), metric) for w in range(1, n_windows)
        ]
        best = pl.concat(
            frame.filter(pl.col("model") == model).with_columns(model=pl.lit("best_model"))
            for frame, model in zip(later, fallbacks, strict=True)
        )
        scored = pl.concat([metrics.filter(pl.col("window") > 0), best])
        names = [c for c in scored.columns if c in METRICS or c.startswith(INTERVAL_SCORES)]
        by_label = (
            scored.group_by(SERIES, "model")
            .agg(pl.col(name).drop_nans().mean() for name in names)
            .group_by("model")
            .agg(pl.col(name).drop_nans().mean() for name in names)
        )
        for row in by_label.iter_rows(named=True):
            held[row["model"]] = {name: _value(row[name]) for name in names}
        for label, strategy in ((SELECTED, "per_series"), (ENSEMBLE, "ensemble")):
            if label in held:  # none where no series had a choice to score
                held[strategy] = held.pop(label)
        fallback = fallbacks[-1]
    strategy = requested
    if requested == "auto":
        candidates = [s for s in STRATEGIES if s in held]
        strategy = min(candidates, key=lambda s: held[s][metric]) if candidates else "per_series"
    return Selection(strategy, _best(models, metric), fallback, held)


def forecasts(by_model: pl.LazyFrame, choices: pl.LazyFrame, selection: Selection) -> pl.LazyFrame:
    """The forecast rows of the chosen strategy: one model (or the ensemble) per series."""
    own = by_model.join(choices.select(SERIES, "model"), on=[SERIES, "model"], how="semi")
    if selection.strategy == "per_series":
        return own.sort(SERIES, "step")
    label = ENSEMBLE if selection.strategy == "ensemble" else selection.best_model
    chosen = by_model.filter(pl.col("model") == label)
    rest = own.join(chosen.select(SERIES).unique(), on=SERIES, how="anti")
    return pl.concat([chosen, rest]).sort(SERIES, "step")


def _best(metrics: pl.DataFrame, metric: str) -> str:
    """The model with the lowest mean over series of its mean `metric` over their windows."""
    per_series = metrics.group_by(SERIES, "model").agg(pl.col(metric).drop_nans().mean())
    ranked = (
        per_series.group_by("model").agg(pl.col(metric).drop_nans().mean()).sort(metric, "model")
    )
    return str(ranked["model"][0]) if ranked.height else ""  # "": every model failed


def _value(value: float | None) -> float:
    return float(value) if value is not None and math.isfinite(value) else float("nan")
