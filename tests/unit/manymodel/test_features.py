"""The polars feature engine against a brute-force reference, and the no-leakage property."""

from __future__ import annotations

import dataclasses
import math
from datetime import date

import numpy as np
import polars as pl
import pytest

from shardwise.manymodel.columns import Columns
from shardwise.manymodel.features.spec import FeatureSpec, polars_features

COLUMNS = Columns(ids=("store", "item"), timestamp="ts", target="y", covariates=())
SPEC = FeatureSpec(
    lags=(2, 3),
    shift=2,
    rolling_windows=(3,),
    rolling_stats=("mean", "std", "min", "max"),
    expanding_stats=("mean", "std", "min", "max"),
    calendar=("month", "quarter", "year"),
    group_by=(("store",),),
    group_stats=("mean", "std", "max"),
)


def series_table(seed: int = 0) -> pl.DataFrame:
    """Four series in two stores, different lengths and starts, one empty target inside."""
    rng = np.random.default_rng(seed)
    rows = []
    for store, item, start, length in [
        ("a", "1", 0, 14),
        ("a", "2", 3, 9),
        ("b", "1", 1, 12),
        ("b", "2", 0, 5),
    ]:
        for k in range(length):
            m = start + k
            value = float(rng.normal(1000, 50))
            rows.append(
                {
                    "store": store,
                    "item": item,
                    "ts": date(2020 + m // 12, m % 12 + 1, 1),
                    "y": value,
                }
            )
    frame = pl.DataFrame(rows)
    return frame.with_columns(
        pl.when(
            (pl.col("store") == "a") & (pl.col("item") == "1") & (pl.col("ts") == date(2020, 6, 1))
        )
        .then(None)
        .otherwise(pl.col("y"))
        .alias("y")
    )


def _stat(values: list[float], stat: str) -> float | None:
    if stat == "std":
        return float(np.std(values, ddof=1)) if len(values) > 1 else None
    return {"mean": np.mean, "min": np.min, "max": np.max}[stat](values) if values else None


def reference(frame: pl.DataFrame, spec: FeatureSpec) -> pl.DataFrame:
    """Each feature computed row by row from its definition."""
    frame = frame.sort("store", "item", "ts")
    shifted: dict[tuple[str, str, date], float | None] = {}
    out = []
    for (store, item), part in frame.group_by(["store", "item"], maintain_order=True):
        y = part["y"].to_list()
        months = part["ts"].to_list()
        s = [y[i - spec.shift] if i >= spec.shift else None for i in range(len(y))]
        for i, month in enumerate(months):
            shifted[(store, item, month)] = s[i]
            row = {"store": store, "item": item, "ts": month}
            for k in spec.lags:
                row[f"lag{k}"] = y[i - k] if i >= k else None
            for w in spec.rolling_windows:
                window = [v for v in s[max(0, i - w + 1) : i + 1] if v is not None]
                full = i >= w - 1 and len(window) == w
                for stat in spec.rolling_stats:
                    row[f"roll{w}_{stat}"] = _stat(window, stat) if full else None
            seen = [v for v in s[: i + 1] if v is not None]
            for stat in spec.expanding_stats:
                row[f"expanding_{stat}"] = _stat(seen, stat)
            out.append(row)
    ref = pl.DataFrame(out, infer_schema_length=None)
    groups = []
    for row in ref.iter_rows(named=True):
        same = [
            v
            for (st, _, m), v in shifted.items()
            if st == row["store"] and m == row["ts"] and v is not None
        ]
        groups.append({f"store_{stat}": _stat(same, stat) for stat in spec.group_stats})
    return pl.concat([ref, pl.DataFrame(groups, infer_schema_length=None)], how="horizontal")


def test_features_match_their_definitions():
    frame = series_table()
    got = polars_features(frame, SPEC, COLUMNS)
    ref = reference(frame, SPEC)
    assert got.height == frame.height
    assert got["ts"].to_list() == ref["ts"].to_list()
    for name in SPEC.columns():
        if name.startswith("cal_"):
            continue
        a, b = got[name].to_list(), ref[name].to_list()
        for x, r in zip(a, b, strict=True):
            if r is None:
                assert x is None, name
            else:
                assert x is not None and math.isclose(x, r, rel_tol=1e-9, abs_tol=1e-9), (
                    name,
                    x,
                    r,
                )
    assert got["cal_month"].to_list() == [t.month for t in got["ts"]]
    assert got["cal_quarter"].to_list() == [(t.month - 1) // 3 + 1 for t in got["ts"]]
    assert got["cal_year"].to_list() == [t.year for t in got["ts"]]


@pytest.mark.parametrize("cut", [date(2020, 4, 1), date(2020, 9, 1), date(2021, 1, 1)])
def test_no_feature_reads_the_present_or_future(cut):
    """Replace every target at or after `cut` (in all series) with noise: no feature of any row at
    or before `cut` may change, for rows at `cut` included. Lags and windows here are as short as
    they may be (shift = the horizon of 1 step), the tightest case."""
    spec = FeatureSpec(
        lags=(1, 2),
        shift=1,
        rolling_windows=(2, 3),
        rolling_stats=("mean", "std", "min", "max"),
        expanding_stats=("mean", "std", "min", "max"),
        calendar=("month",),
        group_by=(("store",), ("store", "item")),
        group_stats=("mean", "std", "min", "max"),
    )
    frame = series_table()
    noise = pl.Series(np.random.default_rng(1).normal(0, 1e6, frame.height))
    changed = frame.with_columns(
        pl.when(pl.col("ts") >= cut).then(noise).otherwise(pl.col("y")).alias("y")
    )
    before = polars_features(frame, spec, COLUMNS).filter(pl.col("ts") <= cut)
    after = polars_features(changed, spec, COLUMNS).filter(pl.col("ts") <= cut)
    features = spec.columns()
    assert before.select(features).equals(after.select(features))
    # and the perturbation is visible after the cut, so the test can fail
    later_before = polars_features(frame, spec, COLUMNS).filter(pl.col("ts") > cut)
    later_after = polars_features(changed, spec, COLUMNS).filter(pl.col("ts") > cut)
    assert not later_before.select(features).equals(later_after.select(features))


def test_reach_counts_rows_without_complete_features():
    spec = dataclasses.replace(SPEC, group_by=())  # a group's std needs a second series
    got = polars_features(series_table(), spec, COLUMNS)
    got = got.filter((pl.col("store") == "b") & (pl.col("item") == "1"))
    complete = got.select(spec.columns()).with_row_index().drop_nulls()
    assert complete["index"][0] == spec.reach() == 4  # shift 2 + rolling window 3 - 1
