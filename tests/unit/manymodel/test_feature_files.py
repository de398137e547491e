"""The feature table written chunk by chunk, in batches of series: the same rows and floats as
the whole table computed at once (group statistics span batches), read back chunk by chunk."""

from __future__ import annotations

from datetime import datetime

import polars as pl
import pytest

from shardwise.common.job_files import validate_as
from shardwise.manymodel.columns import SERIES
from shardwise.manymodel.config import ManyModelsConfig
from shardwise.manymodel.data.long_table import load_series
from shardwise.manymodel.features.feature_files import write_features
from shardwise.manymodel.features.spec import FeatureSpec, polars_features


@pytest.fixture(scope="module")
def retail():
    config = validate_as(
        ManyModelsConfig,
        {
            "data": {"source": "retail_synthetic", "num_series": 37, "periods": 40},
            "features": {
                "lags": [4, 5],
                "rolling_windows": [4],
                "rolling_stats": ["mean", "std"],
                "expanding_stats": ["mean"],
                "calendar": ["week"],
                "group_by": [["store"], ["item"]],
                "group_stats": ["mean", "std", "max"],
            },
            "backtest": {"horizon": 4, "n_windows": 1, "min_train": 1},
        },
    )
    table = load_series(config)
    return table, FeatureSpec.from_config(config, table.season_length)


def test_batches_of_chunks_give_the_whole_table(retail, tmp_path):
    table, spec = retail
    whole = polars_features(table.frame, spec, table.columns).sort(SERIES, "week")
    # 5 series (220 rows) per chunk, one chunk per batch: stores and items span batches
    files = write_features(table.frame, spec, table.columns, tmp_path, 5, batch_rows=400)
    assert len(files) == 8 and files.series == 37 and files.series_of(7) == range(35, 37)
    assert sum(files.rows) == table.frame.height
    got = pl.concat(files.read(i) for i in range(len(files)))
    assert got.schema == whole.schema
    for name in whole.columns:  # exactly: floats bit for bit
        assert got[name].to_list() == whole[name].to_list(), name
    assert got["store_std"].drop_nulls().len() > 0 and got["item_mean"].drop_nulls().len() > 0
    assert [files.read(i)[SERIES].unique().sort().to_list() for i in (0, 7)] == [
        [0, 1, 2, 3, 4],
        [35, 36],
    ]


def test_only_the_chunks_asked_for_are_written(retail, tmp_path):
    table, spec = retail
    files = write_features(table.frame, spec, table.columns, tmp_path, 10, [1, 3])
    written = sorted(p.name for p in (tmp_path / "chunks").iterdir())
    assert written == ["chunk=1", "chunk=3"]
    expected = polars_features(table.frame, spec, table.columns).filter(
        pl.col(SERIES).is_between(10, 19)
    )
    assert files.read(1).equals(expected.sort(SERIES, "week"))


def test_which_files_spark_reads_itself(tmp_path):
    """Spark's executors read the user's file where its types read alike in Spark and polars;
    otherwise they read the driver's checked copy, and the run says why."""
    from shardwise.manymodel.columns import Columns
    from shardwise.manymodel.features.spark_features import source_file_problem

    columns = Columns(ids=("shop",), timestamp="t", target="y", covariates=("price",))
    good = pl.DataFrame(
        {"shop": [1, 2], "t": [datetime(2024, 1, 1)] * 2, "y": [1, 2], "price": [1.5, None]},
        schema_overrides={"t": pl.Datetime("ns"), "y": pl.Int16, "price": pl.Float32},
    )
    good.write_parquet(tmp_path / "good.parquet")
    assert source_file_problem(str(tmp_path / "good.parquet"), columns) is None
    good.write_csv(tmp_path / "good.csv")
    assert source_file_problem(str(tmp_path / "good.csv"), columns) == "not Parquet"
    assert source_file_problem("s3://bucket/good.parquet", columns) == (
        "a URL, which Spark may not reach as fsspec does"
    )
    cases = {
        "t": (pl.col("t").cast(pl.String), "its column 't' is String, not a date or time"),
        "shop": (pl.col("shop").cast(pl.Float64), "its id column 'shop' is Float64"),
        "price": (pl.col("price").cast(pl.Decimal(10, 2)), "its column 'price' is Decimal"),
    }
    for name, (changed, reason) in cases.items():
        path = tmp_path / f"{name}.parquet"
        good.with_columns(changed).write_parquet(path)
        problem = source_file_problem(str(path), columns)
        assert problem is not None and problem.startswith(reason), (name, problem)
