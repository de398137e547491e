"""The names every many-models table shares, and the job's columns: a leaf, so that reading the
data (data/long_table.py), computing features (features/) and aggregating a hierarchy
(hierarchy/levels.py) all use them without importing one another back."""

from __future__ import annotations

from dataclasses import dataclass

import polars as pl

SERIES = "_series"
"""Integer index of a series (0 … n − 1, in id order), added to every internal table."""
FUTURE = "_future"
"""True on the `horizon` rows after a series' last observation."""
CHUNK_KEY = "chunk"
"""The column that says which chunk of series a row of features belongs to."""


@dataclass(frozen=True)
class Columns:
    ids: tuple[str, ...]
    timestamp: str
    target: str
    covariates: tuple[str, ...]

    @property
    def named(self) -> list[str]:
        """Every column the job names, once each, in this order."""
        return list(dict.fromkeys((*self.ids, self.timestamp, self.target, *self.covariates)))


def run_numbers(ids: list[str]) -> pl.Expr:
    """Series numbers 0, 1, … in row order, for a table sorted by `ids` (runs of equal ids;
    nulls equal nulls)."""
    return pl.struct(ids).rle_id().cast(pl.Int64)
