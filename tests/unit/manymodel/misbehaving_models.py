"""User models for the many-models tests, most of them misbehaving on purpose."""

from __future__ import annotations

import numpy as np
import polars as pl


class _Mean:
    def fit(self, frame: pl.DataFrame) -> float:
        return float(frame["y"].mean())

    def predict(self, fitted: float, frame: pl.DataFrame) -> np.ndarray:
        return np.full(frame.height, fitted)


class FailsOnShopB(_Mean):
    def fit(self, frame: pl.DataFrame) -> float:
        if frame["shop"][0] == "b":
            raise RuntimeError("cannot fit shop b")
        return super().fit(frame)


class HogsMemoryOnShopA(_Mean):
    def fit(self, frame: pl.DataFrame) -> float:
        if frame["shop"][0] == "a":
            hog = np.ones(2**31, dtype=np.uint8)  # 2 GiB, above the 512 MiB cap
            return float(hog[0])
        return super().fit(frame)


class RightUntilJuly2019:
    """Knows tiny_job's series exactly, and is 50 off from July 2019 (the last window of a
    three-window backtest with horizon 6): perfect on the windows a choice is made on."""

    def fit(self, frame: pl.DataFrame) -> str:
        return str(frame["shop"][0])

    def predict(self, shop: str, frame: pl.DataFrame) -> np.ndarray:
        month = frame["month"]
        t = ((month.dt.year() - 2015) * 12 + month.dt.month() - 1).to_numpy().astype(float)
        phase = {"a": 0.0, "b": 1.0, "c": 2.0}[shop]
        truth = 100 + 0.5 * t + 10 * np.sin(2 * np.pi * t / 12 + phase)
        return truth + np.where(t >= 54, 50.0, 0.0)


class SaysHowItWasFitted:
    """Forecasts how its fit came about: 1 when fitted anew, the last fit's + 10 when
    re-estimated in the form of an earlier fit (`backtest.reselect = false`)."""

    def fit(self, frame: pl.DataFrame) -> float:
        return 1.0

    def reestimate(self, fitted: float, frame: pl.DataFrame) -> float:
        return fitted + 10.0

    def predict(self, fitted: float, frame: pl.DataFrame) -> np.ndarray:
        return np.full(frame.height, fitted)
