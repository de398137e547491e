"""A user model whose module notes each process that imports it (in the file the environment
variable IMPORTS_FILE names), to see where a job's processes import the models' libraries."""

from __future__ import annotations

import os

import numpy as np
import polars as pl

if os.environ.get("IMPORTS_FILE"):
    with open(os.environ["IMPORTS_FILE"], "a") as noted:
        noted.write(f"{os.getpid()}\n")


class LastYearsMean:
    def fit(self, frame: pl.DataFrame) -> float:
        return float(frame["y"].drop_nulls().tail(12).mean())

    def predict(self, fitted: float, frame: pl.DataFrame) -> np.ndarray:
        return np.full(frame.height, fitted)
