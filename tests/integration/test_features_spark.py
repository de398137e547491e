"""The Spark backend computes the same feature table as the polars backend, from one spec: the
same floats, bit for bit (both spell means and standard deviations out as sums in one order), so
every model's results are the same too (issue 19 point 6)."""

from __future__ import annotations

import polars as pl
import pytest

from shardwise.config import validate_as
from shardwise.manymodel.backtest import run_chunk
from shardwise.manymodel.config import ManyModelsConfig
from shardwise.manymodel.data import load_series
from shardwise.manymodel.feature_files import write_features
from shardwise.manymodel.features import FeatureSpec, polars_features
from shardwise.manymodel.runner import make_plan

pytestmark = pytest.mark.slow


def spark_features(table, spec, root, size=7) -> pl.DataFrame:
    """Spark's features as the runner gets them: written by its executors, chunk by chunk,
    and read back."""
    files = write_features(
        table.frame, spec, table.columns, root, size, backend="spark", spark_master="local[2]"
    )
    assert (root / "chunks" / "chunk=0").is_dir()
    return pl.concat(files.read(i) for i in range(len(files)))


def assert_same(a: pl.DataFrame, b: pl.DataFrame) -> None:
    assert a.columns == b.columns
    assert a.schema == b.schema
    assert a.height == b.height
    for name in a.columns:
        assert a[name].to_list() == b[name].to_list(), name  # exactly: floats bit for bit


def test_retail_features_match(spark, tmp_path):
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
    expected = polars_features(table.frame, spec, table.columns).sort("_series", "week")
    got = spark_features(table, spec, tmp_path)
    assert_same(expected, got)
    assert expected["roll13_std"].drop_nulls().len() > 0  # the comparison covered real values


def test_employment_features_match(spark, tmp_path):
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
            "models": {"names": ["ridge", "lightgbm"], "args": {"lightgbm": {"n_estimators": 30}}},
            "backtest": {"n_windows": 2},
        },
    )
    table = load_series(config)
    spec = FeatureSpec.from_config(config, table.season_length)
    polars_table = polars_features(table.frame, spec, table.columns)
    spark_table = spark_features(table, spec, tmp_path, size=3)
    assert_same(polars_table, spark_table)
    # and so the models' results: LightGBM's metrics and forecasts differed before (issue 19)
    plan = make_plan(config, table, spec)
    on_polars = run_chunk(polars_table, plan).tables()
    on_spark = run_chunk(spark_table, plan).tables()
    for name in ("metrics", "forecasts", "choices"):
        assert on_polars[name].equals(on_spark[name]), name


def hourly(tmp_path, dtype: pl.DataType):
    """Five shops' hourly series with timestamps of `dtype`, read as the runner reads them."""
    hours = pl.datetime_range(
        pl.datetime(2024, 1, 1), pl.datetime(2024, 1, 9, 7), "1h", eager=True
    ).cast(pl.Datetime("ns"))
    if isinstance(dtype, pl.Datetime) and dtype.time_zone:
        hours = hours.dt.replace_time_zone("UTC")
    shops = ["a", "b", "c", "d", "e"]
    frame = pl.DataFrame(
        {
            "shop": [s for s in shops for _ in hours],
            "t": pl.concat([hours] * len(shops)).cast(dtype),
            "y": [float((h % 24) * (i + 1)) for i in range(len(shops)) for h in range(len(hours))],
        }
    )
    source = tmp_path / "hourly.parquet"
    frame.write_parquet(source)
    config = validate_as(
        ManyModelsConfig,
        {
            "data": {
                "source": str(source),
                "id_columns": ["shop"],
                "timestamp": "t",
                "target": "y",
            },
            "features": {
                "lags": [24, 25],
                "rolling_windows": [3],
                "calendar": ["hour", "day_of_week", "day_of_month"],
            },
            "backtest": {"horizon": 24, "n_windows": 1},
        },
    )
    table = load_series(config)
    assert table.frame.schema["t"] == dtype
    return table, FeatureSpec.from_config(config, table.season_length)


def test_nanosecond_times_and_only_the_chunks_asked_for(spark, tmp_path):
    """Spark's Parquet reader refuses nanosecond timestamps (a table from pandas has them); a
    resumed run asks for some chunks only, and without group statistics Spark reads only
    their series."""
    table, spec = hourly(tmp_path, pl.Datetime("ns"))
    files = write_features(
        table.frame, spec, table.columns, tmp_path / "f", 2, [1],
        backend="spark", spark_master="local[2]",
    )  # fmt: skip
    assert [p.name for p in (tmp_path / "f" / "chunks").glob("chunk=*")] == ["chunk=1"]
    expected = polars_features(table.frame, spec, table.columns)
    assert_same(files.read(1), expected.filter(pl.col("_series").is_in([2, 3])))


def test_calendar_parts_in_the_timestamps_zone(spark, tmp_path):
    """polars takes the hour and the day of a zoned timestamp in its zone: so does Spark (its
    session's zone is set to it while it computes), not in UTC."""
    table, spec = hourly(tmp_path, pl.Datetime("us", "Asia/Tokyo"))
    files = write_features(
        table.frame, spec, table.columns, tmp_path / "f", 2,
        backend="spark", spark_master="local[2]",
    )  # fmt: skip
    got = pl.concat(files.read(i) for i in range(len(files)))
    expected = polars_features(table.frame, spec, table.columns)
    assert expected["cal_hour"][0] == 9  # midnight UTC is 9 o'clock in Tokyo
    assert_same(got, expected)
    assert spark.conf.get("spark.sql.session.timeZone") == "UTC"  # put back
