"""User models that misbehave on purpose, run inside Ray workers."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import numpy as np
import polars as pl

FAILING = {"CEU0500000001", "CEU0600000001"}


class Misbehaves:
    """Raises for two sectors; kills its worker process on the first series it ever sees, or
    on the series `crash_on` (once per test, tracked by a marker file) to exercise the retry of
    a task."""

    def __init__(self, marker: str, crash_on: str = "") -> None:
        self.marker = Path(marker)
        self.crash_on = crash_on

    def fit(self, frame: pl.DataFrame) -> float:
        here = not self.crash_on or frame["series_id"][0] == self.crash_on
        if here and not self.marker.exists():
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


class Meets:
    """Each worker process's first fit waits until `together` worker processes have begun one
    (each leaves its pid in `room`): the tasks overlap by construction, not by how fast the
    machine happens to be. After `patience` seconds from the first arrival nobody waits, so a
    runner that never runs `together` tasks at once ends (and its test fails) instead of hanging."""

    def __init__(self, room: str, together: int = 3, patience: float = 120.0) -> None:
        self.room, self.together, self.patience = Path(room), together, patience

    def fit(self, frame: pl.DataFrame) -> float:
        self.room.mkdir(exist_ok=True)
        with contextlib.suppress(FileExistsError), (self.room / "opened").open("x") as opened:
            opened.write(str(time.time()))
        (self.room / f"{os.getpid()}.pid").touch()
        deadline = float((self.room / "opened").read_text() or time.time()) + self.patience
        while len(list(self.room.glob("*.pid"))) < self.together and time.time() < deadline:
            time.sleep(0.05)
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
