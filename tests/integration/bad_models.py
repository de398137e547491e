"""User models that misbehave on purpose, run inside Ray workers."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import polars as pl

FAILING = {"CEU0500000001", "CEU0600000001"}


class Misbehaves:
    """Raises for two sectors; kills its worker process on the first series it ever sees
    (once per test, tracked by a marker file) to exercise Ray's task retry."""

    def __init__(self, marker: str) -> None:
        self.marker = Path(marker)

    def fit(self, frame: pl.DataFrame) -> float:
        if not self.marker.exists():
            self.marker.write_text(str(os.getpid()))
            os._exit(1)
        if frame["series_id"][0] in FAILING:
            raise ValueError("no data for this sector")
        return float(frame["y"].drop_nulls().tail(12).mean())

    def predict(self, fitted: float, frame: pl.DataFrame) -> np.ndarray:
        return np.full(frame.height, fitted)


class Sleeps:
    """Takes a while per fit, so overlapping tasks are visible in their timings."""

    def fit(self, frame: pl.DataFrame) -> float:
        time.sleep(0.3)
        return float(frame["y"].drop_nulls().tail(12).mean())

    def predict(self, fitted: float, frame: pl.DataFrame) -> np.ndarray:
        return np.full(frame.height, fitted)


class GlobalFails:
    """A global model (fitted on many series at once) whose every fit raises."""

    def fit(self, frame: pl.DataFrame) -> float:
        assert frame["series_id"].n_unique() > 1, "a global model sees many series"
        raise ValueError("global fit refused")

    def predict(self, fitted: float, frame: pl.DataFrame) -> np.ndarray:
        return np.full(frame.height, fitted)
