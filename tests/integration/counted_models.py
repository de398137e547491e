"""A user model whose module notes each process that imports it (in the file the environment
variable IMPORTS_FILE names), to see where a job's processes import the models' libraries; and
whose fits note how many objects their process has frozen out of garbage collection (in
IMPORTS_FILE + ".frozen")."""

from __future__ import annotations

import gc
import os

import numpy as np
import polars as pl

if os.environ.get("IMPORTS_FILE"):
    with open(os.environ["IMPORTS_FILE"], "a") as noted:
        noted.write(f"{os.getpid()}\n")


class LastYearsMean:
    def fit(self, frame: pl.DataFrame) -> float:
        if os.environ.get("IMPORTS_FILE"):
            with open(os.environ["IMPORTS_FILE"] + ".frozen", "a") as noted:
                noted.write(f"{os.getpid()} {gc.get_freeze_count()}\n")
        return float(frame["y"].drop_nulls().tail(12).mean())

    def predict(self, fitted: float, frame: pl.DataFrame) -> np.ndarray:
        return np.full(frame.height, fitted)
