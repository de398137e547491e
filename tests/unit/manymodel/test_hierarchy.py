"""Hierarchies: every level's sums become series, and hierarchicalforecast's reconcilers make the
forecasts of every level add up (to 1e-9)."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from polars.testing import assert_frame_equal

from helpers import HIERARCHY_LEVELS as LEVELS
from helpers import hierarchical_job
from shardwise.common.errors import ConfigError
from shardwise.manymodel.columns import FUTURE, SERIES, Columns
from shardwise.manymodel.data.long_table import load_series
from shardwise.manymodel.hierarchy.levels import incoherence, reconcile, unique_ids


def incoherent_forecasts(
    tmp_path, seed: int = 5
) -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame, Columns]:
    """The shops' hierarchy: its history, every series' forecasts of the six months after it
    (each made on its own, so they do not add up) and backtest forecasts of its last year."""
    table = load_series(hierarchical_job(tmp_path))
    history = table.frame.filter(~pl.col(FUTURE))
    future = table.frame.filter(pl.col(FUTURE)).select(SERIES, *table.columns.ids, "month")
    rng = np.random.default_rng(seed)
    last = history.group_by(SERIES).agg(pl.col("units").last().alias("last"))
    forecasts = future.join(last, on=SERIES).with_columns(
        (pl.col("last") * pl.Series(rng.uniform(0.8, 1.2, future.height))).alias("forecast")
    )
    recent = history.filter(pl.col("month") > history["month"].max() - pl.duration(days=365))
    noise = pl.Series(rng.normal(0, 2, recent.height))
    past = recent.select(SERIES, "month", (pl.col("units") + noise).alias("forecast"))
    return history, forecasts, past, table.columns


def test_every_level_is_the_sum_of_the_series_below_it(tmp_path):
    table = load_series(hierarchical_job(tmp_path))
    # 6 shops, 4 regions, 2 states, the total
    assert table.num_series == 6 + 4 + 2 + 1
    observed = table.frame.filter(~pl.col(FUTURE))
    shops = observed.drop_nulls("shop")
    total = observed.filter(pl.col("state").is_null()).sort("month")
    sums = shops.group_by("month").agg(pl.col("units").sum()).sort("month")
    np.testing.assert_allclose(total["units"], sums["units"], rtol=1e-12)
    north = observed.filter(pl.col("region") == "north", pl.col("shop").is_null())
    assert north.height == 60
    # every series has its future rows, aggregates included
    assert table.frame.filter(pl.col(FUTURE)).height == 13 * 6


def test_every_reconciler_makes_incoherent_forecasts_add_up(tmp_path):
    history, forecasts, _, columns = incoherent_forecasts(tmp_path, seed=2)
    methods = ["bottom_up", "top_down", "mint_ols", "mint_wls_struct"]
    reconciled = reconcile(forecasts, history, columns, LEVELS, methods)
    assert reconciled.height == 13 * 6
    assert incoherence(reconciled, "base", columns, LEVELS) > 1e-3
    for method in methods:
        assert incoherence(reconciled, method, columns, LEVELS) < 1e-9, method
    shops = reconciled.drop_nulls("shop")
    np.testing.assert_allclose(shops["bottom_up"], shops["base"], rtol=1e-12)
    top = reconciled.filter(pl.col("state").is_null())
    np.testing.assert_allclose(top["top_down"], top["base"], rtol=1e-12)


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"hierarchy": {"levels": [["country"]]}}, r"names 'country', which is not one of data"),
        (
            {"hierarchy": {"levels": [["state", "region", "shop"]]}},
            r"that is not all of them \(the bottom level is data.id_columns\)",
        ),
        (
            {"features": {"group_by": [["state"]]}},
            r"group_by cannot be combined with hierarchy.levels",
        ),
    ],
)
def test_a_hierarchy_that_cannot_be_built_is_one_line(tmp_path, sections, message):
    with pytest.raises(ConfigError, match=message):
        load_series(hierarchical_job(tmp_path, **sections))


def test_series_that_end_apart_cannot_form_a_hierarchy(tmp_path):
    config = hierarchical_job(tmp_path)
    frame = pl.read_csv(config.data.source)
    cut = frame.filter(~((pl.col("shop") == "s6") & (pl.col("month") >= "2019-12-01")))
    cut.write_csv(config.data.source)
    with pytest.raises(ConfigError, match=r"the series end at 2 different timestamps"):
        load_series(config)


def test_error_weighted_mint_moves_the_series_forecast_worst_before(tmp_path):
    """mint_wls_var and mint_shrink weigh each series by its errors on the backtest windows
    (`past`): a shop forecast almost exactly there keeps its forecast, one forecast badly takes
    most of the correction. Both add up; without `past` they cannot run."""
    history, forecasts, _, columns = incoherent_forecasts(tmp_path, seed=3)
    rng = np.random.default_rng(3)
    recent = history.filter(pl.col("month") > history["month"].max() - pl.duration(days=365))
    noise = pl.when(pl.col("shop") == "s1").then(0.01).when(pl.col("shop") == "s2").then(10.0)
    error = noise.otherwise(1.0) * pl.Series(rng.normal(0, 1, recent.height))
    past = recent.select(SERIES, "month", (pl.col("units") + error).alias("forecast"))
    methods = ["mint_wls_var", "mint_shrink"]
    reconciled = reconcile(forecasts, history, columns, LEVELS, methods, past)
    for method in methods:
        assert incoherence(reconciled, method, columns, LEVELS) < 1e-9, method
        moved = reconciled.with_columns((pl.col(method) - pl.col("base")).abs().alias("moved"))
        s1 = moved.filter(pl.col("shop") == "s1")["moved"].mean()
        s2 = moved.filter(pl.col("shop") == "s2")["moved"].mean()
        assert s1 < 0.01 * s2, (method, s1, s2)
    with pytest.raises(ValueError, match=r"these reconcilers need the backtest forecasts"):
        reconcile(forecasts, history, columns, LEVELS, methods)


def test_a_method_that_cannot_run_is_reported_and_the_others_written(tmp_path):
    """Backtest forecasts without errors leave MinTrace nothing to weigh by: mint_shrink
    refuses them (hierarchicalforecast: "residuals close to 0"). The run says so in one line
    and still writes the other methods' reconciled forecasts."""
    from rich.console import Console

    from shardwise.manymodel.hierarchy.reconciliation import _reconcile, series_paths

    config = hierarchical_job(tmp_path, hierarchy={"methods": ["bottom_up", "mint_shrink"]})
    config.run_dir.mkdir(parents=True)
    table = load_series(config)
    history = table.frame.filter(~pl.col(FUTURE))
    future = table.frame.filter(pl.col(FUTURE)).select(SERIES, *table.columns.ids, "month")
    last = history.group_by(SERIES).agg(pl.col("units").last().alias("forecast"))
    forecasts = future.join(last, on=SERIES)
    exact = history.select(SERIES, "month", pl.col("units").alias("forecast"))
    console = Console(record=True, width=200)
    _reconcile(config, table, series_paths(config, table), (forecasts, exact), None, console)
    said = console.export_text()
    assert "hierarchy.methods: mint_shrink failed: Exception: Insample residuals close to 0" in said
    written = pl.read_parquet(config.run_dir / "forecasts_reconciled.parquet")
    assert "bottom_up" in written.columns and "mint_shrink" not in written.columns
    assert "largest gap to the sum of the series below: bottom_up" in said


def test_reconcilers_are_scored_on_the_windows_after_the_first(tmp_path):
    """The backtest's forecasts of each window are reconciled with the history before it and
    scored per series, at every level; with an error-weighted method every method starts at the
    second window (the first has no earlier errors). Exact forecasts stay exact."""
    from rich.console import Console

    from shardwise.manymodel.hierarchy.reconciliation import _score, series_paths

    config = hierarchical_job(
        tmp_path,
        backtest={"horizon": 6, "n_windows": 3},
        hierarchy={"methods": ["bottom_up", "mint_shrink"]},
    )
    config.run_dir.mkdir(parents=True)
    table = load_series(config)
    observed = table.frame.filter(~pl.col(FUTURE))
    last = observed["month"].max()
    window = (  # windows 0, 1, 2: the last 18 months, 6 each; forecasts without error
        pl.when(pl.col("month") > last - pl.duration(days=6 * 30)).then(2)
        .when(pl.col("month") > last - pl.duration(days=12 * 30)).then(1)
        .when(pl.col("month") > last - pl.duration(days=18 * 30)).then(0)
    )  # fmt: skip
    rows = observed.select(
        SERIES, window.alias("window"), "month", pl.col("units").alias("forecast"), "units"
    ).drop_nulls("window")
    assert rows.group_by("window").len()["len"].to_list() == [13 * 6] * 3
    console = Console(record=True, width=200)
    _score(config, table, series_paths(config, table), rows, console)
    assert "reconciled: backtest MASE, windows 1, 2" in console.export_text()
    scores = pl.read_parquet(config.run_dir / "reconciled_metrics.parquet")
    assert scores["window"].unique().sort().to_list() == [1, 2]
    assert set(scores["method"]) == {"base", "bottom_up", "mint_shrink"}
    assert scores.height == 2 * 13 * 3
    assert scores["mae"].max() < 1e-9


def test_overlapping_windows_give_mint_one_error_per_row(tmp_path):
    """With `backtest.step` shorter than the horizon the windows overlap, so a row has several
    backtest forecasts: MinTrace takes the latest window's, and every method still reconciles
    and is scored."""
    from rich.console import Console

    from shardwise.manymodel.hierarchy.reconciliation import (
        _reconcile,
        _score,
        latest,
        series_paths,
    )

    config = hierarchical_job(tmp_path, backtest={"horizon": 6, "n_windows": 3, "step": 3})
    config.run_dir.mkdir(parents=True)
    table = load_series(config)
    observed = table.frame.filter(~pl.col(FUTURE))
    rng = np.random.default_rng(4)
    windows = []
    for window in range(3):
        start = 60 - 6 - 3 * (2 - window)
        part = observed.filter(pl.int_range(pl.len()).over(SERIES).is_between(start, start + 5))
        noise = pl.Series(rng.normal(0, 1, part.height))
        windows.append(
            part.select(
                SERIES,
                pl.lit(window).alias("window"),
                "month",
                (pl.col("units") + noise).alias("forecast"),
                "units",
            )
        )
    rows = pl.concat(windows).sort(SERIES, "month", "window")
    assert rows.height > rows.unique([SERIES, "month"]).height  # overlapping
    past = latest(rows, "month")
    assert past.height == past.unique([SERIES, "month"]).height == 13 * 12
    future = table.frame.filter(pl.col(FUTURE)).select(SERIES, *table.columns.ids, "month")
    last = observed.group_by(SERIES).agg(pl.col("units").last().alias("forecast"))
    console = Console(record=True, width=200)
    paths = series_paths(config, table)
    _reconcile(config, table, paths, (future.join(last, on=SERIES), past), None, console)
    _score(config, table, paths, rows, console)
    assert "failed" not in console.export_text()
    written = pl.read_parquet(config.run_dir / "forecasts_reconciled.parquet")
    assert set(config.hierarchy.methods) <= set(written.columns)
    scores = pl.read_parquet(config.run_dir / "reconciled_metrics.parquet")
    assert set(scores["method"]) == {"base", *config.hierarchy.methods}


def test_one_window_cannot_score_mint_shrink_and_says_so(tmp_path):
    from rich.console import Console

    from shardwise.manymodel.hierarchy.reconciliation import _score, series_paths

    config = hierarchical_job(tmp_path, backtest={"horizon": 6, "n_windows": 1})
    config.run_dir.mkdir(parents=True)
    table = load_series(config)
    rows = table.frame.filter(~pl.col(FUTURE)).select(
        SERIES, pl.lit(0).alias("window"), "month", pl.col("units").alias("forecast"), "units"
    )
    console = Console(record=True, width=200)
    _score(config, table, series_paths(config, table), rows, console)
    assert "need an earlier window's errors; use backtest.n_windows ≥ 2" in console.export_text()
    assert not (config.run_dir / "reconciled_metrics.parquet").exists()


def closed_forms(
    reconciled: pl.DataFrame, history: pl.DataFrame, past: pl.DataFrame, ids: list[str]
) -> dict[str, np.ndarray]:
    """MinTrace's forecasts (series × months, in series order) from its formula,
    S (S' W⁻¹ S)⁻¹ S' W⁻¹ ŷ, with W the identity (ols), each series' number of bottom series
    (wls_struct) or its backtest errors' mean square (wls_var); and top-down's, each shop's average
    share of the total times the total's forecast."""
    reconciled = reconciled.sort(SERIES, "month")
    series = reconciled.select(SERIES, *ids).unique(SERIES).sort(SERIES)
    shops = series.drop_nulls(ids)
    summing = np.array(
        [
            [
                all(row[c] is None or row[c] == shop[c] for c in ids)
                for shop in shops.iter_rows(named=True)
            ]
            for row in series.iter_rows(named=True)
        ],
        dtype=np.float64,
    )
    base = reconciled["base"].to_numpy().reshape(series.height, -1)
    errors = (
        history.join(past, on=[SERIES, "month"])
        .group_by(SERIES)
        .agg(((pl.col("units") - pl.col("forecast")) ** 2).mean().alias("square"))
    )
    square = errors.sort(SERIES)["square"].to_numpy()
    forms = {}
    for method, weights in [
        ("mint_ols", np.ones(series.height)),
        ("mint_wls_struct", summing.sum(axis=1)),
        ("mint_wls_var", square),
    ]:
        inverse = np.diag(1 / weights)
        gain = summing.T @ inverse
        forms[method] = summing @ np.linalg.solve(gain @ summing, gain @ base)
    total = series[SERIES][int(np.flatnonzero(summing.sum(axis=1) == shops.height)[0])]
    y = history.pivot("month", index=SERIES, values="units").sort(SERIES).drop(SERIES).to_numpy()
    is_shop = series.select(pl.all_horizontal(pl.col(ids).is_not_null())).to_series().to_numpy()
    shares = (y[is_shop] / y[total]).mean(axis=1)
    forms["top_down"] = summing @ (shares[:, None] * base[total])
    return forms


def test_the_reconcilers_give_their_formulas(tmp_path):
    """A hierarchy of up to DENSE_UP_TO series is reconciled with dense matrices: MinTrace's and
    top-down's forecasts are their closed forms, to 1e-7."""
    history, forecasts, past, columns = incoherent_forecasts(tmp_path)
    methods = ["top_down", "mint_ols", "mint_wls_struct", "mint_wls_var"]
    reconciled = reconcile(forecasts, history, columns, LEVELS, methods, past)
    forms = closed_forms(reconciled, history, past, list(columns.ids))
    ordered = reconciled.sort(SERIES, "month")
    for method in methods:
        got = ordered[method].to_numpy().reshape(forms[method].shape)
        np.testing.assert_allclose(got, forms[method], rtol=1e-7, err_msg=method)


def test_above_dense_up_to_the_sparse_forms_reconcile_as_closely(tmp_path, monkeypatch):
    """Above DENSE_UP_TO series bottom_up, top_down, mint_ols and mint_wls_struct run on the
    sparse summing matrix: bottom-up and top-down give the dense forecasts exactly, MinTrace's
    iterative solve comes within 1e-3 of its formula (not exactly: the sparse form ran), and
    every level still adds up to 1e-9. The error-weighted methods stay dense (DENSE_ONLY)."""
    from shardwise.manymodel.hierarchy import levels as hierarchy

    history, forecasts, past, columns = incoherent_forecasts(tmp_path)
    methods = list(hierarchy._CLASSES)
    dense = reconcile(forecasts, history, columns, LEVELS, methods, past).sort(SERIES, "month")
    monkeypatch.setattr(hierarchy, "DENSE_UP_TO", 5)  # the shops' hierarchy has 13 series
    sparse = reconcile(forecasts, history, columns, LEVELS, methods, past).sort(SERIES, "month")
    for method in methods:
        assert incoherence(sparse, method, columns, LEVELS) < 1e-9, method
    for method in ("bottom_up", "top_down", "mint_wls_var", "mint_shrink"):
        np.testing.assert_allclose(sparse[method], dense[method], rtol=1e-12, err_msg=method)
    forms = closed_forms(sparse, history, past, list(columns.ids))
    for method in ("mint_ols", "mint_wls_struct"):
        got = sparse[method].to_numpy().reshape(forms[method].shape)
        np.testing.assert_allclose(got, forms[method], rtol=1e-3, err_msg=method)
    assert np.abs(sparse["mint_ols"].to_numpy() - dense["mint_ols"].to_numpy()).max() > 0


def test_dense_methods_that_cannot_fit_in_memory_are_an_error_before_the_run(tmp_path, monkeypatch):
    """mint_shrink and mint_wls_var hold n × n matrices: 20,000 series need about 18 GiB, a
    one-line error with 8 GiB free. load_series checks, before any model runs."""
    from shardwise.manymodel.hierarchy import levels as hierarchy

    with pytest.raises(
        ConfigError, match=r"mint_wls_var and mint_shrink would hold 20000 × 20000 matrices"
    ):
        hierarchy.check_methods(["bottom_up", "mint_wls_var", "mint_shrink"], 20_000, 8 * 2**30)
    hierarchy.check_methods(["mint_shrink"], 20_000, free=64 * 2**30)
    hierarchy.check_methods(["bottom_up", "mint_ols", "mint_wls_struct"], 20_000, 8 * 2**30)
    load_series(hierarchical_job(tmp_path))  # 13 series: the default methods fit here
    monkeypatch.setattr(hierarchy, "DENSE_BYTES_PER_PAIR", 2**50)
    with pytest.raises(ConfigError, match=r"mint_shrink would hold 13 × 13 matrices"):
        load_series(hierarchical_job(tmp_path))


def test_only_the_methods_that_read_the_history_are_handed_it(tmp_path):
    """Bottom-up and MinTrace's ols and structural forms depend on the forecasts and the
    hierarchy alone, so hierarchicalforecast is not handed the history for them (16 M rows at
    100,000 series, which it walks in Python): they reconcile the same without it. Top-down's
    proportions do read it."""
    history, forecasts, _, columns = incoherent_forecasts(tmp_path)
    ids = list(columns.ids)
    paths = unique_ids(history.select(SERIES, *ids).unique(SERIES), ids, LEVELS)
    methods = ["bottom_up", "mint_ols", "mint_wls_struct"]
    full = reconcile(forecasts, history, columns, LEVELS, methods, paths=paths)
    without = reconcile(forecasts, history.clear(), columns, LEVELS, methods, paths=paths)
    assert_frame_equal(without, full)
    with pytest.raises(ValueError, match="unique_ids in Y_hat_df that are not in Y_df"):
        reconcile(forecasts, history.clear(), columns, LEVELS, ["top_down"], paths=paths)


def test_the_reconciled_scores_scale_each_series_as_the_backtest_does():
    """MASE's scale for the reconciled scores, for every series at once, equals the backtest's
    (`seasonal_mae`, one series at a time): missing values skipped, a series no longer than a
    season scaled by lag 1, one with no difference at all NaN."""
    from shardwise.manymodel.evaluation.backtest import seasonal_mae
    from shardwise.manymodel.hierarchy.reconciliation import _seasonal_naive_mae

    rng = np.random.default_rng(7)
    values = {
        0: rng.normal(10, 3, 30),
        1: np.r_[rng.normal(5, 1, 9), np.nan, rng.normal(5, 1, 10)],  # a NaN
        2: rng.normal(0, 1, 4),  # no longer than the season: lag 1
        3: np.array([2.0]),  # no difference: NaN
        4: np.full(14, 3.0),  # constant: 0
    }
    history = pl.DataFrame(
        {
            SERIES: np.concatenate([[k] * len(v) for k, v in values.items()]),
            "month": np.concatenate([np.arange(len(v)) for v in values.values()]),
            "units": np.concatenate(list(values.values())),
        }
    ).with_columns(
        pl.when(pl.col(SERIES) == 0, pl.col("month") == 3)
        .then(None)
        .otherwise("units")
        .alias("units")
    )
    columns = Columns(ids=("shop",), timestamp="month", target="units", covariates=())
    scale = dict(_seasonal_naive_mae(history, columns, 6).iter_rows())
    for series, part in history.partition_by(SERIES, as_dict=True).items():
        expected = seasonal_mae(part["units"].to_numpy().astype(np.float64), 6)
        np.testing.assert_allclose(scale[series[0]], expected, rtol=1e-12, equal_nan=True)
    assert set(scale) == set(values)
