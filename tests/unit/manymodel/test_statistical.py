"""statsforecast's models built into many-models (issue 19): the same forecasts as statsforecast
run by hand on the same history, the target unscaled, intermittent-demand models on zeros."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from statsforecast.models import ADIDA, TSB, AutoETS, AutoTheta, CrostonOptimized

from shardwise.common.errors import ConfigError
from shardwise.common.job_files import validate_as
from shardwise.manymodel.config import ManyModelsConfig, check
from shardwise.manymodel.data.long_table import load_series
from shardwise.manymodel.features.spec import FeatureSpec, polars_features
from shardwise.manymodel.run.chunk import run_chunk
from shardwise.manymodel.run.runner import make_plan

MONTHS = 72


def _job(tmp_path, series: dict[str, np.ndarray], names: list[str], **extra):
    rows = [
        (name, f"{2015 + k // 12}-{k % 12 + 1:02d}-01", float(v))
        for name, y in series.items()
        for k, v in enumerate(y)
    ]
    path = tmp_path / "m.csv"
    pl.DataFrame(rows, orient="row", schema=["item", "month", "units"]).write_csv(path)
    raw = {
        "data": {"source": str(path), "id_columns": ["item"], "timestamp": "month"},
        "models": {"names": names},
        "backtest": {"horizon": 6, "n_windows": 2},
        **extra,
    }
    raw["data"]["target"] = "units"
    config = validate_as(ManyModelsConfig, raw)
    check(config)
    table = load_series(config)
    spec = FeatureSpec.from_config(config, table.season_length)
    result = run_chunk(
        polars_features(table.frame, spec, table.columns), make_plan(config, table, spec)
    )
    return config, result.tables()


def _multiplicative() -> np.ndarray:
    """Trend times a season whose swing grows with the level: multiplicative ETS's shape."""
    t = np.arange(MONTHS)
    noise = np.random.default_rng(0).normal(1.0, 0.02, MONTHS)
    return (50 + 2.0 * t) * (1 + 0.4 * np.sin(2 * np.pi * t / 12)) * noise


def _intermittent() -> np.ndarray:
    rng = np.random.default_rng(1)
    return np.where(rng.random(MONTHS) < 0.3, rng.integers(1, 9, MONTHS), 0).astype(float)


def _by_hand(model, y: np.ndarray, h: int) -> np.ndarray:
    return np.asarray(model.fit(y).predict(h=h)["mean"])


def test_statistical_models_forecast_as_statsforecast_does_on_the_raw_target(tmp_path):
    """Under the default `features.scale = "standard"`, auto_ets and auto_theta still see the
    target in its own units: the backtest's forecasts equal statsforecast's on the same
    history (a standardised target has negative values and would rule out multiplicative ETS)."""
    y = _multiplicative()
    _, tables = _job(tmp_path, {"a": y}, ["auto_ets", "auto_theta"])
    assert tables["failures"].height == 0
    final = tables["forecasts"]
    for label, model in (("auto_ets", AutoETS(season_length=12)), ("auto_theta", AutoTheta(12))):
        if label in final["model"].to_list():  # the chosen one is refitted on every row
            expected = _by_hand(model, y, 6)
            got = final.filter(pl.col("model") == label).sort("step")["forecast"].to_numpy()
            np.testing.assert_allclose(got, expected, rtol=1e-9)
    ets = AutoETS(season_length=12).fit(y[: MONTHS - 6])
    assert ets.model_["method"].endswith("M)") or ",M" in ets.model_["method"]
    metrics = tables["metrics"].filter((pl.col("model") == "auto_ets") & (pl.col("window") == 1))
    expected = _by_hand(AutoETS(season_length=12), y[: MONTHS - 6], 6)
    mae = float(np.mean(np.abs(y[MONTHS - 6 :] - expected)))
    assert metrics["mae"][0] == pytest.approx(mae, rel=1e-9)


def test_intermittent_demand_models_on_a_series_of_zeros(tmp_path):
    y = _intermittent()
    models = ["croston", "tsb", "adida", "mstl", "auto_arima"]
    _, tables = _job(tmp_path, {"a": y, "b": _multiplicative()}, models)
    assert tables["failures"].height == 0
    window = tables["metrics"].filter((pl.col("window") == 1) & (pl.col("model") != "mstl"))
    history = y[: MONTHS - 6]
    for label, model in (
        ("croston", CrostonOptimized()),
        ("tsb", TSB(alpha_d=0.1, alpha_p=0.1)),
        ("adida", ADIDA()),
    ):
        expected = _by_hand(model, history, 6)
        mae = float(np.mean(np.abs(y[MONTHS - 6 :] - expected)))
        row = window.filter(pl.col("model") == label).sort("_series")  # item a first
        assert row["mae"][0] == pytest.approx(mae, rel=1e-9), label


def test_a_scale_per_model_and_misspelt_arguments(tmp_path):
    """`models.scale.<model>` overrides the default: a standardised target changes auto_ets's
    forecasts (no multiplicative form is possible on it)."""
    y = _multiplicative()
    expected = _by_hand(AutoETS(season_length=12), y[: MONTHS - 6], 6)
    mae = float(np.mean(np.abs(y[MONTHS - 6 :] - expected)))
    scaled = {"names": ["auto_ets"], "scale": {"auto_ets": "standard"}}
    _, tables = _job(tmp_path, {"a": y}, ["auto_ets"], models=scaled)
    window = tables["metrics"].filter(pl.col("window") == 1)
    assert window["mae"][0] != pytest.approx(mae, rel=1e-6)
    misspelt = {"names": ["auto_ets"], "args": {"auto_ets": {"dampd": True}}}
    with pytest.raises(ConfigError, match=r"models\.args\.auto_ets: .*'dampd'"):
        _job(tmp_path, {"a": y}, ["auto_ets"], models=misspelt)
    unknown = {"names": ["auto_ets"], "scale": {"auto_et": "none"}}
    with pytest.raises(ConfigError, match=r"models\.scale\.auto_et names no model; did you mean"):
        _job(tmp_path, {"a": y}, ["auto_ets"], models=unknown)


def test_a_user_model_that_would_share_a_built_in_name_is_refused():
    config = validate_as(ManyModelsConfig, {"models": {"names": ["croston", "examples.croston"]}})
    with pytest.raises(ConfigError, match=r"croston and examples\.croston would both be called"):
        check(config)


def test_a_models_own_intervals_are_statsforecasts(tmp_path):
    """`backtest.intervals = "model"`: auto_ets's interval columns are statsforecast's own, on
    the same history; seasonal_naive (none of its own) gets pooled ones, here not honoured (one
    series, two windows: 2 errors where 80% needs 4)."""
    from shardwise.manymodel.evaluation.intervals import calibrate

    y = _multiplicative()
    backtest = {"horizon": 6, "n_windows": 2, "levels": [80], "intervals": "model"}
    _, tables = _job(tmp_path, {"a": y}, ["auto_ets", "seasonal_naive"], backtest=backtest)
    backtest = tables["backtest"].lazy()
    got = calibrate([backtest], [80], 2, "model", sources=lambda r: r)
    widths = got.series_widths(backtest)
    forecasts = got.forecast_bounds(tables["forecasts"].lazy(), widths).collect()
    final = forecasts.filter(pl.col("model") == "auto_ets").sort("step")
    own = AutoETS(season_length=12).fit(y).predict(h=6, level=[80])
    np.testing.assert_allclose(final["lo_80"].to_numpy(), own["lo-80"], rtol=1e-9)
    np.testing.assert_allclose(final["hi_80"].to_numpy(), own["hi-80"], rtol=1e-9)
    naive = forecasts.filter(pl.col("model") == "seasonal_naive")
    assert naive["lo_80"].is_null().all()
    # its own on the backtest too, from the first window on
    first = got.bounds(backtest, got.series_widths(backtest)).collect()
    first = first.filter((pl.col("window") == 0) & (pl.col("model") == "auto_ets"))
    assert first["lo_80"].is_not_null().all()


@pytest.mark.parametrize("refit", [False, 2])
def test_refit_false_or_k_updates_fits_as_statsforecasts_cross_validation_does(tmp_path, refit):
    """`backtest.refit = false` (or k) re-estimates the models on the first window (and every
    k-th) only and carries that fit through the longer histories of the others: the windows'
    forecasts equal statsforecast's `cross_validation(refit=...)`, and the forecast (the window
    after the last) is the last fit carried to every observation."""
    from statsforecast import StatsForecast
    from statsforecast.models import MSTL, AutoARIMA

    y = {"a": _multiplicative(), "b": _multiplicative()[::-1].copy()}
    names = ["auto_ets", "auto_theta", "mstl", "auto_arima"]
    _, tables = _job(tmp_path, y, names, backtest={"horizon": 6, "n_windows": 3, "refit": refit})
    assert tables["failures"].height == 0
    made = {
        "auto_ets": AutoETS(season_length=12),
        "auto_theta": AutoTheta(season_length=12),
        "mstl": MSTL(season_length=[12], trend_forecaster=AutoETS(model="ZZN")),
        "auto_arima": AutoARIMA(season_length=12),
    }
    df = pl.DataFrame(
        {
            "unique_id": np.repeat(["a", "b"], MONTHS),
            "ds": np.tile(np.arange(MONTHS), 2),
            "y": np.concatenate([y["a"], y["b"]]),
        }
    )
    cv = StatsForecast(models=list(made.values()), freq=1).cross_validation(
        df=df, h=6, n_windows=3, step_size=6, refit=refit
    )
    cv = pl.from_pandas(cv) if not isinstance(cv, pl.DataFrame) else cv
    backtest = tables["backtest"].sort("_series", "model", "window", "step")
    for series, uid in enumerate(("a", "b")):
        theirs = cv.filter(pl.col("unique_id") == uid).sort("ds")
        for label, model in made.items():
            ours = backtest.filter(pl.col("_series") == series, pl.col("model") == label)
            np.testing.assert_allclose(ours["forecast"], theirs[str(model)], rtol=1e-9)
        # the forecast: refit = 2 re-estimates on windows 0 and 2, false on 0; 3 is not fitted
        last_fit = 2 if refit == 2 else 0
        origin = MONTHS - 6 - 6 * (2 - last_fit)
        fitted = AutoETS(season_length=12).fit(y[uid][:origin])
        expected = fitted.forward(y=y[uid], h=6)["mean"]
        final = tables["forecasts"].filter(pl.col("_series") == series, model="auto_ets")
        np.testing.assert_allclose(final.sort("step")["forecast"], expected, rtol=1e-9)


def test_models_without_forward_are_fitted_again_under_refit_false(tmp_path):
    """Croston, TSB and ADIDA have no statsforecast `forward` to carry a fit with: under
    `backtest.refit = false` they are fitted again on every window, as under true."""
    y = {"a": _intermittent()}
    names = ["croston", "tsb", "adida"]
    backtest = {"horizon": 6, "n_windows": 3}
    _, carried = _job(tmp_path, y, names, backtest={**backtest, "refit": False})
    _, refitted = _job(tmp_path, y, names, backtest=backtest)
    assert carried["failures"].height == 0
    for name in ("backtest", "forecasts"):
        assert carried[name].equals(refitted[name]), name


def _form_changes() -> np.ndarray:
    """Level, then a trend from month 54 on: the forms auto_ets, auto_theta, mstl and auto_arima
    choose on the first window's rows (54) differ from those they choose on later ones."""
    rng = np.random.default_rng(1)
    flat = 100 + rng.normal(0, 1, 54)
    return np.r_[flat, 100 + 3.0 * np.arange(MONTHS - 54) + rng.normal(0, 1, MONTHS - 54)]


def _kept_form(label: str, first):
    """statsforecast's model in the form `first` (that model fitted on the first window) chose,
    its parameters free."""
    from statsforecast.models import ARIMA, MSTL

    def ets(components: str, **args) -> AutoETS:
        return AutoETS(model=components[:3], damped=components[3] == "D", **args)

    if label == "auto_ets":
        return ets(first.model_["components"], season_length=12)
    if label == "auto_theta":
        return AutoTheta(season_length=12, model=first.model_["modeltype"])
    if label == "mstl":
        return MSTL(
            season_length=[12], trend_forecaster=ets(first.trend_forecaster.model_["components"])
        )
    p, q, big_p, big_q, season, d, big_d = first.model_["arma"]
    coef = first.model_["coef"]
    return ARIMA(
        order=(p, d, q),
        season_length=season,
        seasonal_order=(big_p, big_d, big_q),
        include_mean="intercept" in coef,
        include_drift="drift" in coef,
    )


def test_reselect_false_keeps_the_first_windows_form_and_estimates_it_again(tmp_path):
    """`backtest.reselect = false`: each model chooses its form (ETS's error, trend and season,
    Theta's variant, MSTL's trend model, ARIMA's orders and constant) on the first window only;
    every later window and the forecast estimate that form's parameters on their own rows. The
    default chooses again each time, and on this series it chooses otherwise."""
    from statsforecast.models import MSTL, AutoARIMA

    y = _form_changes()
    names = ["auto_ets", "auto_theta", "mstl", "auto_arima"]
    backtest = {"horizon": 6, "n_windows": 3}
    _, kept = _job(tmp_path, {"a": y}, names, backtest={**backtest, "reselect": False})
    _, chosen = _job(tmp_path, {"a": y}, names, backtest=backtest)
    assert kept["failures"].height == 0
    full = {
        "auto_ets": AutoETS(season_length=12),
        "auto_theta": AutoTheta(season_length=12),
        "mstl": MSTL(season_length=[12], trend_forecaster=AutoETS(model="ZZN")),
        "auto_arima": AutoARIMA(season_length=12),
    }
    origins = (MONTHS - 18, MONTHS - 12, MONTHS - 6, MONTHS)  # the windows', then the forecast's
    for label, model in full.items():
        form = _kept_form(label, model.fit(y[: origins[0]]))
        windows = kept["backtest"].filter(model=label).sort("window", "step")["forecast"]
        forecast = kept["forecasts"].filter(model=label).sort("step")["forecast"]
        ours = np.r_[windows.to_numpy(), forecast.to_numpy()].reshape(4, 6)
        assert ours[0] == pytest.approx(_by_hand(model, y[: origins[0]], 6), rel=1e-9), label
        for w, origin in enumerate(origins[1:], start=1):
            assert ours[w] == pytest.approx(_by_hand(form, y[:origin], 6), rel=1e-9), (label, w)
        again = chosen["backtest"].filter(model=label, window=2).sort("step")["forecast"]
        assert np.abs(again.to_numpy() - ours[2]).max() > 1e-6, label  # chosen otherwise


def test_reselect_false_chooses_again_where_the_kept_form_cannot_be_fitted(tmp_path):
    """A multiplicative ETS form chosen on the first window cannot be fitted once the series
    has reached zero: that window chooses its form again rather than failing."""
    y = _multiplicative()
    y[MONTHS - 15] = 0.0  # in the second window's training rows, not the first's
    first = AutoETS(season_length=12).fit(y[: MONTHS - 18])
    assert first.model_["components"][0] == "M"
    backtest = {"horizon": 6, "n_windows": 3, "reselect": False}
    _, tables = _job(tmp_path, {"a": y}, ["auto_ets"], backtest=backtest)
    assert tables["failures"].height == 0
    second = tables["backtest"].filter(window=1).sort("step")["forecast"].to_numpy()
    expected = _by_hand(AutoETS(season_length=12), y[: MONTHS - 12], 6)
    np.testing.assert_allclose(second, expected, rtol=1e-9)


def test_the_history_a_statistical_model_is_given():
    """The target as float64 without its leading gap, inner gaps (null or NaN) filled linearly,
    a writable array of the series' own; a series without gaps (most) as it is."""
    from shardwise.manymodel.models.statistical import _history

    plain = _history(pl.DataFrame({"y": [1.0, 2.0, 4.0]}), "y")
    assert plain.tolist() == [1.0, 2.0, 4.0] and plain.dtype == np.float64
    plain[0] = 9.0  # the model may write to it: never the frame's memory
    assert _history(pl.DataFrame({"y": [1, 2, 4]}), "y").tolist() == [1.0, 2.0, 4.0]
    gaps = pl.DataFrame({"y": [None, float("nan"), 1.0, None, 3.0, float("nan"), 7.0]})
    assert _history(gaps, "y").tolist() == [1.0, 2.0, 3.0, 5.0, 7.0]
    with pytest.raises(ValueError, match="no observed values"):
        _history(pl.DataFrame({"y": [None, None]}, schema={"y": pl.Float64}), "y")
    with pytest.raises(ValueError, match="no observed values"):
        _history(pl.DataFrame({"y": []}, schema={"y": pl.Float64}), "y")
