"""User models that misbehave on purpose, for the many-models failure tests."""

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
