"""A user model for intermittent demand (Croston's method): `models.names = ["examples.croston"]`.

A many-models user model is any importable module (or `module:object`) with two functions:
- `fit(frame) -> fitted`: `frame` holds one series' training rows as a polars DataFrame: id
  columns, timestamp, the target as `y` (scaled when `features.scale` says so), covariates and
  features. Return anything picklable.
- `predict(fitted, frame) -> values`: one forecast per row of `frame` (the rows to forecast,
  without the target), as a list, numpy array or polars Series.
Raise if the series cannot be fitted: that series × model is recorded as failed, the rest go on.
"""

from __future__ import annotations

import numpy as np
import polars as pl

ALPHA = 0.1


def fit(frame: pl.DataFrame) -> float:
    y = frame["y"].drop_nulls().to_numpy()
    demand, interval, since = None, None, 1
    for value in y:
        if value != 0:
            demand = value if demand is None else demand + ALPHA * (value - demand)
            interval = since if interval is None else interval + ALPHA * (since - interval)
            since = 1
        else:
            since += 1
    if demand is None or interval is None:
        return 0.0
    return float(demand / interval)


def predict(fitted: float, frame: pl.DataFrame) -> np.ndarray:
    return np.full(frame.height, fitted)
