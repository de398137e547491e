"""Reading the long table: column roles, frequency, future rows, and one-line errors."""

from __future__ import annotations

from datetime import date

import polars as pl
import pytest

from shardwise.config import ConfigError, validate_as
from shardwise.manymodel.config import ManyModelsConfig, check
from shardwise.manymodel.data import FUTURE, SERIES, load_series


def config(source, **sections) -> ManyModelsConfig:
    raw = {
        "data": {
            "source": str(source),
            "id_columns": ["shop"],
            "timestamp": "day",
            "target": "units",
        },
        "backtest": {"horizon": 3, "n_windows": 2, "min_train": 5},
        "features": {"lags": [3, 4]},
    }
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    return validate_as(ManyModelsConfig, raw)


def write_csv(tmp_path, rows) -> str:
    path = tmp_path / "sales.csv"
    pl.DataFrame(rows, orient="row", schema=["shop", "day", "units"]).write_csv(path)
    return str(path)


def daily(shop: str, days: int, start: int = 1) -> list[tuple[str, str, float]]:
    return [(shop, f"2024-01-{d:02d}", float(d)) for d in range(start, start + days)]


def test_reads_a_csv_infers_daily_and_appends_future_rows(tmp_path):
    source = write_csv(tmp_path, daily("a", 20) + daily("b", 25))
    table = load_series(config(source))
    assert table.freq == "1d" and table.season_length == 7
    assert table.num_series == 2
    future = table.frame.filter(pl.col(FUTURE))
    assert future.group_by("shop").len().sort("shop")["len"].to_list() == [3, 3]
    last_a = future.filter(pl.col("shop") == "a")["day"].max()
    assert last_a == date(2024, 1, 23)
    assert future["units"].null_count() == 3 * 2
    assert table.frame[SERIES].unique().sort().to_list() == [0, 1]


def test_short_series_are_skipped_and_listed(tmp_path):
    source = write_csv(tmp_path, daily("a", 30) + daily("tiny", 8))
    table = load_series(config(source))
    assert table.num_series == 1
    assert table.skipped["shop"].to_list() == ["tiny"]
    assert "8 observations" in table.skipped["reason"][0]


def test_leading_and_trailing_empty_targets(tmp_path):
    rows = [("a", "2024-01-01", None), ("a", "2024-01-02", None), *daily("a", 25, start=3)]
    source = write_csv(tmp_path, rows)
    table = load_series(config(source))
    observed = table.frame.filter(~pl.col(FUTURE))
    assert observed.height == 25 and observed["units"].null_count() == 0


@pytest.mark.parametrize(
    ("rows", "change", "message"),
    [
        (daily("a", 20), {"target": "sold"}, "no column 'sold'; its columns are shop, day, units"),
        ([*daily("a", 20), ("a", "2024-01-05", 1.0)], {}, "appear more than once, e.g. shop=a"),
        (daily("a", 5) + daily("a", 20, start=7), {}, "do not follow the previous one by 1d"),
    ],
)
def test_bad_tables_get_one_line(tmp_path, rows, change, message):
    source = write_csv(tmp_path, rows)
    with pytest.raises(ConfigError, match=message) as info:
        load_series(config(source, data=change))
    assert "\n" not in str(info.value)


def test_all_series_too_short_is_an_error(tmp_path):
    source = write_csv(tmp_path, daily("a", 8) + daily("b", 9))
    with pytest.raises(ConfigError, match=r"needs 15 observations .* the longest has 9"):
        load_series(config(source))


def test_missing_file_and_wrong_suffix(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_series(config(tmp_path / "nope.csv"))
    with pytest.raises(ConfigError, match=r"expected a \.csv or \.parquet"):
        load_series(config(tmp_path / "data.xlsx"))


def test_text_target_is_rejected(tmp_path):
    path = tmp_path / "t.csv"
    pl.DataFrame(
        {
            "shop": ["a"] * 3,
            "day": ["2024-01-01", "2024-01-02", "2024-01-03"],
            "units": ["x", "y", "z"],
        }
    ).write_csv(path)
    with pytest.raises(ConfigError, match="column 'units' is String; it must be numeric"):
        load_series(config(path))


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"features": {"lags": [1, 3]}}, "features.lags contains 1 but backtest.horizon is 3"),
        ({"models": {"names": ["prophet"]}}, "unknown model 'prophet'"),
        (
            {"models": {"args": {"lightgmb": {}}}},
            "models.args.lightgmb names no model; did you mean 'lightgbm'",
        ),
    ],
)
def test_config_checks(tmp_path, sections, message):
    with pytest.raises(ConfigError, match=message):
        check(config(tmp_path / "x.csv", **sections))


def test_unknown_key_suggests_the_right_one(tmp_path):
    with pytest.raises(ConfigError, match=r"did you mean 'backtest\.horizon'"):
        validate_as(ManyModelsConfig, {"backtest": {"horizn": 3}})


def test_us_employment_is_148_monthly_series():
    table = load_series(
        validate_as(ManyModelsConfig, {"backtest": {"horizon": 12, "n_windows": 1}})
    )
    assert table.freq == "1mo" and table.season_length == 12
    assert table.num_series + table.skipped.height == 148
    assert table.columns.ids == ("series_id",)


def test_reads_parquet_from_an_fsspec_url():
    import fsspec

    frame = pl.DataFrame(daily("a", 30), orient="row", schema=["shop", "day", "units"])
    frame = frame.with_columns(pl.col("day").str.to_date())
    with fsspec.open("memory://bucket/sales.parquet", "wb") as handle:
        frame.write_parquet(handle)
    table = load_series(config("memory://bucket/sales.parquet"))
    assert table.num_series == 1 and table.freq == "1d"
