"""What a built-in model knows of the job besides its rows: a leaf, so that the model registry
(per_series.py) and the statistical models (statistical.py) share it without importing each
other."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelContext:
    target: str
    features: tuple[str, ...]
    """Numeric model inputs: covariates and computed features."""
    categorical: tuple[str, ...]
    """Features that are codes, not quantities (calendar parts): one-hot for linear models."""
    season_length: int
    seed: int
    freq: str = ""
    """The data's spacing (`1mo`, `1d`, …): MSTL's default seasonalities follow it."""
