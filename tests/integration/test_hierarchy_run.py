"""A hierarchical many-models run on a real local Ray instance: every level is backtested and
forecast, and the reconciled forecasts add up."""

from __future__ import annotations

import json

import polars as pl
import pyarrow.parquet as pq
import pytest

from helpers import HIERARCHY_LEVELS as LEVELS
from helpers import hierarchical_job
from shardwise.manymodel.data.long_table import load_series
from shardwise.manymodel.evaluation.intervals import METADATA_KEY
from shardwise.manymodel.hierarchy.levels import incoherence
from shardwise.manymodel.run.runner import run

pytestmark = pytest.mark.slow


def test_a_hierarchical_run_forecasts_every_level_and_reconciles(ray_cluster, tmp_path):
    config = hierarchical_job(tmp_path, tracking={"mlflow": True}, backtest={"levels": [80, 95]})
    summary = run(config)
    assert summary.series == 13 and summary.failed == 0
    run_dir = tmp_path / "run"
    metrics = pl.read_parquet(run_dir / "backtest_metrics.parquet")
    assert metrics.filter(pl.col("state").is_null())["mase"].is_finite().all()  # the total
    reconciled = pl.read_parquet(run_dir / "forecasts_reconciled.parquet")
    assert reconciled.height == 13 * 6
    assert reconciled["unique_id"].n_unique() == 13
    assert "total/CA/north" in reconciled["unique_id"].to_list()
    columns = load_series(config).columns
    for method in config.hierarchy.methods:
        assert incoherence(reconciled, method, columns, LEVELS) < 1e-9
    chosen = pl.read_parquet(run_dir / "forecasts.parquet").sort("state", "region", "shop", "month")
    assert reconciled.sort("state", "region", "shop", "month")["base"].equals(
        chosen["forecast"], null_equal=True
    )
    # the windows' forecasts, with their timestamps and actual values, as the metrics scored them
    backtest = pl.read_parquet(run_dir / "backtest_forecasts.parquet")
    assert backtest.height == 13 * 2 * 2 * 6  # series × models × windows × steps
    last = pl.date(2019, 12, 1)
    assert backtest["month"].min() == pl.select(last.dt.offset_by("-11mo")).item()
    mae = (
        backtest.group_by("state", "region", "shop", "model", "window")
        .agg((pl.col("forecast") - pl.col("units")).abs().mean().alias("mine"))
        .join(metrics, on=["state", "region", "shop", "model", "window"], nulls_equal=True)
    )
    assert mae.height == backtest.height // 6
    assert (mae["mine"] - mae["mae"]).abs().max() < 1e-9
    # every method scored on the backtest: window 1, after the one mint_shrink's errors come from
    scores = pl.read_parquet(run_dir / "reconciled_metrics.parquet")
    assert scores["window"].unique().to_list() == [1]
    assert set(scores["method"]) == {"base", *config.hierarchy.methods}
    assert scores.filter(pl.col("method") == "base").height == 13
    levels = dict(scores.group_by("level").len().iter_rows())
    assert levels == {"total": 6, "state": 12, "state/region": 24, "state/region/shop": 36}
    # the base forecasts are the chosen ones: their MASE is the backtest's of the model used
    keys = ["state", "region", "shop"]
    used = chosen.select(*keys, "model").unique()
    base = scores.filter(pl.col("method") == "base").join(used, on=keys, nulls_equal=True)
    backtest_mase = metrics.filter(pl.col("window") == 1).select(*keys, "model", "mase")
    both = base.join(backtest_mase, on=[*keys, "model"], nulls_equal=True)
    assert both.height == 13
    assert (both["mase"] - both["mase_right"]).abs().max() < 1e-9
    bottom = scores.filter(pl.col("level") == "state/region/shop")
    assert (
        bottom.filter(pl.col("method") == "bottom_up")["mae"]
        .sort()
        .equals(bottom.filter(pl.col("method") == "base")["mae"].sort())
    )
    # each method's intervals, from the errors of its reconciliations of the backtest: window 1
    # only (mint_shrink needs window 0's errors), 13 per step, enough for 80% (4), not for 95%
    # (19): those are null, and the file's metadata says what they need
    assert reconciled["mint_shrink_lo_80"].is_not_null().all()
    assert (reconciled["mint_shrink_lo_80"] <= reconciled["mint_shrink"]).all()
    assert reconciled["bottom_up_hi_95"].is_null().all()
    shown = json.loads(pq.read_schema(run_dir / "forecasts_reconciled.parquet").metadata[
        METADATA_KEY.encode()
    ])  # fmt: skip
    assert shown["95"]["honoured"] is False and "13 series" in shown["95"]["needs"]
    # the base forecasts' intervals: 2 windows of 13 series, 26 errors, both levels honoured,
    # none chosen (a window to choose on and one to report on take 3)
    assert chosen["lo_95"].is_not_null().all()
    assert summary.intervals[95].honoured and summary.intervals[95].method == "pooled"
    # and tracked: each method's mean MASE per level
    import mlflow

    record = mlflow.tracking.MlflowClient(config.tracking_uri).get_run(summary.mlflow_run_id)
    tracked = record.data.metrics
    total = scores.filter(level="total", method="mint_shrink")["mase"].item()
    assert tracked["reconciled/total/mint_shrink_mase"] == pytest.approx(total)
    shops = scores.filter(level="state/region/shop", method="base")["mase"].mean()
    assert tracked["reconciled/state/region/shop/base_mase"] == pytest.approx(shops)
