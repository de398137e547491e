"""The run's output tables, assembled from the chunks' files a few chunks at a time."""

from __future__ import annotations

from datetime import date

import numpy as np
import polars as pl
import pytest

from shardwise.common.job_files import validate_as
from shardwise.manymodel.columns import FUTURE, SERIES
from shardwise.manymodel.config import ManyModelsConfig
from shardwise.manymodel.data.long_table import load_series
from shardwise.manymodel.features.spec import FeatureSpec, polars_features
from shardwise.manymodel.run import outputs
from shardwise.manymodel.run.chunk import run_chunk
from shardwise.manymodel.run.chunk_store import write_chunk
from shardwise.manymodel.run.outputs import _Appended, assemble
from shardwise.manymodel.run.runner import make_plan

SHOPS = ("a", "b", "c", "d", "e", "f", "g")
FORECAST_TABLES = ("forecasts_by_model", "forecasts", "backtest_forecasts")


def job(tmp_path, name: str) -> ManyModelsConfig:
    t = np.arange(60)
    rows = []
    for k, shop in enumerate(SHOPS):
        y = 100 + (k + 1) * 0.5 * t + 10 * np.sin(2 * np.pi * t / 12 + k)
        months = [f"{2015 + m // 12}-{m % 12 + 1:02d}-01" for m in t]
        rows += [(shop, month, float(v)) for month, v in zip(months, y, strict=True)]
    path = tmp_path / "m.csv"
    pl.DataFrame(rows, orient="row", schema=["shop", "month", "units"]).write_csv(path)
    raw = {
        "job": {"run_dir": str(tmp_path / name)},
        "data": {"source": str(path), "id_columns": ["shop"], "timestamp": "month"},
        "models": {"names": ["seasonal_naive", "ridge", "misbehaving_models:FailsOnShopB"]},
        "backtest": {"horizon": 6, "n_windows": 3, "levels": [80], "ensemble_top_k": 2},
        "tracking": {"mlflow": False},
    }
    raw["data"]["target"] = "units"
    return validate_as(ManyModelsConfig, raw)


def assembled(tmp_path, name: str, chunk_size: int) -> dict[str, pl.DataFrame]:
    """Every chunk of `chunk_size` series run in this process and written as the runner writes
    it, then the outputs assembled; the tables read back from their files."""
    config = job(tmp_path, name)
    table = load_series(config)
    spec = FeatureSpec.from_config(config, table.season_length)
    plan = make_plan(config, table, spec)
    features = polars_features(table.frame, spec, table.columns)
    chunks = config.run_dir / "chunks"
    chunks.mkdir(parents=True)
    n_chunks = -(-table.num_series // chunk_size)
    for i in range(n_chunks):
        rows = features.filter(pl.col(SERIES) // chunk_size == i)
        write_chunk(chunks, i, run_chunk(rows.to_arrow(), plan))
    assemble(config, table, n_chunks, chunk_size)
    return {name: pl.read_parquet(config.run_dir / f"{name}.parquet") for name in FORECAST_TABLES}


@pytest.mark.parametrize("part_series", [3, 6])
def test_the_forecast_tables_do_not_depend_on_the_chunks_and_carry_the_tables_values(
    tmp_path, monkeypatch, part_series
):
    """Written a part at a time (one chunk of 3 series, or two; the last one short), the forecast
    tables equal those of one chunk of every series, row for row; each step has the timestamp
    after the series' last observation, and each window's step its actual value."""
    whole = assembled(tmp_path, "one", chunk_size=len(SHOPS))
    monkeypatch.setattr(outputs, "_PART_SERIES", part_series)
    parts = assembled(tmp_path, "three", chunk_size=3)
    for name in FORECAST_TABLES:
        assert parts[name].equals(whole[name]), name
    by_model = parts["forecasts_by_model"]
    assert by_model["shop"].is_sorted()
    future = [date(2020, month, 1) for month in range(1, 7)]  # after 2019-12, the last month
    assert by_model.group_by("shop", "model").agg("month")["month"].to_list() == [future] * (
        by_model.select("shop", "model").n_unique()
    )
    assert set(by_model.filter(pl.col("shop") == "b")["model"]) == {
        "seasonal_naive", "ridge", "ensemble"
    }  # fmt: skip
    assert parts["forecasts"].height == len(SHOPS) * 6
    table = load_series(job(tmp_path, "check"))
    actual = table.frame.filter(~pl.col(FUTURE)).select("shop", "month", pl.col("units"))
    windows = parts["backtest_forecasts"]
    looked_up = windows.join(actual, on=["shop", "month"], how="left", suffix="_table")
    np.testing.assert_array_equal(looked_up["units"], looked_up["units_table"])
    assert windows["units"].null_count() == 0
    assert windows.group_by("shop", "model", "window").len()["len"].unique().to_list() == [6]


def test_an_error_while_writing_leaves_the_earlier_files_as_they_were(tmp_path):
    """A part fails: no output file is replaced or half written, and nothing partial stays."""
    before = pl.DataFrame({"a": [1, 2]})
    path = tmp_path / "forecasts.parquet"
    before.write_parquet(path)

    def fails_at_the_second_chunk() -> None:
        with _Appended({"forecasts": path, "other": tmp_path / "other.parquet"}) as out:
            out.write("forecasts", pl.DataFrame({"a": [3]}))
            out.write("other", pl.DataFrame({"b": ["x"]}))
            raise RuntimeError("chunk 2 could not be read")

    with pytest.raises(RuntimeError, match="chunk 2"):
        fails_at_the_second_chunk()
    assert pl.read_parquet(path).equals(before)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["forecasts.parquet"]
    with _Appended({"forecasts": path}) as out:
        out.write("forecasts", pl.DataFrame({"a": [3]}))
        out.write("forecasts", pl.DataFrame({"a": [4, 5]}))
    assert pl.read_parquet(path)["a"].to_list() == [3, 4, 5]
