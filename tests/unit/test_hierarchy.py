"""Hierarchies: every level's sums become series, and hierarchicalforecast's reconcilers make the
forecasts of every level add up (to 1e-9)."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from helpers import HIERARCHY_LEVELS as LEVELS
from helpers import hierarchical_job
from shardwise.config import ConfigError
from shardwise.manymodel.data import FUTURE, SERIES, load_series
from shardwise.manymodel.hierarchy import incoherence, reconcile


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
    table = load_series(hierarchical_job(tmp_path))
    history = table.frame.filter(~pl.col(FUTURE))
    future = table.frame.filter(pl.col(FUTURE)).select(SERIES, *table.columns.ids, "month")
    rng = np.random.default_rng(2)
    last = history.group_by(SERIES).agg(pl.col("units").last().alias("last"))
    forecasts = future.join(last, on=SERIES).with_columns(  # each series forecast on its own
        (pl.col("last") * pl.Series(rng.uniform(0.8, 1.2, future.height))).alias("forecast")
    )
    methods = ["bottom_up", "top_down", "mint_ols", "mint_wls_struct"]
    reconciled = reconcile(forecasts, history, table.columns, LEVELS, methods)
    assert reconciled.height == 13 * 6
    assert incoherence(reconciled, "base", table.columns, LEVELS) > 1e-3
    for method in methods:
        assert incoherence(reconciled, method, table.columns, LEVELS) < 1e-9, method
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
