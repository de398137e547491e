"""Global models on a real local Ray instance: one model fitted on every series' rows per backtest
window, the series spread over two actors. Each is checked against the same fit in one process
on all the series (LightGBM over its sockets, the MLP over gloo, ridge gathered to one actor)."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from shardwise.common.job_files import validate_as
from shardwise.manymodel.columns import SERIES
from shardwise.manymodel.config import ManyModelsConfig
from shardwise.manymodel.data.long_table import load_series
from shardwise.manymodel.features.spec import FeatureSpec, polars_features
from shardwise.manymodel.models.global_models import Worker
from shardwise.manymodel.run.runner import make_plan, run

pytestmark = pytest.mark.slow


def job(tmp_path, names, **models) -> ManyModelsConfig:
    raw = {
        "job": {"name": "global", "run_dir": str(tmp_path / "run")},
        "data": {"source": "us_employment", "num_series": 16},
        "features": {"lags": [12, 13, 24], "rolling_windows": [12], "calendar": ["month"]},
        "models": {"names": names, **models},
        "backtest": {"horizon": 12, "n_windows": 2},
        "runner": {"num_cpus": 1, "chunk_size": 4},
        "tracking": {"mlflow": False},
    }
    return validate_as(ManyModelsConfig, raw)


def in_one_process(config: ManyModelsConfig) -> pl.DataFrame:
    """Every window's global forecasts from one worker holding every series."""
    table = load_series(config)
    spec = FeatureSpec.from_config(config, table.season_length)
    plan = make_plan(config, table, spec)
    worker = Worker(plan, 0, 1, polars_features(table.frame, spec, table.columns))
    frames = []
    for label in sorted(plan.global_models):
        for window in range(plan.n_windows + 1):
            if plan.refits(window):
                worker.fit(label, window)
            frames.append(worker.predict(label, window))
    return pl.concat(frames)


def compared(tmp_path, config) -> tuple[np.ndarray, np.ndarray, pl.DataFrame]:
    summary = run(config)
    assert summary.failed == 0
    spread = pl.read_parquet(tmp_path / "run" / "chunks" / "global.parquet")
    alone = in_one_process(config)
    keys = [SERIES, "model", "origin", "step"]
    both = spread.join(alone, on=keys, suffix="_alone").sort(keys)
    assert (
        both.height == spread.height == alone.height == 16 * 12 * 3 * len(spread["model"].unique())
    )
    return both["forecast"].to_numpy(), both["forecast_alone"].to_numpy(), both


def test_global_ridge_and_mlp_on_two_actors_match_one_process(ray_cluster, tmp_path):
    config = job(
        tmp_path,
        ["seasonal_naive", "ridge", "mlp"],
        args={"mlp": {"epochs": 100}},
        **{"global": {"ridge": True, "mlp": True}},
    )
    spread, alone, both = compared(tmp_path, config)
    ridge = (both["model"] == "ridge").to_numpy()
    # ridge: every actor's rows gathered to one, the same fit up to the rows' order
    np.testing.assert_allclose(spread[ridge], alone[ridge], rtol=1e-9)
    # the MLP: gradients summed over gloo, float32: the same net up to rounding
    np.testing.assert_allclose(spread[~ridge], alone[~ridge], rtol=1e-4)
    metrics = pl.read_parquet(tmp_path / "run" / "backtest_metrics.parquet")
    assert {"ridge", "mlp", "seasonal_naive", "selected"} <= set(metrics["model"])
    by_model = pl.read_parquet(tmp_path / "run" / "forecasts_by_model.parquet")
    assert by_model.filter(pl.col("model") == "mlp").height == 16 * 12


def test_refit_false_fits_a_global_model_once_and_forecasts_every_window_with_it(
    ray_cluster, tmp_path
):
    """`backtest.refit = false`: the global ridge is fitted on the first window's rows only;
    every later window and the forecast use that fit on their own rows (their features from the
    longer history), on two actors as in one process, and unlike refitting."""
    config = job(tmp_path, ["seasonal_naive", "ridge"], **{"global": {"ridge": True}})
    config.backtest.refit = False
    spread, alone, both = compared(tmp_path, config)
    np.testing.assert_allclose(spread, alone, rtol=1e-9)
    config.backtest.refit = True
    refitted = in_one_process(config)
    keys = [SERIES, "model", "origin", "step"]
    against = both.join(refitted, on=keys, suffix="_refit").with_columns(
        (pl.col("origin").rank("dense").over(SERIES) - 1).alias("window")
    )
    first = against.filter(pl.col("window") == 0)  # fitted either way
    np.testing.assert_allclose(first["forecast"], first["forecast_refit"], rtol=1e-9)
    later = against.filter(pl.col("window") > 0)
    assert later.height == 16 * 12 * 2
    assert (later["forecast"] - later["forecast_refit"]).abs().max() > 1e-6


def test_global_lightgbm_data_parallel_matches_one_process(ray_cluster, tmp_path):
    config = job(
        tmp_path,
        ["seasonal_naive", "lightgbm"],
        args={"lightgbm": {"n_estimators": 50}},
        difference={"lightgbm": True},
        **{"global": {"lightgbm": True}},
    )
    spread, alone, _ = compared(tmp_path, config)
    # Data-parallel trees: the bin boundaries come from each actor's own rows, not from all of
    # them, so a split can fall a little elsewhere: most forecasts agree closely, a few less.
    relative = np.abs(spread - alone) / np.abs(alone)
    assert np.median(relative) < 0.005
    assert np.quantile(relative, 0.99) < 0.02
    assert relative.max() < 0.2
    metrics = pl.read_parquet(tmp_path / "run" / "backtest_metrics.parquet")
    mase = metrics.group_by("model").agg(pl.col("mase").mean())
    mase = dict(zip(mase["model"], mase["mase"], strict=True))
    assert mase["lightgbm"] < mase["seasonal_naive"]


def test_a_failing_global_model_fails_for_every_series_and_the_others_forecast(
    ray_cluster, tmp_path
):
    config = job(
        tmp_path,
        ["seasonal_naive", "bad_models:GlobalFails"],
        **{"global": {"GlobalFails": True}},
    )
    # half a CPU per task: 4 task slots on the 2-CPU cluster, so 4 actors of half a CPU each
    config.runner.num_cpus = 0.5
    summary = run(config)
    assert summary.completed == 16 and summary.failed == 0
    failures = pl.read_parquet(tmp_path / "run" / "failures.parquet")
    assert failures["model"].unique().to_list() == ["GlobalFails"]
    assert failures.height == 16  # each series records it once, at its first window
    assert (
        failures["error"]
        .str.contains("the global fit failed: ValueError: global fit refused")
        .all()
    )
    best = pl.read_parquet(tmp_path / "run" / "best_models.parquet")
    assert set(best["model"]) == {"seasonal_naive"}
