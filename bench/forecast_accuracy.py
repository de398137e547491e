"""Forecast accuracy on fpp3's us_employment (issue 19's protocol), against statsforecast's own
cross-validation run in the same process as the reference.

Protocol: 148 monthly series; horizon 12; 3 rolling windows 12 apart (the last ends at the last
observation); MASE scaled by the in-sample seasonal naive (m = 12) of each window's training
rows; mean over windows, then over series. shardwise runs the whole many-models job (backtest,
nested selection, refit of every model, forecast) through its Ray runner; statsforecast runs
`cross_validation` of the same models (backtest only: less work) with `n_jobs` = the cores, then
`forecast` (what its user runs for the same outputs: the backtest and the forecasts).
`--refit` sets both sides' refit (shardwise's `backtest.refit`, statsforecast's `refit`): with
`false` each model is fitted once per series and carried through the later windows.
`--reselect false` sets shardwise's `backtest.reselect`: its models choose their form (ETS
components, Theta variant, ARIMA orders) on the first window and estimate that form again on the
later ones; statsforecast's cross-validation has no such setting and chooses again every time.

Reported: each model's mean MASE and sMAPE in both; shardwise's nested scores (each series'
choice, the ensemble of its top k, and the one model best over all series, each chosen on the
windows before the one it is scored on: windows 2 and 3) next to the same windows' scores of
statsforecast's AutoETS; the wall time of both and their ratio.

    python bench/forecast_accuracy.py                       # about 6 minutes on 2 cores
    python bench/forecast_accuracy.py --models seasonal_naive,auto_ets,auto_theta,mstl,auto_arima
    python bench/forecast_accuracy.py --refit false
    python bench/forecast_accuracy.py --reselect false
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import polars as pl

from shardwise.common.job_files import validate_as
from shardwise.manymodel.columns import FUTURE
from shardwise.manymodel.config import ManyModelsConfig
from shardwise.manymodel.data.long_table import load_series
from shardwise.manymodel.evaluation.backtest import refits
from shardwise.manymodel.run.runner import run

HORIZON, WINDOWS, SEASON = 12, 3, 12
ID = "series_id"
"""us_employment's series column in the output tables."""


def statsforecast_models(names: list[str]) -> dict[str, object]:
    from statsforecast.models import MSTL, AutoARIMA, AutoETS, AutoTheta, SeasonalNaive

    made = {
        "seasonal_naive": lambda: SeasonalNaive(season_length=SEASON),
        "auto_ets": lambda: AutoETS(season_length=SEASON),
        "auto_theta": lambda: AutoTheta(season_length=SEASON),
        "auto_arima": lambda: AutoARIMA(season_length=SEASON),
        "mstl": lambda: MSTL(season_length=[SEASON], trend_forecaster=AutoETS(model="ZZN")),
    }
    return {name: made[name]() for name in names if name in made}


def shardwise_run(
    names: list[str], top_k: int, refit: bool | int, reselect: bool, run_dir: Path
) -> tuple[pl.DataFrame, float]:
    config = validate_as(
        ManyModelsConfig,
        {
            "job": {"name": "forecast-accuracy", "run_dir": str(run_dir)},
            "data": {"source": "us_employment"},
            "models": {"names": names},
            "backtest": {
                "horizon": HORIZON,
                "n_windows": WINDOWS,
                "metric": "mase",
                "ensemble_top_k": top_k,
                "refit": refit,
                "reselect": reselect,
            },
            "tracking": {"mlflow": False},
        },
    )
    began = time.perf_counter()
    summary = run(config)
    seconds = time.perf_counter() - began
    print(f"shardwise: forecasts use {summary.selection.strategy}")
    return pl.read_parquet(run_dir / "backtest_metrics.parquet"), seconds


def statsforecast_cv(
    names: list[str], cores: int, refit: bool | int
) -> tuple[pl.DataFrame, float, float]:
    """statsforecast's cross-validation of the same models, scored with the same MASE; its
    seconds, and those of its forecast with the same models after it."""
    from statsforecast import StatsForecast

    config = validate_as(ManyModelsConfig, {"data": {"source": "us_employment"}})
    table = load_series(config)
    ts = table.columns.timestamp
    observed = table.frame.filter(~pl.col(FUTURE)).select(
        pl.col(ID).alias("unique_id"),
        pl.col(ts).cast(pl.Datetime).alias("ds"),
        pl.col(table.columns.target).cast(pl.Float64).alias("y"),
    )
    models = statsforecast_models(names)
    began = time.perf_counter()
    sf = StatsForecast(models=list(models.values()), freq="1mo", n_jobs=cores)
    cv = sf.cross_validation(
        df=observed, h=HORIZON, n_windows=WINDOWS, step_size=HORIZON, refit=refit
    )
    seconds = time.perf_counter() - began
    began = time.perf_counter()
    sf.forecast(df=observed, h=HORIZON)
    forecast_seconds = time.perf_counter() - began
    cv = pl.from_pandas(cv) if not isinstance(cv, pl.DataFrame) else cv
    columns = {str(m): name for name, m in models.items()}
    rows = []
    history = {
        k: g.sort("ds") for (k,), g in observed.partition_by("unique_id", as_dict=True).items()
    }
    for (uid, cutoff), group in cv.partition_by(["unique_id", "cutoff"], as_dict=True).items():
        past = history[uid].filter(pl.col("ds") <= cutoff)["y"].to_numpy()
        scale = float(np.mean(np.abs(past[SEASON:] - past[:-SEASON])))
        actual = group["y"].to_numpy()
        for column, name in columns.items():
            predicted = group[column].to_numpy()
            error = np.abs(actual - predicted)
            denom = np.abs(actual) + np.abs(predicted)
            smape = 200 * np.mean(
                np.divide(error, denom, out=np.zeros_like(error), where=denom > 0)
            )
            rows.append(
                {
                    ID: uid,
                    "model": name,
                    "cutoff": cutoff,
                    "mase": error.mean() / scale,
                    "smape": smape,
                }
            )
    scores = pl.DataFrame(rows).with_columns(
        (pl.col("cutoff").rank("dense").over(ID) - 1).cast(pl.Int64).alias("window")
    )
    return scores, seconds, forecast_seconds


def fits(refit: bool | int, windows: int) -> int:
    """Fits per model and series when `windows` windows are counted as statsforecast does."""
    return sum(refits(int(refit), w) for w in range(windows))


def mean_over_windows_then_series(metrics: pl.DataFrame, windows: list[int]) -> pl.DataFrame:
    return (
        metrics.filter(pl.col("window").is_in(windows))
        .group_by(ID, "model")
        .agg(pl.col("mase", "smape").mean())
        .group_by("model")
        .agg(pl.col("mase", "smape").mean(), pl.len().alias("series"))
        .sort("mase")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="seasonal_naive,auto_ets,auto_theta,mstl")
    parser.add_argument("--top-k", type=int, default=2, help="backtest.ensemble_top_k")
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--refit", default="true", help="true, false or k: both sides' refit (backtest.refit)"
    )
    parser.add_argument(
        "--reselect",
        default="true",
        choices=["true", "false"],
        help="shardwise's backtest.reselect",
    )
    args = parser.parse_args()
    names = args.models.split(",")
    named = {"true": True, "false": False}
    refit = named[args.refit.lower()] if args.refit.lower() in named else int(args.refit)
    reselect = named[args.reselect]
    with tempfile.TemporaryDirectory() as tmp:
        ours, ours_s = shardwise_run(names, args.top_k, refit, reselect, Path(tmp) / "run")
    theirs, theirs_s, forecast_s = statsforecast_cv(names, args.cores, refit)
    pl.Config.set_tbl_rows(30)
    print("\nmean MASE / sMAPE over windows 1–3, then series (shardwise | statsforecast CV):")
    all_windows = list(range(WINDOWS))
    both = mean_over_windows_then_series(ours, all_windows).join(
        mean_over_windows_then_series(theirs, all_windows),
        on="model",
        how="left",
        suffix="_statsforecast",
    )
    print(both)
    held = list(range(1, WINDOWS))
    print("\nnested (chosen on earlier windows), scored on windows 2–3 only:")
    nested = mean_over_windows_then_series(ours, held)
    print(nested)
    reference = mean_over_windows_then_series(theirs, held).filter(pl.col("model") == "auto_ets")
    print("statsforecast AutoETS on windows 2–3:", f"{reference['mase'][0]:.3f}")
    chosen = nested.filter(pl.col("model") == "selected")["mase"][0]
    print(
        f"\nchosen per series (nested) mean MASE {chosen:.3f}; target < 0.38 "
        f"({'met' if chosen < 0.38 else 'NOT met'})"
    )
    ours_fits, cv_fits = fits(refit, WINDOWS + 1), fits(refit, WINDOWS)
    print(
        f"refit = {args.refit}: shardwise fits each model {ours_fits}× per series (the windows "
        f"and the forecast), statsforecast's CV {cv_fits}× and its forecast 1× more"
        + ("" if reselect else "; shardwise chooses each model's form on the first fit only")
        + "\n"
        f"wall time: shardwise {ours_s:.1f} s (backtest, nested selection, forecast); "
        f"statsforecast CV {theirs_s:.1f} s (backtest only): ratio {theirs_s / ours_s:.2f}×; "
        f"CV + forecast {theirs_s + forecast_s:.1f} s (the same outputs): ratio "
        f"{(theirs_s + forecast_s) / ours_s:.2f}× (> 1: shardwise faster)"
    )


if __name__ == "__main__":
    main()
