"""The Spark backend computes the same feature table as the polars backend, from one spec."""

from __future__ import annotations

import math

import polars as pl
import pytest

from shardwise.config import validate_as
from shardwise.manymodel.config import ManyModelsConfig
from shardwise.manymodel.data import load_series
from shardwise.manymodel.features import FeatureSpec, polars_features
from shardwise.manymodel.spark import spark_features

pytestmark = pytest.mark.slow


def assert_same(a: pl.DataFrame, b: pl.DataFrame, rel: float = 1e-9) -> None:
    assert a.columns == b.columns
    assert a.schema == b.schema
    assert a.height == b.height
    for name in a.columns:
        left, right = a[name].to_list(), b[name].to_list()
        if a.schema[name] == pl.Float64:
            for x, y in zip(left, right, strict=True):
                assert (x is None) == (y is None), name
                if x is not None:
                    assert math.isclose(x, y, rel_tol=rel, abs_tol=1e-9), (name, x, y)
        else:
            assert left == right, name


def test_retail_features_match(spark):
    config = validate_as(
        ManyModelsConfig,
        {
            "data": {"source": "retail_synthetic", "num_series": 120, "periods": 60},
            "features": {
                "lags": [4, 5, 52],
                "rolling_windows": [4, 13],
                "rolling_stats": ["mean", "std", "min", "max"],
                "expanding_stats": ["mean", "std", "min", "max"],
                "calendar": [
                    "year",
                    "quarter",
                    "month",
                    "week",
                    "day_of_week",
                    "day_of_month",
                    "day_of_year",
                ],
                "group_by": [["store"], ["item"]],
                "group_stats": ["mean", "std", "max"],
            },
            "backtest": {"horizon": 4, "n_windows": 1, "min_train": 1},
        },
    )
    table = load_series(config)
    spec = FeatureSpec.from_config(config, table.season_length)
    expected = polars_features(table.frame, spec, table.columns)
    got = spark_features(table.frame, spec, table.columns, master="local[2]")
    assert_same(expected, got)
    assert expected["roll13_std"].drop_nulls().len() > 0  # the comparison covered real values


def test_employment_features_match(spark):
    config = validate_as(
        ManyModelsConfig,
        {
            "data": {"num_series": 10},
            "features": {
                "lags": [12, 24],
                "rolling_windows": [3, 12],
                "rolling_stats": ["mean", "std"],
                "expanding_stats": ["mean", "std"],
                "calendar": ["month"],
            },
        },
    )
    table = load_series(config)
    spec = FeatureSpec.from_config(config, table.season_length)
    assert_same(
        polars_features(table.frame, spec, table.columns),
        spark_features(table.frame, spec, table.columns, master="local[2]"),
        rel=1e-7,  # employment levels are ~1e5: one-pass vs Spark's streaming std differ at 1e-9
    )
