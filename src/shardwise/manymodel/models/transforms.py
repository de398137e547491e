"""Target transforms a model is fitted under, fitted per series on each training window only, and
undone on its forecasts: per-series scaling (`models.scale`) and differencing
(`models.difference`).

Differencing subtracts the anchor, the target's smallest lag (lag `horizon` by default), from the
target and from every feature that moves with the target's level (lags, rolling and expanding
means, minima, maxima). A model then predicts the change since a value known at the forecast
origin, and adds it back: trees, which cannot predict outside the range of their training targets,
follow a trend.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import polars as pl

TARGET = "y"
"""The target's column name in the frames models see, whatever it is called in the data."""


@dataclass(frozen=True)
class TargetTransform:
    scale: str
    """none, mean (divide by the mean absolute value) or standard."""
    anchor: str = ""
    """The lag column subtracted when differencing; "" for no differencing."""
    level: tuple[str, ...] = ()
    """Feature columns that move with the target's level: scaled, shifted and differenced."""
    spread: tuple[str, ...] = ()
    """Feature columns that measure the target's spread: scaled only."""

    @property
    def identity(self) -> bool:
        return self.scale == "none" and not self.anchor

    def apply(
        self, train: pl.DataFrame, rows: pl.DataFrame
    ) -> tuple[pl.DataFrame, pl.DataFrame, Callable[[np.ndarray], np.ndarray]]:
        """`train` and `rows` (one series) in the model's units, and the function that turns the
        model's predictions of `rows` back into the target's units."""
        if self.identity:
            return train, rows, lambda values: values
        loc, scale = scaling(train[TARGET].to_numpy().astype(np.float64), self.scale)
        train, rows = self._to_model(train, loc, scale), self._to_model(rows, loc, scale)
        anchor = (
            rows[self.anchor].to_numpy().astype(np.float64)
            if self.anchor
            else np.zeros(rows.height)
        )
        return train, rows, lambda values: (values + anchor) * scale + loc

    def _to_model(self, frame: pl.DataFrame, loc: float, scale: float) -> pl.DataFrame:
        # column by column, not through polars' query engine: a window of one series is a few
        # rows, and this runs for every window of every model of every series
        columns = {column.name: column for column in frame.get_columns()}
        level = [c for c in (TARGET, *self.level) if c in columns]
        changed = {c: (columns[c] - loc) / scale for c in level}
        changed |= {c: columns[c] / scale for c in self.spread if c in columns}
        if self.anchor:  # the anchor itself stays: its level says where in its range a series is
            anchor = changed.get(self.anchor, columns[self.anchor])
            changed |= {c: changed[c] - anchor for c in level if c != self.anchor}
        return pl.DataFrame([changed.get(name, column) for name, column in columns.items()])


def scaling(y: np.ndarray, how: str) -> tuple[float, float]:
    """The location and scale of a series' target for scaling `how`."""
    y = y[~np.isnan(y)]
    if how == "none" or y.size == 0:
        return 0.0, 1.0
    if how == "mean":
        scale = float(np.mean(np.abs(y)))
        return 0.0, scale or 1.0
    return float(np.mean(y)), float(np.std(y)) or 1.0
