"""Rolling-origin backtest, model selection and the final forecast for one series (chunk.py runs
them for a chunk of series, the unit of work a Ray task runs).

For each of `n_windows` forecast origins, `step` rows apart and ending `horizon` rows before the
last observation, every model is fitted on the rows before the origin and forecasts the next
`horizon` rows. Metrics per series × model × window: MAE, RMSE, sMAPE (0–200, as the M4
competition reports it) and MASE (MAE over the in-sample MAE of the seasonal naive forecast).

Selection is scored honestly (a nested backtest): on every window after the first, the model
chosen on the windows before it (`selected`) and the mean of the `ensemble_top_k` best there
(`ensemble`) are scored as if they were models, so their scores are never the scores they were
chosen by (the runner compares them, and the best single model, and picks what the forecasts
use). Every model is then refitted on
every observation (or, as `backtest.refit` says, its last fit carried to them: `update`) and
forecasts the `horizon` future rows; the per-series choice is the model with the best mean
`metric` over all windows. `backtest.refit` applies to the windows too: one that is not refitted
forecasts with the last fit, updated to its longer history; with `backtest.reselect = false` one
that is refitted keeps the form the first window's fit chose (`Plan.how`). A model that raises
is recorded and left out for that series; the series fails only when no model succeeds.
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import polars as pl

from shardwise.manymodel.columns import FUTURE, SERIES, Columns
from shardwise.manymodel.models.context import ModelContext
from shardwise.manymodel.models.per_series import Model, as_values
from shardwise.manymodel.models.transforms import TARGET, TargetTransform
from shardwise.manymodel.run.chunk_result import (
    ENSEMBLE,
    METRICS,
    SELECTED,
    ChunkResult,
    Window,
    own_bounds,
)


@dataclass(frozen=True)
class Plan:
    """Everything a task needs besides its rows; small and picklable."""

    columns: Columns
    context: ModelContext
    models: tuple[tuple[str, str, dict[str, Any]], ...]
    """(label, name or import path, arguments) per model."""
    transforms: dict[str, TargetTransform]
    """The target transform (scaling, differencing) per model label."""
    horizon: int
    n_windows: int
    step: int
    metric: str
    memory_mb: int = 0
    ensemble_top_k: int = 0
    levels: tuple[int, ...] = ()
    """Prediction-interval levels in percent (intervals.py); () for points only."""
    intervals: str = "auto"
    """"model": a model's own intervals (`predict_interval`) are computed and kept with its
    forecasts, for the run to use where it has them (intervals.py)."""
    global_models: frozenset[str] = frozenset()
    """Labels of the models fitted across series (global_models.py): the chunks get their
    forecasts (`Given`) instead of fitting them."""
    refit: int = 1
    """Windows between re-estimations (`backtest.refit`; 0: the first window only); the
    forecast counts as window n_windows."""
    reselect: bool = True
    """Whether a re-estimation chooses the model's form again (`backtest.reselect`) or keeps
    the one its first fit chose."""

    def refits(self, window: int) -> bool:
        """Whether a model is re-estimated for `window` (n_windows: the forecast) rather than
        updated from its last fit."""
        return refits(self.refit, window)

    def how(self, window: int) -> Fit:
        """How each model is fitted for `window` (n_windows: the forecast), given its last fit."""
        if window == 0:
            return "fit"
        if not self.refits(window):
            return "update"
        return "fit" if self.reselect else "reestimate"


Fit = Literal["fit", "update", "reestimate"]
"""A model fitted anew; its last fit carried to the longer history (`update`); or its last
fit's form estimated again on the window's rows (`reestimate`). A model without the method
named is fitted anew."""


def refits(every: int, window: int) -> bool:
    """statsforecast's rule: a model is fitted on window 0 and every `every`-th (0: none more)."""
    return window == 0 or (every > 0 and window % every == 0)


def forecast_series(
    frame: pl.DataFrame, plan: Plan, models: dict[str, Model], out: ChunkResult
) -> None:
    """One series: backtest every model, score the choices made on earlier windows, refit every
    model on all rows and forecast; results appended to `out`."""
    series = int(frame[SERIES][0])
    observed, future = _observed_and_future(frame)
    tracks = {label: _Track(model) for label, model in models.items()}  # failed ones leave
    truths: list[_Truth] = []
    for window, origin in enumerate(origins(observed.height, plan)):
        train, test = observed.head(origin), observed.slice(origin, plan.horizon)
        truth = _Truth(
            test[TARGET].to_numpy().astype(np.float64),
            seasonal_mae(train[TARGET].to_numpy().astype(np.float64), plan.context.season_length),
            {SERIES: series, "window": window, "origin": origin},
        )
        truths.append(truth)
        # the choices made on the windows before this one, ranked by their scores there
        ranked = _ranked(tracks) if window else []
        rows = _without_target(test)  # what every model predicts: once, not once per model
        for label, track in list(tracks.items()):
            try:
                predicted, track.fit = _fit_predict(
                    track.model, label, train, rows, plan, track.fit, window
                )
            except Exception as e:
                out.failures.append(_failure(series, label, f"window {window}", e))
                del tracks[label]
                continue
            row = truth.scores(predicted)
            out.metrics.append({**truth.keys, "model": label, **row})
            track.scores.append(row[plan.metric] if np.isfinite(row[plan.metric]) else row["mae"])
            track.predictions.append(predicted)
            out.backtest.append(truth.window(label, predicted))
        ranked = [label for label in ranked if label in tracks]  # not failed here
        if ranked:
            top = ranked[: plan.ensemble_top_k] if plan.ensemble_top_k > 1 else []
            chosen = tracks[ranked[0]].predictions[-1]
            out.metrics.append({**truth.keys, "model": SELECTED} | truth.scores(chosen))
            if top:
                mean = np.mean([tracks[label].predictions[-1].values for label in top], axis=0)
                out.metrics.append(
                    {**truth.keys, "model": ENSEMBLE} | truth.scores(_Forecast(mean))
                )
    out.series += 1
    _refit(plan, series, tracks, (observed, _without_target(future)), truths, out)


def _observed_and_future(frame: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame]:
    """A series' observed rows and its future ones: slices where the future rows come last (in
    time order they do), not a query per series."""
    flags = frame[FUTURE]
    observed = frame.height - int(flags.sum())
    if flags.head(observed).any():
        return frame.filter(~flags), frame.filter(flags)
    return frame.head(observed), frame.slice(observed)


def _without_target(frame: pl.DataFrame) -> pl.DataFrame:
    """`frame.drop(TARGET)`, built from its columns directly: a few rows, for every window of
    every series, where polars' query engine cost more than the copy."""
    return pl.DataFrame([column for column in frame.get_columns() if column.name != TARGET])


@dataclass
class _Track:
    """One model's backtest of one series: its score and forecast on each window so far, and
    its last fit (what `backtest.refit` may update instead of fitting again)."""

    model: Model
    scores: list[float] = field(default_factory=list)
    predictions: list[_Forecast] = field(default_factory=list)
    fit: Any = None


def _ranked(tracks: dict[str, _Track]) -> list[str]:
    """The models by their mean score over the windows so far, best first."""
    return sorted(tracks, key=lambda label: _score(tracks[label].scores))


def _ensemble(top: list[str], tracks: dict[str, _Track], n: int) -> list[np.ndarray]:
    """The mean forecast of the `top` models on each of the first `n` windows."""
    return [
        np.mean([tracks[label].predictions[w].values for label in top], axis=0) for w in range(n)
    ]


def origins(n: int, plan: Plan) -> list[int]:
    """The forecast origins (training rows) of a series with `n` observed rows, per window."""
    last = n - plan.horizon
    return [last - plan.step * (plan.n_windows - 1 - w) for w in range(plan.n_windows)]


class Given:
    """A global model inside a chunk: its forecasts were made across series beforehand
    (global_models.py); `fit` notes the origin, `predict` looks the forecast up."""

    def __init__(self, label: str, given: Any) -> None:
        frame = given if isinstance(given, pl.DataFrame) else pl.from_arrow(given)
        assert isinstance(frame, pl.DataFrame)
        self.forecasts: dict[tuple[int, int], np.ndarray] = {}
        self.errors: dict[tuple[int, int], str] = {}
        for (series, origin), part in frame.filter(pl.col("model") == label).group_by(
            SERIES, "origin"
        ):
            key = (int(series), int(origin))
            error = part["error"].drop_nulls()
            if error.len():
                self.errors[key] = str(error[0])
            else:
                self.forecasts[key] = part.sort("step")["forecast"].to_numpy()

    def fit(self, frame: pl.DataFrame) -> tuple[int, int]:
        return int(frame[SERIES][0]), frame.height

    def predict(self, fitted: tuple[int, int], frame: pl.DataFrame) -> np.ndarray:
        if fitted in self.errors:
            raise RuntimeError(f"the global fit failed: {self.errors[fitted]}")
        if fitted not in self.forecasts:
            raise RuntimeError(f"no global forecast for series {fitted[0]} at row {fitted[1]}")
        return self.forecasts[fitted]


@dataclass(frozen=True)
class _Truth:
    """One window's actual values, its MASE scale and the keys of its metrics rows."""

    actual: np.ndarray
    naive_mae: float
    keys: dict[str, Any]

    def scores(self, predicted: _Forecast) -> dict[str, float]:
        """The point metrics (the intervals are scored across series: intervals.py)."""
        return _metrics(self.actual, predicted.values, self.naive_mae)

    def window(self, label: str, predicted: _Forecast) -> Window:
        """`label`'s forecast of this window, as the backtest table keeps it."""
        keys = self.keys
        return Window(
            keys[SERIES], label, keys["window"], keys["origin"], predicted.values, self.actual,
            self.naive_mae, predicted.own,
        )  # fmt: skip


def _refit(
    plan: Plan,
    series: int,
    tracks: dict[str, _Track],
    rows: tuple[pl.DataFrame, pl.DataFrame],
    truths: list[_Truth],
    out: ChunkResult,
) -> None:
    """Refit (or, as `backtest.refit` says, update) every model on all the observed rows and
    forecast the future ones, with intervals from every window's errors; the series' choice
    (best mean over the windows) and its top k."""
    observed, future = rows
    ranked = _ranked(tracks)
    finals: dict[str, _Forecast] = {}
    for label in ranked:
        track = tracks[label]
        try:
            finals[label], _ = _fit_predict(
                track.model, label, observed, future, plan, track.fit, window=plan.n_windows
            )
        except Exception as e:
            out.failures.append(_failure(series, label, "refit", e))
    if not finals:
        out.failed_series += 1
        return
    ranked = [label for label in ranked if label in finals]
    top = ranked[: max(plan.ensemble_top_k, 1)]
    out.choices.append(
        {SERIES: series, "model": ranked[0], "score": _score(tracks[ranked[0]].scores), "top": top}
    )
    if plan.ensemble_top_k > 1:  # its intervals from its own errors on the windows
        finals[ENSEMBLE] = _Forecast(np.mean([finals[label].values for label in top], axis=0))
        means = _ensemble(top, tracks, len(truths))
        out.backtest.extend(
            truth.window(ENSEMBLE, _Forecast(mean))
            for truth, mean in zip(truths, means, strict=True)
        )
    scale = seasonal_mae(observed[TARGET].to_numpy().astype(np.float64), plan.context.season_length)
    for label, predicted in finals.items():
        bounds = [
            (name, predicted.own[level][side])
            for level in predicted.own
            for side, name in enumerate(own_bounds((level,)))
        ]
        for k, v in enumerate(predicted.values.tolist()):
            row = {SERIES: series, "step": k + 1, "model": label, "forecast": v, "scale": scale}
            for name, values in bounds:
                row[name] = float(values[k])
            out.forecasts.append(row)


def _score(values: list[float]) -> float:
    """A model's mean metric over the windows; windows without actual values do not count."""
    finite = [v for v in values if np.isfinite(v)]
    return float(np.mean(finite)) if finite else float("inf")


@dataclass(frozen=True)
class _Forecast:
    """A model's forecast of some rows, in the target's own units, and its own intervals (level
    → lower, upper) where the model has them and `backtest.intervals = "model"`."""

    values: np.ndarray
    own: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)


def _fit_predict(
    model: Model,
    label: str,
    train: pl.DataFrame,
    rows: pl.DataFrame,
    plan: Plan,
    previous: Any = None,
    window: int = 0,
) -> tuple[_Forecast, Any]:
    """Fit on `train` as `plan.how(window)` says (given a `previous` fit and a model that can,
    update it or estimate its form again) and predict `rows`, in the target's own units
    (transforms undone); and the fit."""
    if isinstance(model, Given):  # forecast across series, already in the target's units
        fitted = model.fit(train)
        return _Forecast(as_values(model.predict(fitted, rows), rows.height, label)), fitted
    train, rows, back = plan.transforms[label].apply(train, rows)
    how = plan.how(window)
    carry = getattr(model, how, None) if how != "fit" and previous is not None else None
    fitted = carry(previous, train) if carry is not None else model.fit(train)
    predicted = as_values(model.predict(fitted, rows), rows.height, label)
    own = {}
    interval = getattr(model, "predict_interval", None)
    if plan.intervals == "model" and interval is not None:
        for level in plan.levels:
            lower, upper = interval(fitted, rows, level)
            own[level] = (
                back(as_values(lower, rows.height, label)),
                back(as_values(upper, rows.height, label)),
            )
    return _Forecast(back(predicted), own), fitted


def seasonal_mae(y: np.ndarray, season: int) -> float:
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
    return {SERIES: series, "model": model, "stage": stage, "error": failure_message(error)}


def failure_message(error: BaseException) -> str:
    """`Type: message (at file:line)`, the line where it was raised."""
    where = traceback.extract_tb(error.__traceback__)[-1] if error.__traceback__ else None
    at = f" (at {os.path.basename(where.filename)}:{where.lineno})" if where else ""
    return f"{type(error).__name__}: {error}{at}"
