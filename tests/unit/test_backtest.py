"""Backtest windows, metrics, selection and failure isolation for a chunk, run in-process."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest

from shardwise.config import ConfigError, validate_as
from shardwise.manymodel.backtest import _metrics, run_chunk
from shardwise.manymodel.config import ManyModelsConfig
from shardwise.manymodel.data import SeriesTable, load_series
from shardwise.manymodel.features import FeatureSpec, polars_features
from shardwise.manymodel.runner import make_plan


def test_metrics_by_hand():
    actual = np.array([10.0, 0.0, 5.0])
    predicted = np.array([8.0, 0.0, 10.0])
    got = _metrics(actual, predicted, naive_mae=2.0)
    assert got["mae"] == pytest.approx(7 / 3)
    assert got["rmse"] == pytest.approx(math.sqrt((4 + 0 + 25) / 3))
    # sMAPE: 200/h · Σ|e|/(|a|+|p|), a 0/0 term counts 0
    assert got["smape"] == pytest.approx(200 / 3 * (2 / 18 + 0 + 5 / 15))
    assert got["mase"] == pytest.approx((7 / 3) / 2.0)


def tiny_job(tmp_path, models, **extra) -> tuple[ManyModelsConfig, SeriesTable]:
    t = np.arange(60)
    rows = []
    for shop, phase in (("a", 0.0), ("b", 1.0), ("c", 2.0)):
        y = 100 + 0.5 * t + 10 * np.sin(2 * np.pi * t / 12 + phase)
        rows += [
            (shop, f"{2015 + k // 12}-{k % 12 + 1:02d}-01", float(v))
            for k, v in zip(t, y, strict=True)
        ]
    path = tmp_path / "m.csv"
    pl.DataFrame(rows, orient="row", schema=["shop", "month", "units"]).write_csv(path)
    raw = {
        "data": {
            "source": str(path),
            "id_columns": ["shop"],
            "timestamp": "month",
            "target": "units",
        },
        "models": {"names": models},
        "backtest": {"horizon": 6, "n_windows": 2},
        **extra,
    }
    config = validate_as(ManyModelsConfig, raw)
    return config, load_series(config)


def run_in_process(config, table):
    spec = FeatureSpec.from_config(config, table.season_length)
    features = polars_features(table.frame, spec, table.columns)
    return run_chunk(features.to_arrow(), make_plan(config, table, spec))


def test_ridge_beats_seasonal_naive_on_trend_plus_season(tmp_path):
    config, table = tiny_job(tmp_path, ["seasonal_naive", "ridge"])
    result = run_in_process(config, table)
    tables = result.tables()
    assert result.series == 3 and result.failed_series == 0
    assert tables["metrics"].height == 3 * 2 * 2  # series × models × windows
    assert set(tables["choices"]["model"]) == {"ridge"}
    assert tables["forecasts"].height == 3 * 6
    mase = tables["metrics"].group_by("model").agg(pl.col("mase").mean()).sort("model")
    naive, ridge = mase["mase"].to_list()[::-1]
    assert ridge < naive


def test_a_failing_model_is_recorded_and_the_series_still_forecast(tmp_path):
    config, table = tiny_job(tmp_path, ["seasonal_naive", "misbehaving_models:FailsOnShopB"])
    result = run_in_process(config, table)
    tables = result.tables()
    failures = tables["failures"]
    assert failures.height == 1
    assert failures["model"][0] == "FailsOnShopB" and failures["stage"][0] == "window 0"
    assert "RuntimeError: cannot fit shop b" in failures["error"][0]
    assert result.failed_series == 0 and tables["choices"].height == 3


def test_memory_cap_stops_one_series_not_the_chunk(tmp_path):
    config, table = tiny_job(
        tmp_path,
        ["misbehaving_models:HogsMemoryOnShopA"],
        runner={"memory_mb": 512},
    )
    result = run_in_process(config, table)
    failures = result.tables()["failures"]
    assert failures["error"].str.starts_with("MemoryError").all()
    assert failures.height == 1 and result.failed_series == 1
    assert result.tables()["choices"].height == 2


def test_a_user_model_named_with_a_dot_is_told_the_colon_form(tmp_path):
    """`module.Class` (issue 19) is not a module: the error suggests `module:Class`."""
    config, table = tiny_job(tmp_path, ["misbehaving_models.FailsOnShopB"])
    with pytest.raises(ConfigError, match="did you mean 'misbehaving_models:FailsOnShopB'"):
        run_in_process(config, table)
