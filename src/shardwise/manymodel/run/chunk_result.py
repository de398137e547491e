"""What a chunk of series yields: its metrics, choices, forecasts, failures and backtest windows,
kept as rows while the chunk runs and turned into the tables the chunk store writes (their schemas
and column names here: the vocabulary selection, outputs and the summary read)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl

from shardwise.manymodel.columns import SERIES
from shardwise.manymodel.evaluation.intervals import bound_names

METRICS = ("mae", "rmse", "smape", "mase")


SELECTED, ENSEMBLE = "selected", "ensemble"
"""Labels of the backtest's held-out choices in the metrics table, and of the ensemble's
forecasts: no model may be named so."""


@dataclass
class ChunkResult:
    metrics: list[dict[str, Any]] = field(default_factory=list)
    choices: list[dict[str, Any]] = field(default_factory=list)
    forecasts: list[dict[str, Any]] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)
    backtest: list[Window] = field(default_factory=list)
    """Per backtest window: each model's forecast, which the metrics score, and the ensemble's
    of the series' final top k (not the nested one the metrics score: the forecasts' ensemble
    on past windows, for the intervals and the reconciliation), with the window's actual values
    and scale (intervals.py)."""
    series: int = 0
    failed_series: int = 0
    started: float = 0.0
    finished: float = 0.0
    pid: int = 0
    levels: tuple[int, ...] = ()

    @classmethod
    def joined(cls, parts: Sequence[ChunkResult]) -> ChunkResult:
        """One chunk's result from the results of its parts, in series order (local_tasks.py
        runs the last chunks of a job in parts): the rows each would have had run whole; a
        chunk run whole, its one result."""
        if len(parts) == 1:
            return parts[0]
        first = parts[0]
        whole = cls(pid=first.pid, levels=first.levels)
        whole.started = min(part.started for part in parts)
        whole.finished = max(part.finished for part in parts)
        for part in parts:
            whole.metrics += part.metrics
            whole.choices += part.choices
            whole.forecasts += part.forecasts
            whole.failures += part.failures
            whole.backtest += part.backtest
            whole.series += part.series
            whole.failed_series += part.failed_series
        return whole

    def tables(self) -> dict[str, pl.DataFrame]:
        bounds = dict.fromkeys(own_bounds(self.levels), pl.Float64)
        return {
            "metrics": pl.DataFrame(self.metrics, schema=_METRICS_SCHEMA),
            "choices": pl.DataFrame(self.choices, schema=_CHOICE_SCHEMA),
            "forecasts": pl.DataFrame(self.forecasts, schema={**_FORECAST_SCHEMA, **bounds}),
            "failures": pl.DataFrame(self.failures, schema=_FAILURE_SCHEMA),
            "backtest": self._backtest(),
        }

    def _backtest(self) -> pl.DataFrame:
        """The windows' forecasts, a row per step: built from arrays, not a dict per row (there
        are n_windows × horizon rows per model and series)."""
        bounds = own_bounds(self.levels)
        schema = {**_BACKTEST_SCHEMA, **dict.fromkeys(bounds, pl.Float64)}
        if not self.backtest:
            return pl.DataFrame(schema=schema)
        lengths = [w.forecast.size for w in self.backtest]
        columns: dict[str, Any] = {
            SERIES: np.repeat([w.series for w in self.backtest], lengths),
            "model": np.repeat([w.model for w in self.backtest], lengths),
            "window": np.repeat([w.window for w in self.backtest], lengths),
            "origin": np.repeat([w.origin for w in self.backtest], lengths),
            "step": np.concatenate([np.arange(1, n + 1) for n in lengths]),
            "forecast": np.concatenate([w.forecast for w in self.backtest]),
            "actual": np.concatenate([w.actual for w in self.backtest]),
            "scale": np.repeat([w.scale for w in self.backtest], lengths),
        }
        for level in self.levels:
            for side, name in enumerate(own_bounds((level,))):
                columns[name] = np.concatenate(
                    [
                        w.own[level][side] if level in w.own else np.full(n, np.nan)
                        for w, n in zip(self.backtest, lengths, strict=True)
                    ]
                )
        return pl.DataFrame(columns, schema=schema).fill_nan(None)


@dataclass(frozen=True)
class Window:
    """A model's forecast of one backtest window of a series, the window's actual values and
    scale (the in-sample seasonal naive MAE before it), and the model's own intervals."""

    series: int
    model: str
    window: int
    origin: int
    forecast: np.ndarray
    actual: np.ndarray
    scale: float
    own: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)


def own_bounds(levels: Sequence[int]) -> list[str]:
    """The columns of the models' own intervals in a chunk's tables: `own_lo_80`, `own_hi_80`
    (null where a model has none, or `backtest.intervals` is not "model")."""
    return [f"own_{name}" for level in levels for name in bound_names(level)]


_METRICS_SCHEMA = {
    SERIES: pl.Int64,
    "model": pl.String,
    "window": pl.Int64,
    "origin": pl.Int64,
    **dict.fromkeys(METRICS, pl.Float64),
}


_CHOICE_SCHEMA: dict[str, pl.DataType] = {
    SERIES: pl.Int64(),
    "model": pl.String(),
    "score": pl.Float64(),
    "top": pl.List(pl.String),
}


_FORECAST_SCHEMA = {
    SERIES: pl.Int64,
    "step": pl.Int64,
    "model": pl.String,
    "forecast": pl.Float64,
    "scale": pl.Float64,
}


_BACKTEST_SCHEMA = {
    SERIES: pl.Int64,
    "model": pl.String,
    "window": pl.Int64,
    "origin": pl.Int64,
    "step": pl.Int64,
    "forecast": pl.Float64,
    "actual": pl.Float64,
    "scale": pl.Float64,
}


_FAILURE_SCHEMA = {SERIES: pl.Int64, "model": pl.String, "stage": pl.String, "error": pl.String}
