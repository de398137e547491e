"""The Spark backend computes the same feature table as the polars backend, from one spec: the
same floats, bit for bit (both spell means and standard deviations out as sums in one order), so
every model's results are the same too (issue 19 point 6)."""

from __future__ import annotations

import polars as pl
import pytest

from shardwise.common.errors import ConfigError
from shardwise.common.job_files import validate_as
from shardwise.manymodel.config import ManyModelsConfig
from shardwise.manymodel.data.long_table import load_series
from shardwise.manymodel.features.feature_files import write_features
from shardwise.manymodel.features.spec import FeatureSpec, polars_features
from shardwise.manymodel.run.chunk import run_chunk
from shardwise.manymodel.run.runner import make_plan

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


@pytest.mark.parametrize(
    ("unit", "own_file"),
    [("ns", False), ("ns", True), ("us", True)],
    ids=["driver-copy-nanoseconds", "own-file-nanoseconds", "own-file-microseconds"],
)
def test_naive_times_and_only_the_chunks_asked_for(spark, tmp_path, unit, own_file):
    """Spark's Parquet reader refuses nanosecond timestamps (a table from pandas has them), in
    the driver's copy and in the user's own file; a resumed run asks for some chunks only, and
    without group statistics Spark reads only their series."""
    table, spec = hourly(tmp_path, pl.Datetime(unit))
    source = str(tmp_path / "hourly.parquet") if own_file else None
    files = write_features(
        table.frame, spec, table.columns, tmp_path / "f", 2, [1],
        backend="spark", spark_master="local[2]", source=source,
    )  # fmt: skip
    assert ("itself" in files.made_by) == own_file
    assert [p.name for p in (tmp_path / "f" / "chunks").glob("chunk=*")] == ["chunk=1"]
    expected = polars_features(table.frame, spec, table.columns)
    assert_same(files.read(1), expected.filter(pl.col("_series").is_in([2, 3])))


@pytest.mark.parametrize("unit", ["us", "ns"], ids=["driver-copy", "own-file-nanoseconds"])
def test_calendar_parts_in_the_timestamps_zone(spark, tmp_path, unit):
    """polars takes the hour and the day of a zoned timestamp in its zone: so does Spark (its
    session's zone is set to it while it computes), not in UTC; from the driver's copy, and from
    the user's own file with zoned nanoseconds."""
    table, spec = hourly(tmp_path, pl.Datetime(unit, "Asia/Tokyo"))
    source = str(tmp_path / "hourly.parquet") if unit == "ns" else None
    files = write_features(
        table.frame, spec, table.columns, tmp_path / "f", 2,
        backend="spark", spark_master="local[2]", source=source,
    )  # fmt: skip
    assert ("itself" in files.made_by) == (source is not None)
    got = pl.concat(files.read(i) for i in range(len(files)))
    expected = polars_features(table.frame, spec, table.columns)
    assert expected["cal_hour"][0] == 9  # midnight UTC is 9 o'clock in Tokyo
    assert_same(got, expected)
    assert spark.conf.get("spark.sql.session.timeZone") == "UTC"  # put back


def awkward_file(path, *, drop_series: str | None = None) -> None:
    """Seven weekly store × item series as a user's file may hold them: rows shuffled, an unused
    column, integer item ids, float32 sales with NaN and empty weeks before the first sale,
    nanosecond times (pandas'), and future weeks with their promotions; one series too short."""
    weeks = pl.datetime_range(
        pl.datetime(2023, 1, 2), pl.datetime(2024, 6, 24), "1w", eager=True
    ).cast(pl.Datetime("ns"))
    rows = []
    for k, (store, item) in enumerate([(s, i) for s in ("n", "s") for i in (3, 17, 250)]):
        for t, week in enumerate(weeks):
            sales = None if t < k else float((t * (k + 1)) % 23)
            if t == 40 + k:
                sales = float("nan")
            if t >= len(weeks) - 4:
                sales = None  # the future: promotions planned, sales to come
            rows.append((store, item, week, sales, (t + k) % 3 == 0, f"row {t}"))
    for t, week in enumerate(weeks[-12:]):  # too short for the backtest
        rows.append(("n", 1, week, float(t), False, ""))
    frame = pl.DataFrame(
        rows, schema=["store", "item", "week", "sales", "promo", "note"], orient="row"
    ).with_columns(
        pl.col("item").cast(pl.Int32), pl.col("sales").cast(pl.Float32),
        pl.col("promo").cast(pl.Int8),
    )  # fmt: skip
    if drop_series:
        frame = frame.filter(pl.format("{}-{}", "store", "item") != drop_series)
    frame.sample(fraction=1.0, shuffle=True, seed=3).write_parquet(path)


def awkward_config(path) -> ManyModelsConfig:
    return validate_as(
        ManyModelsConfig,
        {
            "data": {
                "source": str(path), "id_columns": ["store", "item"], "timestamp": "week",
                "target": "sales", "covariates": ["promo"], "num_series": 6,
            },
            "features": {
                "lags": [1, 4],
                "rolling_windows": [4],
                "rolling_stats": ["mean", "std"],
                "expanding_stats": ["mean", "max"],
                "calendar": ["month", "week"],
                "group_by": [["store"]],
                "group_stats": ["mean"],
            },
            "backtest": {"horizon": 4, "n_windows": 2, "min_train": 1},
        },
    )  # fmt: skip


def test_spark_reads_the_users_file_itself(spark, tmp_path):
    """Issue 19: on a cluster Spark reads the source, not a table from the driver. From the
    user's Parquet file, typed and cut as the driver's checks cut it (the series kept, from their
    first observation, NaN as missing, the future rows after them), Spark computes the features
    polars computes from the checked table, bit for bit; the driver writes no copy of the rows."""
    source = tmp_path / "sales.parquet"
    awkward_file(source)
    config = awkward_config(source)
    table = load_series(config)
    assert table.num_series == 5 and table.skipped.height == 1  # num_series = 6, one too short
    spec = FeatureSpec.from_config(config, table.season_length)
    files = write_features(
        table.frame, spec, table.columns, tmp_path / "f", 2,
        backend="spark", spark_master="local[2]", source=str(source),
    )  # fmt: skip
    assert files.made_by == f"spark, read {source} itself"
    assert not (tmp_path / "f" / "input.parquet").exists()
    got = pl.concat(files.read(i) for i in range(len(files)))
    expected = polars_features(table.frame, spec, table.columns)
    assert_same(got, expected)
    assert expected["sales"].null_count() > 4 * 5 and expected["promo"].null_count() == 0


def test_a_source_changed_under_the_run_is_an_error(spark, tmp_path):
    """The executors read the file after the driver checked it: rows gone in between are
    reported (which chunk, how many rows), not features missing for a series."""
    source = tmp_path / "sales.parquet"
    awkward_file(source)
    config = awkward_config(source)
    table = load_series(config)
    spec = FeatureSpec.from_config(config, table.season_length)
    awkward_file(source, drop_series="n-17")
    with pytest.raises(ConfigError, match=r"chunk 0 has \d+ rows where the checked table has \d+"):
        write_features(
            table.frame, spec, table.columns, tmp_path / "f", 2,
            backend="spark", spark_master="local[2]", source=str(source),
        )  # fmt: skip
