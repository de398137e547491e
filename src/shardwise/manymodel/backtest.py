"""Rolling-origin backtest, model selection and the final forecast for one series, and for a chunk
of series (the unit of work a Ray task runs).

For each of `n_windows` forecast origins, `step` rows apart and ending `horizon` rows before the
last observation, every model is fitted on the rows before the origin and forecasts the next
`horizon` rows. Metrics per series × model × window: MAE, RMSE, sMAPE (0–200, as the M4
competition reports it) and MASE (MAE over the in-sample MAE of the seasonal naive forecast).

Selection is scored honestly (a nested backtest): on every window after the first, the model
chosen on the windows before it (`selected`) and the mean of the `ensemble_top_k` best there
(`ensemble`) are scored as if they were models, so their scores are never the scores they were
chosen by (the runner compares them, and the best single model, and picks what the forecasts
use). Every model is then refitted on
every observation and forecasts the `horizon` future rows; the per-series choice is the model with
the best mean `metric` over all windows. A model that raises is recorded and left out for that
series; the series fails only when no model succeeds.
"""

from __future__ import annotations

import os
import resource
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl

from shardwise.manymodel.data import FUTURE, SERIES, Columns
from shardwise.manymodel.models import Model, ModelContext, as_values, build

METRICS = ("mae", "rmse", "smape", "mase")
SELECTED, ENSEMBLE = "selected", "ensemble"
"""Labels of the backtest's held-out choices in the metrics table, and of the ensemble's
forecasts: no model may be named so."""
TARGET = "y"
"""The target's column name in the frames models see, whatever it is called in the data."""


@dataclass(frozen=True)
class Plan:
    """Everything a task needs besides its rows; small and picklable."""

    columns: Columns
    context: ModelContext
    models: tuple[tuple[str, str, dict[str, Any]], ...]
    """(label, name or import path, arguments) per model."""
    level_columns: tuple[str, ...]
    spread_columns: tuple[str, ...]
    scales: dict[str, str]
    """The target's scaling per model label: none, mean or standard."""
    horizon: int
    n_windows: int
    step: int
    metric: str
    memory_mb: int = 0
    ensemble_top_k: int = 0


@dataclass
class ChunkResult:
    metrics: list[dict[str, Any]] = field(default_factory=list)
    choices: list[dict[str, Any]] = field(default_factory=list)
    forecasts: list[dict[str, Any]] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)
    series: int = 0
    failed_series: int = 0
    started: float = 0.0
    finished: float = 0.0
    pid: int = 0

    def tables(self) -> dict[str, pl.DataFrame]:
        return {
            "metrics": pl.DataFrame(self.metrics, schema=_METRICS_SCHEMA),
            "choices": pl.DataFrame(self.choices, schema=_CHOICE_SCHEMA),
            "forecasts": pl.DataFrame(self.forecasts, schema=_FORECAST_SCHEMA),
            "failures": pl.DataFrame(self.failures, schema=_FAILURE_SCHEMA),
        }


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
_FORECAST_SCHEMA = {SERIES: pl.Int64, "step": pl.Int64, "model": pl.String, "forecast": pl.Float64}
_FAILURE_SCHEMA = {SERIES: pl.Int64, "model": pl.String, "stage": pl.String, "error": pl.String}


def run_chunk(rows: Any, plan: Plan) -> ChunkResult:
    """Backtest, select and forecast every series in `rows` (an Arrow table or polars frame of
    whole series, features included). Threads are pinned to one; `plan.memory_mb` caps the
    address space while the chunk runs."""
    result = ChunkResult(started=time.time(), pid=os.getpid())
    frame = rows if isinstance(rows, pl.DataFrame) else pl.from_arrow(rows)
    assert isinstance(frame, pl.DataFrame)
    if plan.columns.target != TARGET:
        frame = frame.rename({plan.columns.target: TARGET})
    uses_torch = "torch" in sys.modules or any(name == "mlp" for _, name, _ in plan.models)
    with _one_thread(torch_too=uses_torch), _memory_cap(plan.memory_mb):
        models = {label: build(name, args, plan.context) for label, name, args in plan.models}
        for part in frame.partition_by(SERIES, maintain_order=True):
            forecast_series(part, plan, models, result)
    result.finished = time.time()
    return result


def forecast_series(
    frame: pl.DataFrame, plan: Plan, models: dict[str, Model], out: ChunkResult
) -> None:
    """One series: backtest every model, score the held-out choices, refit every model on all
    rows and forecast; results appended to `out`."""
    series = int(frame[SERIES][0])
    observed = frame.filter(~pl.col(FUTURE))
    future = frame.filter(pl.col(FUTURE))
    y = TARGET
    n, h = observed.height, plan.horizon
    scores: dict[str, list[float]] = {label: [] for label in models}
    predictions: dict[str, list[np.ndarray]] = {label: [] for label in models}
    for window in range(plan.n_windows):
        origin = n - h - plan.step * (plan.n_windows - 1 - window)
        train, test = observed.head(origin), observed.slice(origin, h)
        actual = test[y].to_numpy().astype(np.float64)
        naive_mae = _seasonal_mae(
            train[y].to_numpy().astype(np.float64), plan.context.season_length
        )
        for label in list(scores):
            try:
                predicted = _fit_predict(models[label], label, train, test.drop(y), plan)
            except Exception as e:
                out.failures.append(_failure(series, label, f"window {window}", e))
                del scores[label], predictions[label]
                continue
            row = _metrics(actual, predicted, naive_mae)
            out.metrics.append(
                {SERIES: series, "model": label, "window": window, "origin": origin, **row}
            )
            scores[label].append(row[plan.metric] if np.isfinite(row[plan.metric]) else row["mae"])
            predictions[label].append(predicted)
        if window > 0 and scores:  # choices made on the windows before this one
            held_out = _held_out(scores, predictions, plan.ensemble_top_k)
            for label, predicted in held_out.items():
                row = _metrics(actual, predicted, naive_mae)
                out.metrics.append(
                    {SERIES: series, "model": label, "window": window, "origin": origin, **row}
                )
    out.series += 1
    ranked = sorted(scores, key=lambda label: _score(scores[label]))
    finals: dict[str, np.ndarray] = {}
    for label in ranked:
        try:
            finals[label] = _fit_predict(models[label], label, observed, future.drop(y), plan)
        except Exception as e:
            out.failures.append(_failure(series, label, "refit", e))
    if not finals:
        out.failed_series += 1
        return
    ranked = [label for label in ranked if label in finals]
    top = ranked[: max(plan.ensemble_top_k, 1)]
    out.choices.append(
        {SERIES: series, "model": ranked[0], "score": _score(scores[ranked[0]]), "top": top}
    )
    if plan.ensemble_top_k > 1:
        finals[ENSEMBLE] = np.mean([finals[label] for label in top], axis=0)
    out.forecasts.extend(
        {SERIES: series, "step": k + 1, "model": label, "forecast": float(v)}
        for label, predicted in finals.items()
        for k, v in enumerate(predicted)
    )


def _held_out(
    scores: dict[str, list[float]], predictions: dict[str, list[np.ndarray]], top_k: int
) -> dict[str, np.ndarray]:
    """This window's forecasts (the last in `predictions`) of the choices made on the windows
    before it: the model with the best mean metric there (`selected`) and, with `top_k` ≥ 2, the
    mean of the `top_k` best (`ensemble`). This window's own errors play no part in either."""
    earlier = {label: _score(values[:-1]) for label, values in scores.items()}
    ranked = sorted(earlier, key=lambda label: earlier[label])
    chosen = {SELECTED: predictions[ranked[0]][-1]}
    if top_k > 1:
        chosen[ENSEMBLE] = np.mean([predictions[label][-1] for label in ranked[:top_k]], axis=0)
    return chosen


def _score(values: list[float]) -> float:
    """A model's mean metric over the windows; windows without actual values do not count."""
    finite = [v for v in values if np.isfinite(v)]
    return float(np.mean(finite)) if finite else float("inf")


def _fit_predict(
    model: Model, label: str, train: pl.DataFrame, rows: pl.DataFrame, plan: Plan
) -> np.ndarray:
    """Fit on `train` and predict `rows`, in the target's own units (scaling undone)."""
    how = plan.scales[label]
    loc, scale = _scaling(train[TARGET].to_numpy().astype(np.float64), how)
    if how != "none":
        train, rows = _scaled(train, plan, loc, scale), _scaled(rows, plan, loc, scale)
    predicted = as_values(model.predict(model.fit(train), rows), rows.height, label)
    return predicted * scale + loc


def _scaling(y: np.ndarray, how: str) -> tuple[float, float]:
    y = y[~np.isnan(y)]
    if how == "none" or y.size == 0:
        return 0.0, 1.0
    if how == "mean":
        scale = float(np.mean(np.abs(y)))
        return 0.0, scale or 1.0
    return float(np.mean(y)), float(np.std(y)) or 1.0


def _scaled(frame: pl.DataFrame, plan: Plan, loc: float, scale: float) -> pl.DataFrame:
    level = [c for c in (TARGET, *plan.level_columns) if c in frame.columns]
    return frame.with_columns(
        *((pl.col(c) - loc) / scale for c in level),
        *(pl.col(c) / scale for c in plan.spread_columns),
    )


def _seasonal_mae(y: np.ndarray, season: int) -> float:
    """In-sample MAE of the seasonal naive forecast: MASE's denominator."""
    lag = max(season, 1) if y.size > season else 1
    errors = np.abs(y[lag:] - y[:-lag])
    errors = errors[~np.isnan(errors)]
    return float(errors.mean()) if errors.size else float("nan")


def _metrics(actual: np.ndarray, predicted: np.ndarray, naive_mae: float) -> dict[str, float]:
    keep = ~np.isnan(actual)
    a, p = actual[keep], predicted[keep]
    if a.size == 0:
        return dict.fromkeys(METRICS, float("nan"))
    err = np.abs(a - p)
    denom = np.abs(a) + np.abs(p)
    ratio = np.divide(err, denom, out=np.zeros_like(err), where=denom > 0)
    mae = float(err.mean())
    return {
        "mae": mae,
        "rmse": float(np.sqrt(np.mean(err**2))),
        "smape": float(200.0 * ratio.mean()),
        "mase": mae / naive_mae if naive_mae > 0 else float("nan"),
    }


def _failure(series: int, model: str, stage: str, error: BaseException) -> dict[str, Any]:
    where = traceback.extract_tb(error.__traceback__)[-1] if error.__traceback__ else None
    at = f" (at {os.path.basename(where.filename)}:{where.lineno})" if where else ""
    return {
        SERIES: series,
        "model": model,
        "stage": stage,
        "error": f"{type(error).__name__}: {error}{at}",
    }


@contextmanager
def _one_thread(*, torch_too: bool) -> Iterator[None]:
    """Tasks share the cores: BLAS, OpenMP and (when a model uses it) torch get one thread each.
    torch is imported only then: importing it costs a new worker process a second or two."""
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1):
        if not torch_too:
            yield
            return
        import torch

        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(before)


@contextmanager
def _memory_cap(megabytes: int) -> Iterator[None]:
    """Limit this process's address space to its current size + `megabytes` while the chunk runs:
    an allocation beyond it raises MemoryError in the series that made it."""
    if not megabytes:
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as statm:
        current = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = current + megabytes * 2**20
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
