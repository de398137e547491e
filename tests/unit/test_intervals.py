"""Conformal prediction intervals from the backtest's errors (issue 19 point 4): the rank rule by
hand, the interval scores by hand, and the coverage of the forecasts' intervals over many series
with known noise, checked against values the run never saw."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest

from shardwise.config import validate_as
from shardwise.manymodel.backtest import run_chunk
from shardwise.manymodel.config import ManyModelsConfig
from shardwise.manymodel.data import SERIES, load_series
from shardwise.manymodel.features import FeatureSpec, polars_features
from shardwise.manymodel.intervals import half_widths, interval_scores
from shardwise.manymodel.runner import make_plan

SERIES_COUNT, MONTHS, SIGMA = 300, 72, 2.0


def _mean(t: np.ndarray) -> np.ndarray:
    return 50 + 10 * np.sin(2 * np.pi * t / 12)


class KnowsTheMean:
    """Forecasts the series' true mean: its errors are exactly the noise."""

    def fit(self, frame: pl.DataFrame) -> None:
        return None

    def predict(self, fitted: None, frame: pl.DataFrame) -> np.ndarray:
        month = frame["month"]
        t = ((month.dt.year() - 2015) * 12 + month.dt.month() - 1).to_numpy().astype(float)
        return _mean(t)


def test_the_conformal_rank_and_the_scores_by_hand():
    errors = [np.array([1.0, 2.0]), np.array([5.0, 4.0]), np.array([3.0, np.nan])]
    # 3 errors at step 1: rank ⌈4 · 0.5⌉ = 2; 2 at step 2: rank ⌈3 · 0.5⌉ = 2
    np.testing.assert_array_equal(half_widths(errors, 50), [3.0, 4.0])
    np.testing.assert_array_equal(half_widths(errors, 95), [5.0, 4.0])  # too few: the largest
    actual, lower, upper = np.array([1.0, 5.0, 9.0]), np.zeros(3), np.full(3, 6.0)
    got = interval_scores(actual, lower, upper, 80, naive_mae=2.0)
    winkler = (6 + 6 + 6 + 2 / 0.2 * 3) / 3  # widths, plus 2/α times the 3 the last one misses by
    assert got["coverage_80"] == pytest.approx(2 / 3)
    assert got["winkler_80"] == pytest.approx(winkler)
    assert got["msis_80"] == pytest.approx(winkler / 2.0)
    assert math.isnan(interval_scores(actual * np.nan, lower, upper, 80, 2.0)["coverage_80"])


def test_intervals_cover_unseen_values_at_their_level_over_many_series(tmp_path):
    """300 series of a known mean plus N(0, 2) noise; 39 one-step backtest windows give 39
    errors per series, from which the forecast's intervals are built. Against the next value,
    drawn but never given to the run, they cover within ±3 points of 80% and 95%."""
    rng = np.random.default_rng(0)
    t = np.arange(MONTHS + 1)
    noisy = _mean(t)[None, :] + rng.normal(0, SIGMA, (SERIES_COUNT, MONTHS + 1))
    months = [f"{2015 + k // 12}-{k % 12 + 1:02d}-01" for k in range(MONTHS)]
    names = [f"s{i:03d}" for i in range(SERIES_COUNT)]
    frame = pl.DataFrame(
        {
            "shop": np.repeat(names, MONTHS),
            "month": months * SERIES_COUNT,
            "units": noisy[:, :MONTHS].reshape(-1),
        }
    )
    path = tmp_path / "noisy.csv"
    frame.write_csv(path)
    model = "test_intervals:KnowsTheMean"
    config = validate_as(
        ManyModelsConfig,
        {
            "data": {"source": str(path), "id_columns": ["shop"], "timestamp": "month",
                     "target": "units"},
            "models": {"names": [model], "scale": {"KnowsTheMean": "none"}},
            "features": {"lags": [1]},
            "backtest": {"horizon": 1, "step": 1, "n_windows": 39, "levels": [80, 95],
                         "min_train": 12},
        },
    )  # fmt: skip
    table = load_series(config)
    spec = FeatureSpec.from_config(config, table.season_length)
    plan = make_plan(config, table, spec)
    tables = run_chunk(polars_features(table.frame, spec, table.columns), plan).tables()
    forecasts = tables["forecasts"].sort(SERIES)
    truth = noisy[:, MONTHS]  # series are numbered in id order
    for level in (80, 95):
        lower, upper = forecasts[f"lo_{level}"].to_numpy(), forecasts[f"hi_{level}"].to_numpy()
        covered = float(np.mean((truth >= lower) & (truth <= upper)))
        assert abs(covered - level / 100) <= 0.03, (level, covered)
    metrics = tables["metrics"]
    assert metrics.filter(pl.col("window") == 0)["coverage_80"].is_null().all()
    late = metrics.filter(pl.col("window") >= 20)  # 20 or more earlier errors per interval
    assert abs(late["coverage_80"].mean() - 0.80) <= 0.03
