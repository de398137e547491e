"""Target transforms (scaling, differencing) and the per-series LightGBM on trending series: trees
cannot forecast beyond the targets they were fitted on, a differenced target can."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from shardwise.common.errors import ConfigError
from shardwise.common.job_files import validate_as
from shardwise.manymodel.config import ManyModelsConfig, check
from shardwise.manymodel.data.long_table import load_series
from shardwise.manymodel.features.spec import FeatureSpec, polars_features
from shardwise.manymodel.models.transforms import TARGET, TargetTransform
from shardwise.manymodel.run.chunk import run_chunk
from shardwise.manymodel.run.runner import make_plan


def test_a_differenced_scaled_target_comes_back_exactly():
    y = np.array([10.0, 12.0, 15.0, 13.0, 18.0, 20.0, 25.0, 24.0])
    frame = pl.DataFrame({TARGET: y, "lag2": [None, None, *y[:-2]], "roll2_std": np.ones(8)})
    transform = TargetTransform("standard", anchor="lag2", level=("lag2",), spread=("roll2_std",))
    train, rows = frame.head(6), frame.tail(2)
    model_train, model_rows, back = transform.apply(train, rows.drop(TARGET))
    loc, scale = y[:6].mean(), y[:6].std()
    # the model sees the change since the anchor, in the series' scaled units
    expected = (y[2:6] - y[:4]) / scale
    np.testing.assert_allclose(model_train[TARGET].to_numpy()[2:], expected, rtol=1e-12)
    np.testing.assert_allclose(model_rows["roll2_std"].to_numpy(), 1 / scale, rtol=1e-12)
    # a model that predicts the true change gets the true values back
    change = (y[6:] - y[4:6]) / scale
    np.testing.assert_allclose(back(change), y[6:], rtol=1e-12)
    assert loc != 0  # the location was removed and restored, not only the scale


def trending_job(tmp_path, **models):
    """Three monthly series with a strong trend: every test value lies above the training range."""
    t = np.arange(72)
    rng = np.random.default_rng(0)
    rows = []
    for shop, slope in (("a", 2.0), ("b", 3.0), ("c", 5.0)):
        y = 50 + slope * t + 4 * np.sin(2 * np.pi * t / 12) + rng.normal(0, 1, t.size)
        months = [f"{2015 + k // 12}-{k % 12 + 1:02d}-01" for k in t]
        rows += [(shop, month, float(v)) for month, v in zip(months, y, strict=True)]
    path = tmp_path / "trend.csv"
    pl.DataFrame(rows, orient="row", schema=["shop", "month", "units"]).write_csv(path)
    raw = {
        "data": {"source": str(path), "id_columns": ["shop"], "timestamp": "month",
                 "target": "units"},
        "features": {"lags": [6, 7, 12], "rolling_windows": [6]},
        "models": {"names": ["lightgbm"], "args": {"lightgbm": {"n_estimators": 50}}, **models},
        "backtest": {"horizon": 6, "n_windows": 3},
    }  # fmt: skip
    config = validate_as(ManyModelsConfig, raw)
    check(config)
    table = load_series(config)
    spec = FeatureSpec.from_config(config, table.season_length)
    features = polars_features(table.frame, spec, table.columns)
    result = run_chunk(features.to_arrow(), make_plan(config, table, spec))
    return result.tables()["metrics"].filter(pl.col("model") == "lightgbm")["mase"].mean()


def test_a_differenced_target_lets_lightgbm_follow_a_trend(tmp_path):
    # standardised per series, the trees still cap at the training window's highest value
    level = trending_job(tmp_path, scale={"lightgbm": "standard"})
    differenced = trending_job(tmp_path, difference={"lightgbm": True})
    assert differenced < 0.5 * level
    assert differenced < 1.0  # better than the seasonal naive, which lags the trend


def test_statistical_models_cannot_be_differenced_or_global(tmp_path):
    for key in ("difference", "global"):
        raw = {"models": {"names": ["auto_ets", "ridge"], key: {"auto_ets": True}}}
        with pytest.raises(ConfigError, match=rf"models\.{key}\.auto_ets: auto_ets models each"):
            check(validate_as(ManyModelsConfig, raw))
    raw = {"models": {"names": ["ridge"], "global": {"rigde": True}}}
    with pytest.raises(ConfigError, match=r"models\.global\.rigde names no model; did you mean"):
        check(validate_as(ManyModelsConfig, raw))


@pytest.mark.parametrize("anchor", ["", "lag_12"])
def test_a_window_in_the_models_units_is_what_polars_expressions_make(anchor):
    """`_to_model` builds its columns one by one (a window is a few rows, and polars' query
    engine cost more than the work); it must equal the expressions it stands for: the target
    and level features shifted and scaled, spread features scaled, the rest as they were, and
    with an anchor every level column but the anchor less the (scaled) anchor."""
    rng = np.random.default_rng(0)
    frame = pl.DataFrame({
        "unique_id": [3] * 9, "y": rng.normal(50, 5, 9), "lag_12": rng.normal(50, 5, 9),
        "roll_mean": rng.normal(50, 5, 9), "roll_std": rng.uniform(1, 2, 9),
        "month": pl.Series(range(9), dtype=pl.Int32), "count": pl.Series(range(9)),
    })  # fmt: skip
    level = ("lag_12", "roll_mean", "count")
    transform = TargetTransform("standard", anchor=anchor, level=level, spread=("roll_std",))
    loc, scale = 48.0, 4.5
    moved = ["y", *level]
    shifted = ((pl.col(c) - loc) / scale for c in moved)
    want = frame.with_columns(*shifted, pl.col("roll_std") / scale)
    if anchor:
        want = want.with_columns(pl.col(c) - pl.col(anchor) for c in moved if c != anchor)
    got = transform._to_model(frame, loc, scale)
    assert got.columns == frame.columns and got.schema == want.schema
    assert got.equals(want)
    without_target = transform._to_model(frame.drop("y"), loc, scale)
    assert without_target.equals(want.drop("y"))
