"""Backtest windows, metrics, selection and failure isolation for a chunk, run in-process."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest

from shardwise.common.errors import ConfigError
from shardwise.common.job_files import validate_as
from shardwise.manymodel.columns import SERIES
from shardwise.manymodel.config import ManyModelsConfig
from shardwise.manymodel.data.long_table import SeriesTable, load_series
from shardwise.manymodel.evaluation.backtest import _metrics, origins
from shardwise.manymodel.evaluation.selection import select
from shardwise.manymodel.features.spec import FeatureSpec, polars_features
from shardwise.manymodel.run.chunk import run_chunk
from shardwise.manymodel.run.runner import make_plan


def test_metrics_by_hand():
    actual = np.array([10.0, 0.0, 5.0])
    predicted = np.array([8.0, 0.0, 10.0])
    got = _metrics(actual, predicted, naive_mae=2.0)
    assert got["mae"] == pytest.approx(7 / 3)
    assert got["rmse"] == pytest.approx(math.sqrt((4 + 0 + 25) / 3))
    # sMAPE: 200/h · Σ|e|/(|a|+|p|), a 0/0 term counts 0
    assert got["smape"] == pytest.approx(200 / 3 * (2 / 18 + 0 + 5 / 15))
    assert got["mase"] == pytest.approx((7 / 3) / 2.0)


def tiny_job(tmp_path, names, **extra) -> tuple[ManyModelsConfig, SeriesTable]:
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
        "models": {"names": names},
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
    # series × models × windows, and each series' held-out choice on the last window
    assert tables["metrics"].height == 3 * 2 * 2 + 3
    assert set(tables["choices"]["model"]) == {"ridge"}
    assert tables["forecasts"].height == 3 * 6 * 2  # every model's
    models = tables["metrics"].filter(pl.col("model") != "selected")
    mase = models.group_by("model").agg(pl.col("mase").mean()).sort("model")
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


def test_the_held_out_choice_is_scored_on_a_window_it_was_not_chosen_on(tmp_path):
    """Issue 19's honest (nested) selection: a model perfect on windows 0–1 and 50 off on window
    2 is each series' choice on 0–1, so the `selected` score on window 2 is its bad one (not the
    window's best, which the optimistic in-sample selection would come closer to); window 0 has
    no choice to score; the ensemble of the two is their mean."""
    config, table = tiny_job(
        tmp_path,
        ["seasonal_naive", "misbehaving_models:RightUntilJuly2019"],
        backtest={"horizon": 6, "n_windows": 3, "ensemble_top_k": 2},
        models={
            "names": ["seasonal_naive", "misbehaving_models:RightUntilJuly2019"],
            "scale": {"RightUntilJuly2019": "none"},
        },
    )
    tables = run_in_process(config, table).tables()
    last = tables["metrics"].filter(pl.col("window") == 2)
    mae = {m: last.filter(pl.col("model") == m).sort(SERIES)["mae"] for m in last["model"]}
    assert mae["selected"].to_list() == mae["RightUntilJuly2019"].to_list()
    assert all(v == pytest.approx(50.0) for v in mae["selected"])
    assert (mae["seasonal_naive"] < mae["selected"]).all()
    first = tables["metrics"].filter(pl.col("window") == 0)  # nothing was chosen before it
    assert set(first["model"]) == {"seasonal_naive", "RightUntilJuly2019"}
    second = tables["metrics"].filter((pl.col("window") == 1) & (pl.col("model") == "selected"))
    assert second["mae"].max() < 1e-9  # chosen on window 0, where it was perfect
    final = tables["forecasts"].pivot("model", index=[SERIES, "step"], values="forecast")
    both = (final["seasonal_naive"] + final["RightUntilJuly2019"]) / 2
    assert (final["ensemble"] - both).abs().max() < 1e-9

    selection = select(tables["metrics"], n_windows=3, metric="mase", requested="auto")
    assert selection.fallback == "RightUntilJuly2019"
    assert selection.held_out["per_series"] == selection.held_out["best_model"]
    assert selection.strategy == "ensemble"  # 25 off beats 50 off on window 2
    assert selection.held_out["ensemble"]["mase"] < selection.held_out["per_series"]["mase"]


def test_selection_copes_with_a_run_where_every_model_failed():
    """No metrics at all (every series failed): nothing to score, per-series forecasts (none)."""
    empty = pl.DataFrame(
        schema={SERIES: pl.Int64, "model": pl.String, "window": pl.Int64, "mase": pl.Float64,
                "smape": pl.Float64, "mae": pl.Float64, "rmse": pl.Float64}
    )  # fmt: skip
    selection = select(empty, n_windows=3, metric="mase", requested="auto")
    assert selection.strategy == "per_series" and selection.best_model == ""


def test_the_ensemble_has_intervals_from_its_own_window_errors(tmp_path):
    """The ensemble's interval is its mean forecast ± the conformal rank of the scale-free
    errors the same ensemble (the same top models' mean) made on the windows, pooled over the
    series, times the series' scale: its backtest rows are that mean on each window, with the
    window's actual values and scale."""
    from shardwise.manymodel.evaluation.intervals import calibrate

    config, table = tiny_job(
        tmp_path,
        ["seasonal_naive", "ridge"],
        backtest={"horizon": 6, "n_windows": 3, "ensemble_top_k": 2, "levels": [80]},
    )
    tables = run_in_process(config, table).tables()
    backtest = tables["backtest"]
    got = calibrate([backtest.lazy()], [80], 3, "pooled", sources=lambda r: r)
    widths = got.series_widths(backtest.lazy())
    forecasts = got.forecast_bounds(tables["forecasts"].lazy(), widths).collect()
    mean = forecasts.filter((pl.col(SERIES) == 0) & (pl.col("model") == "ensemble")).sort("step")
    # the ensemble's scale-free errors on every window of every series, step by step
    ensemble = backtest.filter(pl.col("model") == "ensemble")
    both = backtest.filter(pl.col("model") != "ensemble").group_by(SERIES, "window", "step")
    means = both.agg(pl.col("forecast").mean().alias("mean"))
    check = ensemble.join(means, on=[SERIES, "window", "step"])
    np.testing.assert_allclose(check["forecast"], check["mean"], rtol=1e-12)
    scaled = ensemble.with_columns(
        ((pl.col("actual") - pl.col("forecast")).abs() / pl.col("scale")).alias("e")
    )
    for step in range(1, 7):
        errors = np.sort(scaled.filter(pl.col("step") == step)["e"].to_numpy())
        q = errors[int(np.ceil((errors.size + 1) * 0.8)) - 1]  # 9 errors: the 8th
        row = mean.filter(pl.col("step") == step)
        width = q * row["scale"].item()
        assert row["hi_80"].item() - row["forecast"].item() == pytest.approx(width, rel=1e-9)
        assert row["forecast"].item() - row["lo_80"].item() == pytest.approx(width, rel=1e-9)


def test_the_backtest_forecasts_are_the_ones_the_metrics_score(tmp_path):
    """Every model's forecast of every window is kept, a row per step, and scoring those rows
    against the window's actual values gives the metrics table's MAE; the ensemble's rows are
    the mean of the series' final top models on each window."""
    from shardwise.manymodel.evaluation.backtest import origins

    config, table = tiny_job(
        tmp_path,
        ["seasonal_naive", "ridge"],
        backtest={"horizon": 6, "n_windows": 3, "ensemble_top_k": 2},
    )
    spec = FeatureSpec.from_config(config, table.season_length)
    plan = make_plan(config, table, spec)
    tables = run_in_process(config, table).tables()
    backtest, metrics = tables["backtest"], tables["metrics"]
    assert backtest.height == 3 * (2 + 1) * 3 * 6  # series × (models + ensemble) × windows × steps
    for (series,), rows in table.frame.filter(~pl.col("_future")).group_by(SERIES):
        starts = origins(rows.height, plan)
        for model in ("seasonal_naive", "ridge"):
            for window, origin in enumerate(starts):
                actual = rows["units"].to_numpy()[origin : origin + 6]
                got = backtest.filter(
                    pl.col(SERIES) == series, pl.col("model") == model, pl.col("window") == window
                ).sort("step")
                assert got["step"].to_list() == [1, 2, 3, 4, 5, 6]
                mae = metrics.filter(
                    pl.col(SERIES) == series, pl.col("model") == model, pl.col("window") == window
                )["mae"].item()
                assert np.mean(np.abs(actual - got["forecast"].to_numpy())) == pytest.approx(
                    mae, rel=1e-12
                )
    pivot = backtest.pivot("model", index=[SERIES, "window", "step"], values="forecast")
    np.testing.assert_allclose(
        pivot["ensemble"], (pivot["seasonal_naive"] + pivot["ridge"]) / 2, rtol=1e-12
    )


def test_refit_false_carries_the_first_windows_fit_of_a_feature_model(tmp_path):
    """Per-series ridge under `backtest.refit = false`: fitted on the first window's rows, it
    forecasts every later window (and the forecast) from those rows' own features, unlike a
    model fitted again there."""
    from shardwise.manymodel.evaluation.backtest import _fit_predict, origins
    from shardwise.manymodel.models.per_series import build

    backtest = {"horizon": 6, "n_windows": 3, "refit": False}
    config, table = tiny_job(tmp_path, ["ridge"], backtest=backtest)
    tables = run_in_process(config, table).tables()
    spec = FeatureSpec.from_config(config, table.season_length)
    plan = make_plan(config, table, spec)
    features = polars_features(table.frame, spec, table.columns).filter(pl.col(SERIES) == 0)
    observed = features.filter(~pl.col("_future")).rename({"units": "y"})
    future = features.filter(pl.col("_future")).rename({"units": "y"})
    starts = origins(observed.height, plan)
    model = build("ridge", {}, plan.context)
    _, first = _fit_predict(model, "ridge", observed.head(starts[0]), observed.drop("y"), plan)
    got = tables["backtest"].filter(pl.col(SERIES) == 0).sort("window", "step")
    for window, origin in enumerate(starts):
        rows = observed.slice(origin, 6).drop("y")
        carried, _ = _fit_predict(model, "ridge", observed.head(origin), rows, plan, first, window)
        refitted, _ = _fit_predict(model, "ridge", observed.head(origin), rows, plan)
        ours = got.filter(pl.col("window") == window)["forecast"].to_numpy()
        np.testing.assert_allclose(ours, carried.values, rtol=1e-12)
        if window:
            assert np.abs(ours - refitted.values).max() > 1e-9
    final = tables["forecasts"].filter(pl.col(SERIES) == 0).sort("step")["forecast"].to_numpy()
    carried, _ = _fit_predict(
        model, "ridge", observed, future.drop("y"), plan, first, plan.n_windows
    )
    np.testing.assert_allclose(final, carried.values, rtol=1e-12)


def test_reselect_false_reestimates_a_user_model_from_its_last_fit(tmp_path):
    """A user model's `reestimate(fitted, frame)` gets the last fit on every window after the
    first and on the forecast under `backtest.reselect = false`; by default it is fitted anew."""
    name = "misbehaving_models:SaysHowItWasFitted"
    backtest = {"horizon": 6, "n_windows": 3}
    for reselect, later in ((False, [11.0, 21.0, 31.0]), (True, [1.0, 1.0, 1.0])):
        extra = {"backtest": {**backtest, "reselect": reselect}, "features": {"scale": "none"}}
        config, table = tiny_job(tmp_path, [name], **extra)
        tables = run_in_process(config, table).tables()
        windows = tables["backtest"].group_by("window").agg(pl.col("forecast").unique())
        got = dict(windows.iter_rows())
        assert got == {0: [1.0], 1: [later[0]], 2: [later[1]]}, reselect
        assert tables["forecasts"]["forecast"].unique().to_list() == [later[2]], reselect


def test_seasonal_naive_repeats_the_season_before_exactly(tmp_path):
    """The seasonal naive forecast of every window and of the future is the season before its
    origin, value for value (a missing value the one before it): no scaling stands between them,
    whatever `features.scale` says for the other models."""
    config, table = tiny_job(tmp_path, ["seasonal_naive"], backtest={"horizon": 6, "n_windows": 3})
    gap = (pl.col(SERIES) == 1) & (pl.int_range(pl.len()).over(SERIES) == 40)
    noise = np.random.default_rng(0).uniform(0.1, 3.0, table.frame.height)  # no round trip
    table.frame = table.frame.with_columns(
        pl.when(gap).then(None).otherwise(pl.Series(noise)).alias("units")
    )
    spec = FeatureSpec.from_config(config, table.season_length)
    plan = make_plan(config, table, spec)
    tables = run_in_process(config, table).tables()
    for (series,), rows in table.frame.group_by(SERIES):
        observed = rows.filter(~pl.col("_future"))["units"].fill_null(strategy="forward")
        y = observed.to_numpy()
        for window, origin in enumerate(origins(observed.len(), plan)):
            got = (
                tables["backtest"]
                .filter(pl.col(SERIES) == series, pl.col("window") == window)
                .sort("step")
            )
            assert got["forecast"].to_list() == y[origin - 12 : origin - 6].tolist()
        future = tables["forecasts"].filter(pl.col(SERIES) == series).sort("step")
        assert future["forecast"].to_list() == y[-12:-6].tolist()


def test_a_series_splits_into_its_observed_and_future_rows_in_any_order():
    from shardwise.manymodel.columns import FUTURE
    from shardwise.manymodel.evaluation.backtest import _observed_and_future

    frame = pl.DataFrame({"t": [0, 1, 2, 3, 4], FUTURE: [False, False, False, True, True]})
    for rows in (frame, frame.reverse()):
        observed, future = _observed_and_future(rows)
        assert sorted(observed["t"]) == [0, 1, 2]
        assert sorted(future["t"]) == [3, 4]
