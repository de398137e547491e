"""Per-series forecasting models: a `fit(frame) -> fitted` and a `predict(fitted, frame)`.

`frame` is one series' rows as a polars DataFrame: the id columns, the timestamp, the target as
column `y` (scaled when `features.scale` says so; absent from the frame given to `predict`),
covariates and feature columns. `predict` returns one number per row of its frame, in order.
Built-in models know which columns are features from a `ModelContext`; a user model is an
importable module or `module:object` with those two functions (a class is instantiated with
`models.args.<name>`), see examples/croston.py. A model may also have `update(fitted, frame) ->
fitted`: the fit carried to a longer history of the same series without estimating it again,
which `backtest.refit` uses on the windows it does not refit; and `reestimate(fitted, frame) ->
fitted`: a fit to `frame` in the form an earlier fit chose, which `backtest.reselect = false`
uses on the windows it refits after the first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import polars as pl

from shardwise.common.errors import ConfigError
from shardwise.common.imports import import_object
from shardwise.manymodel.config import BUILTIN_MODELS
from shardwise.manymodel.models.context import ModelContext
from shardwise.manymodel.models.group import Group
from shardwise.manymodel.models.statistical import STATISTICAL


class Model(Protocol):
    def fit(self, frame: pl.DataFrame) -> Any: ...

    def predict(self, fitted: Any, frame: pl.DataFrame) -> Any: ...


def build(name: str, args: dict[str, Any], context: ModelContext) -> Model:
    """A model by built-in name or import path, with its arguments."""
    if name in BUILTIN_MODELS:
        cls = _BUILTINS[name]
        try:
            built: Model = cls(context, **args)
        except TypeError as e:
            raise ConfigError(f"models.args.{name}: {e}") from None
        return built
    obj = import_object(name, "models.names")
    if isinstance(obj, type):
        try:
            obj = obj(**args)
        except TypeError as e:
            raise ConfigError(f"models.args for {name}: {e}") from None
    elif args:
        raise ConfigError(f"model {name} is not a class, so models.args for it cannot be used")
    for method in ("fit", "predict"):
        if not callable(getattr(obj, method, None)):
            raise ConfigError(
                f"model {name} has no {method}(); a user model needs fit(frame) -> fitted and "
                "predict(fitted, frame) -> values"
            )
    model: Model = obj
    return model


class SeasonalNaive:
    """Each step repeats the value one season earlier (the last value when the season is 1)."""

    def __init__(self, context: ModelContext) -> None:
        self.context = context

    def fit(self, frame: pl.DataFrame) -> np.ndarray:
        y = frame[self.context.target]
        if y.has_nulls():  # a missing value is the one before it
            y = y.fill_null(strategy="forward").drop_nulls()
        return y.to_numpy()[-self.context.season_length :]

    def predict(self, fitted: np.ndarray, frame: pl.DataFrame) -> np.ndarray:
        return fitted[np.arange(frame.height) % len(fitted)]


@dataclass
class _Design:
    """Turns feature columns into a standardised matrix: one-hot codes, training-mean fill."""

    numeric: list[str]
    categorical: list[str]
    mean: np.ndarray = field(default_factory=lambda: np.zeros(0))
    scale: np.ndarray = field(default_factory=lambda: np.ones(0))
    levels: dict[str, np.ndarray] = field(default_factory=dict)

    def fit(self, frame: pl.DataFrame, group: Group | None = None) -> np.ndarray:
        """Learn the fill values, scales and levels from `frame` (and with a `group`, from every
        worker's rows, so each gets the design one worker with all the rows would), and
        transform it."""
        group = group or Group(0, 1)
        x = frame.select(self.numeric).to_numpy().astype(np.float64)
        present = ~np.isnan(x)
        sums = group.allreduce(
            np.concatenate([present.sum(axis=0), np.where(present, x, 0).sum(axis=0), [len(x)]])
        )
        counts, totals, rows = np.split(sums, [x.shape[1], 2 * x.shape[1]])
        self.mean = np.divide(totals, counts, out=np.zeros_like(totals), where=counts > 0)
        x = np.where(present, x, self.mean)
        squares = group.allreduce(((x - self.mean) ** 2).sum(axis=0))
        self.scale = np.sqrt(squares / max(rows[0], 1))
        self.scale[self.scale == 0] = 1.0
        self.levels = {
            c: np.asarray(group.union(frame[c].drop_nulls().unique().to_list()))
            for c in self.categorical
        }
        return self._matrix(frame, x)

    def transform(self, frame: pl.DataFrame) -> np.ndarray:
        x = frame.select(self.numeric).to_numpy().astype(np.float64)
        return self._matrix(frame, np.where(np.isnan(x), self.mean, x))

    def _matrix(self, frame: pl.DataFrame, x: np.ndarray) -> np.ndarray:
        parts = [(x - self.mean) / self.scale]
        for c in self.categorical:
            codes = frame[c].to_numpy()
            parts.append((codes[:, None] == self.levels[c][None, :]).astype(np.float64))
        return np.hstack(parts)


def _training_rows(frame: pl.DataFrame, context: ModelContext) -> pl.DataFrame:
    """Rows with a target and every lag/window feature (the first rows of a series lack some)."""
    return frame.drop_nulls([context.target, *context.features])


class _OnFeatures:
    """A model that forecasts from each row's features alone: a fit carries to a longer history
    as it is (`backtest.refit`), the rows' features (lags, windows) coming from that history."""

    def update(self, fitted: Any, frame: pl.DataFrame) -> Any:
        return fitted


class Ridge(_OnFeatures):
    """Ridge regression (scikit-learn) on standardised features, calendar parts one-hot."""

    def __init__(self, context: ModelContext, alpha: float = 1.0) -> None:
        self.context, self.alpha = context, alpha

    def fit(self, frame: pl.DataFrame) -> tuple[_Design, Any]:
        from sklearn.linear_model import Ridge as SkRidge

        rows = _training_rows(frame, self.context)
        design = _Design(_numeric(self.context), list(self.context.categorical))
        model = SkRidge(alpha=self.alpha).fit(design.fit(rows), rows[self.context.target])
        return design, model

    def predict(self, fitted: tuple[_Design, Any], frame: pl.DataFrame) -> np.ndarray:
        design, model = fitted
        return np.asarray(model.predict(design.transform(frame)))


class LightGBM(_OnFeatures):
    """Gradient-boosted trees (LightGBM) on the raw features; one thread per task."""

    def __init__(
        self,
        context: ModelContext,
        n_estimators: int = 100,
        learning_rate: float = 0.05,
        num_leaves: int = 15,
        min_child_samples: int = 5,
    ) -> None:
        self.context = context
        self.params: dict[str, Any] = {
            "n_estimators": n_estimators,
            "learning_rate": learning_rate,
            "num_leaves": num_leaves,
            "min_child_samples": min_child_samples,
        }

    def fit(self, frame: pl.DataFrame, group: Group | None = None) -> Any:
        """Fit on `frame`; with a `group` of workers, data-parallel over LightGBM's sockets, each
        worker on its own rows (one model, the same on every worker)."""
        import lightgbm

        rows = frame.drop_nulls([self.context.target])
        network = group.lightgbm if group is not None else {}
        model = lightgbm.LGBMRegressor(
            **self.params, **network, n_jobs=1, verbose=-1, random_state=self.context.seed
        )
        features = list(self.context.features)
        model.fit(rows.select(features).to_numpy(), rows[self.context.target].to_numpy())
        if network:  # close the sockets now, not when the model is collected
            model.booster_.free_network()
        return model

    def predict(self, fitted: Any, frame: pl.DataFrame) -> np.ndarray:
        return np.asarray(fitted.predict(frame.select(list(self.context.features)).to_numpy()))


class MLP(_OnFeatures):
    """A small torch MLP (one hidden layer) on standardised features, trained full-batch."""

    def __init__(
        self, context: ModelContext, hidden: int = 32, epochs: int = 200, lr: float = 1e-2
    ) -> None:
        self.context, self.hidden, self.epochs, self.lr = context, hidden, epochs, lr

    def fit(self, frame: pl.DataFrame, group: Group | None = None) -> tuple[_Design, Any]:
        """Fit on `frame`; with a `group` of workers, each on its own rows, the gradient of the
        mean loss over all of them summed over gloo (the same net on every worker)."""
        import torch

        group = group or Group(0, 1)
        rows = _training_rows(frame, self.context)
        design = _Design(_numeric(self.context), list(self.context.categorical))
        x = torch.from_numpy(design.fit(rows, group)).float()
        y = torch.tensor(rows[self.context.target].to_numpy(), dtype=torch.float32)[:, None]
        total = float(group.allreduce(np.array([rows.height]))[0]) or 1.0
        torch.manual_seed(self.context.seed)
        net = torch.nn.Sequential(
            torch.nn.Linear(x.shape[1], self.hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(self.hidden, 1),
        )
        optimizer = torch.optim.Adam(net.parameters(), lr=self.lr)
        params = list(net.parameters())
        for _ in range(self.epochs):
            optimizer.zero_grad()
            (torch.nn.functional.mse_loss(net(x), y, reduction="sum") / total).backward()
            if group.size > 1:
                flat = torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]
                summed = torch.from_numpy(group.allreduce(flat.double().numpy())).float()
                for p, part in zip(params, summed.split([p.numel() for p in params]), strict=True):
                    p.grad.copy_(part.view_as(p))  # type: ignore[union-attr]
            optimizer.step()
        return design, net.eval()

    def predict(self, fitted: tuple[_Design, Any], frame: pl.DataFrame) -> np.ndarray:
        import torch

        design, net = fitted
        with torch.no_grad():
            out = net(torch.from_numpy(design.transform(frame)).float())
        return np.asarray(out[:, 0].numpy(), dtype=np.float64)


def _numeric(context: ModelContext) -> list[str]:
    return [c for c in context.features if c not in context.categorical]


_BUILTINS: dict[str, Any] = {
    "seasonal_naive": SeasonalNaive,
    "ridge": Ridge,
    "lightgbm": LightGBM,
    "mlp": MLP,
    **STATISTICAL,
}


def as_values(predicted: Any, rows: int, name: str) -> np.ndarray:
    """A model's output as float64, checked to hold one finite-or-NaN value per row."""
    if isinstance(predicted, pl.Series | pl.DataFrame):
        predicted = predicted.to_numpy()
    values = np.asarray(predicted, dtype=np.float64).reshape(-1)
    if values.shape[0] != rows:
        raise ValueError(f"{name}.predict returned {values.shape[0]} values for {rows} rows")
    return values
