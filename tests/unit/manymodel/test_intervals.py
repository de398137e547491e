"""Prediction intervals from the backtest's errors (issue 19 point 4, issue 35 point 2): the
conformal rank by hand, a level that cannot be honoured left null, and the coverage of the
intervals over many series with known noise at three windows, checked against values the run
never saw, with widths that cover by being right, not wide."""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest
from polars.testing import assert_frame_equal

from shardwise.common.job_files import validate_as
from shardwise.manymodel.columns import SERIES
from shardwise.manymodel.config import ManyModelsConfig
from shardwise.manymodel.data.long_table import load_series
from shardwise.manymodel.evaluation.intervals import METADATA_KEY, calibrate, needed
from shardwise.manymodel.features.spec import FeatureSpec, polars_features
from shardwise.manymodel.run.chunk import run_chunk
from shardwise.manymodel.run.runner import make_plan

SERIES_COUNT, MONTHS, SIGMA, HORIZON = 2000, 60, 2.0, 2
Z = {80: 1.2815515655446004, 95: 1.959963984540054}


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


def _rows(errors: list[list[float]], scale: float = 1.0) -> pl.LazyFrame:
    """Backtest rows of one model and one step: `errors[s][w]` of series s on window w."""
    return pl.DataFrame(
        [
            {SERIES: s, "model": "m", "window": w, "origin": 0, "step": 1, "forecast": 0.0,
             "actual": e, "scale": scale}
            for s, per_series in enumerate(errors) for w, e in enumerate(per_series)
        ]
    ).lazy()  # fmt: skip


def test_the_conformal_rank_by_hand():
    """Pooled over series: the ⌈(n + 1)·L⌉-th smallest of the n scale-free errors of the
    windows before; a series' half-width is that times its scale."""
    rows = _rows([[1.0, 5.0, 0.0], [2.0, 4.0, 0.0], [3.0, 6.0, 0.0]], scale=2.0)
    got = calibrate([rows], [50], 3, "pooled", sources=lambda r: r)
    pooled = got.pooled.sort("window")
    # window 1: 3 errors (0.5, 1, 1.5): rank ⌈4 · 0.5⌉ = 2; window 2: 6, rank ⌈7 · 0.5⌉ = 4;
    # window 3 (the forecast's): 9, three of them 0, rank ⌈10 · 0.5⌉ = 5
    assert pooled["q_50"].to_list() == [1.0, 2.0, 1.0]
    final = got.forecast_bounds(
        pl.DataFrame(
            {SERIES: [0], "model": ["m"], "step": [1], "forecast": [10.0], "scale": [3.0]}
        ).lazy(),
        got.series_widths(rows),
    ).collect()
    assert final.row(0, named=True) | {} == {
        SERIES: 0, "model": "m", "step": 1, "forecast": 10.0, "scale": 3.0,
        "lo_50": 7.0, "hi_50": 13.0,
    }  # fmt: skip
    # per series, 3 windows before the forecast: rank ⌈4 · 0.5⌉ = 2 of (0, 1, 5)
    own = calibrate([rows], [50], 3, "series", sources=lambda r: r)
    final = own.forecast_bounds(
        pl.DataFrame({SERIES: [0], "model": ["m"], "step": [1], "forecast": [10.0]}).lazy(),
        own.series_widths(rows),
    ).collect()
    assert (final["lo_50"].item(), final["hi_50"].item()) == (9.0, 11.0)


def _panel(series: int, seed: int) -> pl.DataFrame:
    """Backtest rows of two models, 5 windows and 2 steps whose scale-free errors tie (values
    on a grid), are mostly exactly 0 (the 50% rank), 6% infinite (above the 95% rank), and
    have no scale for a few series."""
    rng = np.random.default_rng(seed)
    per_series = 2 * 5 * 2
    n = series * per_series
    actual = np.round(rng.gamma(2.0, 3.0, n), 1)
    forecast = np.where(rng.random(n) < 0.6, actual, np.round(rng.gamma(2.0, 3.0, n), 1))
    forecast[rng.random(n) < 0.06] = np.inf
    scale = np.where(rng.random(series) < 0.05, 0.0, rng.gamma(2.0, 1.0, series))
    return pl.DataFrame(
        {SERIES: np.repeat(np.arange(series), per_series),
         "model": np.tile(np.repeat(["a", "b"], 10), series),
         "window": np.tile(np.repeat(np.arange(5), 2), 2 * series),
         "origin": 0, "step": np.tile([1, 2], 10 * series),
         "forecast": forecast, "actual": actual, "scale": np.repeat(scale, per_series)}
    )  # fmt: skip


def test_pooled_widths_are_exact_ranks_however_the_series_are_split():
    """The pooled half-widths are read a part of the series at a time, never all the errors at
    once (outputs.py), yet are each the exact conformal rank: equal to sorting every error of
    the windows before by hand, ties, zeros and infinities included, and the same for one
    part as for 9; so are every score and every bound, by every method."""
    frame = _panel(900, seed=5)
    levels = [50, 80, 95]
    whole = {
        m: calibrate(
            [frame.lazy()], levels, 5, m, sources=lambda r: r.filter(pl.col("model") == "a")
        )
        for m in ("pooled", "series", "auto")
    }
    scaled = frame.filter(pl.col("scale") > 0).with_columns(
        ((pl.col("actual") - pl.col("forecast")).abs() / pl.col("scale")).alias("e")
    )
    pooled = whole["pooled"].pooled
    for (model, step, t), q in zip(
        pooled.select("model", "step", "window").iter_rows(), pooled["q_80"], strict=True
    ):
        errors = scaled.filter(
            (pl.col("model") == model) & (pl.col("step") == step) & (pl.col("window") < t)
        )["e"].to_numpy()
        rank = -(-(len(errors) + 1) * 80 // 100)
        assert q == np.sort(errors)[rank - 1], (model, step, t)
    assert np.isinf(pooled["q_95"].max()) and (pooled["q_50"] == 0).any()
    parts = [frame.filter(pl.col(SERIES) // 100 == i).lazy() for i in range(9)]
    finals = frame.filter(pl.col("window") == 4).drop("window", "actual").lazy()
    for method, one in whole.items():
        split = calibrate(
            parts, levels, 5, method, sources=lambda r: r.filter(pl.col("model") == "a")
        )
        assert split.pooled.sort("model", "window", "step").equals(
            one.pooled.sort("model", "window", "step")
        )
        for level in levels:
            a, b = one.levels[level], split.levels[level]
            assert (a.method, a.missing, a.total, a.needs) == (
                b.method,
                b.missing,
                b.total,
                b.needs,
            )
            assert b.scores == pytest.approx(a.scores, rel=1e-12, nan_ok=True)
        assert_frame_equal(
            split.forecast_bounds(finals, split.series_widths(frame.lazy()))
            .collect()
            .sort(SERIES, "model", "step"),
            one.forecast_bounds(finals, one.series_widths(frame.lazy()))
            .collect()
            .sort(SERIES, "model", "step"),
        )


def test_a_level_that_cannot_be_honoured_is_null_and_says_what_it_needs():
    """3 series × 2 windows give 6 errors at the forecast: 80% needs 4 (honoured), 95% needs 19
    (not): its bounds are null, never the largest error under the level's name."""
    assert (needed(80), needed(90), needed(95)) == (4, 9, 19)
    rows = _rows([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    got = calibrate([rows], [80, 95], 2, "pooled", sources=lambda r: r)
    final = got.forecast_bounds(
        pl.DataFrame(
            {SERIES: [0], "model": ["m"], "step": [1], "forecast": [0.0], "scale": [1.0]}
        ).lazy(),
        got.series_widths(rows),
    ).collect()
    assert final["hi_80"].item() == 6.0 and final["hi_95"].item() is None
    assert got.levels[80].honoured and not got.levels[95].honoured
    assert "19 errors per model and step pooled over 3 series" in got.levels[95].needs
    assert "backtest.n_windows ≥ 7" in got.levels[95].needs
    shown = json.loads(got.metadata()[METADATA_KEY])
    assert shown["95"]["honoured"] is False and shown["80"]["method"] == "pooled"


@pytest.fixture(scope="module")
def noisy(tmp_path_factory):
    """2,000 series of a known mean plus N(0, 2) noise, three windows of two steps, and the
    next two values, drawn but never given to the run."""
    rng = np.random.default_rng(0)
    t = np.arange(MONTHS + HORIZON)
    noisy = _mean(t)[None, :] + rng.normal(0, SIGMA, (SERIES_COUNT, MONTHS + HORIZON))
    months = [f"{2015 + k // 12}-{k % 12 + 1:02d}-01" for k in range(MONTHS)]
    names = [f"s{i:04d}" for i in range(SERIES_COUNT)]
    frame = pl.DataFrame(
        {
            "shop": np.repeat(names, MONTHS),
            "month": months * SERIES_COUNT,
            "units": noisy[:, :MONTHS].reshape(-1),
        }
    )
    path = tmp_path_factory.mktemp("noisy") / "noisy.csv"
    frame.write_csv(path)
    config = validate_as(
        ManyModelsConfig,
        {
            "data": {"source": str(path), "id_columns": ["shop"], "timestamp": "month",
                     "target": "units"},
            "models": {"names": ["test_intervals:KnowsTheMean"],
                       "scale": {"KnowsTheMean": "none"}},
            "features": {"lags": [1]},
            "backtest": {"horizon": HORIZON, "n_windows": 3, "levels": [80, 95],
                         "min_train": 12},
        },
    )  # fmt: skip
    table = load_series(config)
    spec = FeatureSpec.from_config(config, table.season_length)
    plan = make_plan(config, table, spec)
    tables = run_chunk(polars_features(table.frame, spec, table.columns), plan).tables()
    return tables, noisy[:, MONTHS:]


def test_pooled_intervals_cover_unseen_values_at_three_windows(noisy):
    """At 3 windows each series has 3 errors per step, too few for any per-series interval at
    80% (4) or 95% (19); pooled over 2,000 series they are 6,000. Against the next values the
    intervals cover within ±3 points of 80% and 95% (≥ 3 standard errors: 0.9 and 0.5 points),
    and their half-widths are within 5% of z·σ: a band too wide would cover too, and fail."""
    tables, truth = noisy
    got = calibrate([tables["backtest"].lazy()], [80, 95], 3, "auto", sources=lambda r: r)
    assert got.levels[80].method == "pooled" and got.levels[80].chosen_on == [1]
    assert got.levels[80].reported_on == [2]
    widths = got.series_widths(tables["backtest"].lazy())
    forecasts = (
        got.forecast_bounds(tables["forecasts"].lazy(), widths).collect().sort(SERIES, "step")
    )
    actual = truth.reshape(-1)  # series in id order, then steps
    for level in (80, 95):
        lower, upper = forecasts[f"lo_{level}"].to_numpy(), forecasts[f"hi_{level}"].to_numpy()
        covered = float(np.mean((actual >= lower) & (actual <= upper)))
        assert abs(covered - level / 100) <= 0.03, (level, covered)
        half = float(np.mean(upper - lower) / 2)
        assert half == pytest.approx(Z[level] * SIGMA, rel=0.05), (level, half)
        # the held-out window (2, from windows 0 and 1) scores the same way
        held = got.levels[level].scores[f"coverage_{level}"]
        assert abs(held - level / 100) <= 0.03, (level, held)
        assert got.levels[level].honoured


def test_per_series_intervals_at_three_windows_are_not_made(noisy):
    """What the run did before: each series' own 3 errors, the largest standing for 95%.
    Now such a level is null, and says it needs 19 windows."""
    tables, _ = noisy
    got = calibrate([tables["backtest"].lazy()], [80, 95], 3, "series", sources=lambda r: r)
    widths = got.series_widths(tables["backtest"].lazy())
    forecasts = got.forecast_bounds(tables["forecasts"].lazy(), widths).collect()
    assert forecasts["lo_95"].is_null().all() and forecasts["lo_80"].is_null().all()
    assert "backtest.n_windows ≥ 19 (has 3)" in got.levels[95].needs


def test_the_forecast_files_carry_the_intervals_method_in_their_metadata(tmp_path):
    from shardwise.manymodel.run.outputs import _Appended

    path = tmp_path / "f.parquet"
    with _Appended({"f": path}, {METADATA_KEY: json.dumps({"80": {"honoured": True}})}) as out:
        out.write("f", pl.DataFrame({"a": [1]}))
    metadata = pq.read_schema(path).metadata
    assert json.loads(metadata[METADATA_KEY.encode()]) == {"80": {"honoured": True}}


def _shocked(series: int, shocks: np.ndarray, windows: int, horizon: int) -> pl.LazyFrame:
    """Backtest rows of one model: every series' error is 1 except at the time steps `shocks`
    marks, where a shock moves every series at once (error 10)."""
    rows = []
    for w in range(windows):
        for step in range(1, horizon + 1):
            error = 10.0 if shocks[w * horizon + step - 1] else 1.0
            rows += [
                {SERIES: s, "model": "m", "window": w, "origin": 0, "step": step,
                 "forecast": 0.0, "actual": error, "scale": 1.0}
                for s in range(series)
            ]  # fmt: skip
    return pl.DataFrame(rows).lazy()


def test_coverage_comes_with_an_interval_over_time_steps_not_series():
    """A shock that moves every series at once is one miss per time step, however many series
    it hits: the coverage's interval (a block bootstrap over time steps) is the same with 1
    series as with 200 copies of it (at 50%, where the copies' conformal rank picks the same
    error), and wide: about 1 in 5 of the 36 time steps reported is shocked."""
    windows, horizon = 6, 12
    shocks = np.random.default_rng(7).random(windows * horizon) < 0.2
    got = {}
    for series in (1, 200):
        rows = _shocked(series, shocks, windows, horizon)
        got[series] = calibrate([rows], [50], windows, "pooled", sources=lambda r: r).levels[50]
    one, many = got[1].scores, got[200].scores
    assert got[200].reported_on == [3, 4, 5] and many["coverage_50_time_steps"] == 36.0
    for name in ("coverage_50", "coverage_50_low", "coverage_50_high"):
        assert one[name] == pytest.approx(many[name]), name
    assert many["coverage_50_low"] < many["coverage_50"] < many["coverage_50_high"]
    assert many["coverage_50_high"] - many["coverage_50_low"] > 0.15


def test_coverage_from_too_few_time_steps_is_said_to_be_too_few():
    rows = _shocked(50, np.zeros(3 * 2, dtype=bool), 3, 2)  # windows 1 and 2: 4 time steps
    level = calibrate([rows], [80], 3, "pooled", sources=lambda r: r).levels[80]
    assert level.scores["coverage_80_time_steps"] == 2.0
    assert np.isnan(level.scores["coverage_80_low"])
    from shardwise.manymodel.evaluation.intervals import describe

    assert "2 time steps: too few to judge" in describe({80: level})
