"""Hierarchies (`[hierarchy]`): the bottom series (one per data.id_columns) are summed into every
level named in `hierarchy.levels` and into the total, every series of every level is forecast
like any other, and the forecasts are reconciled by hierarchicalforecast so that every level adds
up (BottomUp, TopDown by average historical proportions, MinTrace with OLS or structural
weights, and MinTrace weighted by the forecasts' own errors: their variances, `mint_wls_var`, or
their shrunk covariance, `mint_shrink`).

MinTrace's error-weighted forms estimate the errors' covariance across series from forecasts of
the past. statsforecast's in-sample one-step fitted values would be one choice; here they are the
backtest windows' forecasts of the models the reconciled forecasts come from (`horizon` steps
ahead, out of sample): the errors of the forecasts being reconciled, at their horizons. The
series of a hierarchy end together, so every series has them at the same timestamps.

An aggregate series has the id columns of its level and nulls in the others (the total: nulls in
all); its target is the sum of its bottom series' at each timestamp, its covariates their mean.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import polars as pl

from shardwise.common.errors import ConfigError
from shardwise.manymodel.columns import FUTURE, SERIES, Columns

TOTAL = "total"
"""The top of every hierarchy, in `unique_id` paths (`total/CA/north`)."""
_TOTAL_COLUMN = "_total"
_CLASSES: dict[str, tuple[str, dict[str, str]]] = {
    "bottom_up": ("BottomUp", {}),
    "top_down": ("TopDown", {"method": "average_proportions"}),
    "mint_ols": ("MinTrace", {"method": "ols"}),
    "mint_wls_struct": ("MinTrace", {"method": "wls_struct"}),
    "mint_wls_var": ("MinTrace", {"method": "wls_var"}),
    "mint_shrink": ("MinTrace", {"method": "mint_shrink"}),
}
"""Each method's hierarchicalforecast class and arguments."""
FROM_ERRORS = frozenset({"mint_wls_var", "mint_shrink"})
"""The methods that weigh the series by their backtest errors (`reconcile`'s `past`)."""
FROM_HISTORY = FROM_ERRORS | {"top_down"}
"""The methods that read the observed history (hierarchicalforecast's `insample` ones): top-down
its average proportions, the error-weighted MinTraces the errors."""
DENSE_UP_TO = 2_000
"""Above this many series (every level's), bottom_up, top_down, mint_ols and mint_wls_struct
work on hierarchicalforecast's sparse summing matrix (its BottomUpSparse, TopDownSparse and
MinTraceSparse): their memory and time grow with the series, where the dense matrices' grow with
their square (bench/reconcile_scale.py: 20,401 series in 389 MiB; dense, killed for memory on a
24 GiB machine). Bottom-up and top-down give the same forecasts either way; MinTraceSparse solves
iteratively (bicgstab, tolerance 1e-5), within about 1e-4 of the dense forecasts, relative. Every
level still adds up."""
DENSE_ONLY = FROM_ERRORS
"""The methods that stay dense at any size, the error-weighted ones: mint_shrink estimates the
errors' n × n covariance, and MinTraceSparse's `wls_var` weighs by the errors' variance around
their mean, where MinTrace's (and Wickramasuriya et al.'s) weighs by their mean square; a
forecast that is biased in the past should not be trusted more for it."""
DENSE_BYTES_PER_PAIR = 48
"""The dense methods' memory per pair of series, measured: 4.2 GiB for mint_shrink on 10,201
series, 1.2 GiB for MinTrace on 5,101."""


def check_levels(levels: list[list[str]], columns: Columns) -> None:
    """Every level names id columns, none twice, and no level is the bottom itself."""
    for level in levels:
        unknown = [c for c in level if c not in columns.ids]
        if unknown:
            raise ConfigError(
                f"hierarchy.levels names '{unknown[0]}', which is not one of data.id_columns "
                f"({', '.join(columns.ids)}); a level aggregates over id columns"
            )
        if not level or len(set(level)) != len(level) or set(level) == set(columns.ids):
            raise ConfigError(
                f"hierarchy.levels has {level}: a level is a non-empty list of distinct id "
                "columns that is not all of them (the bottom level is data.id_columns)"
            )
    sets = [frozenset(level) for level in levels]
    if len(set(sets)) != len(sets):
        raise ConfigError(f"hierarchy.levels lists a level twice: {levels}")


def aggregate(frame: pl.DataFrame, columns: Columns, levels: list[list[str]]) -> pl.DataFrame:
    """`frame` (bottom series, future rows included) with the series of every level and the
    total appended. The bottom series must end at the same timestamp."""
    ids, ts, y = list(columns.ids), columns.timestamp, columns.target
    ends = frame.filter(~pl.col(FUTURE)).group_by(ids).agg(pl.col(ts).max())[ts]
    if ends.n_unique() > 1:
        raise ConfigError(
            f"hierarchy.levels: the series end at {ends.n_unique()} different timestamps "
            f"({ends.min()!s:.19} … {ends.max()!s:.19}); a hierarchy needs every series "
            "observed up to the same time, so that each level is the sum of its series"
        )
    parts = [frame]
    for level in [[], *levels]:
        summed = frame.group_by([*level, ts, FUTURE]).agg(
            pl.col(y).sum(), *(pl.col(c).mean() for c in columns.covariates)
        )
        summed = summed.with_columns(
            pl.when(pl.col(FUTURE)).then(None).otherwise(pl.col(y)).alias(y),
            *(pl.lit(None, dtype=frame.schema[c]).alias(c) for c in ids if c not in level),
        )
        parts.append(summed.select(frame.columns))
    return pl.concat(parts).sort([*ids, ts], nulls_last=False)


def unique_ids(series: pl.DataFrame, ids: list[str], levels: list[list[str]]) -> pl.DataFrame:
    """`series` (SERIES and the id columns, one row per series) with each series' path in the
    hierarchy (`total/CA/north`), as hierarchicalforecast names it."""
    paths = []
    for row in series.iter_rows(named=True):
        present = {c for c in ids if row[c] is not None}
        level = next((lv for lv in [[], *levels, ids] if set(lv) == present), None)
        if level is None:  # an id column that is empty for a bottom series: checked on read
            raise ConfigError(f"series {row} belongs to no level of the hierarchy")
        paths.append("/".join([TOTAL, *(str(row[c]) for c in level)]))
    return series.with_columns(pl.Series("unique_id", paths, dtype=pl.String))


def reconcile(
    forecasts: pl.DataFrame,
    history: pl.DataFrame,
    columns: Columns,
    levels: list[list[str]],
    methods: Sequence[str],
    past: pl.DataFrame | None = None,
    *,
    paths: pl.DataFrame | None = None,
) -> pl.DataFrame:
    """Reconcile `forecasts` (SERIES, timestamp, `forecast`: every series of every level) with
    the observed `history` (SERIES, ids, timestamp, target), which only the methods in
    FROM_HISTORY read: the forecasts with a `base` column and one per method. The methods in
    FROM_ERRORS need `past`: the same models' backtest forecasts (SERIES, timestamp, `forecast`)
    of the history. `paths`: every series' `unique_ids`, where the caller has them (a run
    reconciles several times); else they are read from the history."""
    from hierarchicalforecast.core import HierarchicalReconciliation
    from hierarchicalforecast.utils import aggregate as hf_aggregate

    ids, ts = list(columns.ids), columns.timestamp
    if paths is None:
        paths = unique_ids(history.select(SERIES, *ids).unique(SERIES), ids, levels)
    # the summing matrix and the levels' tags depend on the ids alone: one row per bottom series
    # (hierarchicalforecast's sums of the history, which `aggregate` also makes, are not used)
    bottom = paths.drop_nulls(ids).select(
        pl.lit(TOTAL).alias(_TOTAL_COLUMN), *ids, pl.lit(0).alias("ds"), pl.lit(0.0).alias("y")
    )
    spec = [[_TOTAL_COLUMN, *level] for level in [[], *levels, ids]]
    sparse = paths.height > DENSE_UP_TO
    _, structure, tags = hf_aggregate(bottom, spec, sparse_s=sparse)
    made = {method: _reconciler(method, sparse) for method in methods}
    base = forecasts.join(paths, on=SERIES).select(
        "unique_id", pl.col(ts).alias("ds"), pl.col("forecast").alias("base")
    )
    observed = None
    if FROM_HISTORY & set(methods):
        observed = _observed(history, paths, columns, methods, past)
    reconciled = HierarchicalReconciliation([made[m][0] for m in methods]).reconcile(
        Y_hat_df=base, S_df=structure, tags=tags, Y_df=observed
    )
    renamed = reconciled.rename({f"base/{made[m][1]}": m for m in methods})
    out = paths.join(renamed.rename({"ds": ts}), on="unique_id")
    return out.select(SERIES, "unique_id", *ids, ts, "base", *methods).sort(SERIES, ts)


def _observed(
    history: pl.DataFrame,
    paths: pl.DataFrame,
    columns: Columns,
    methods: Sequence[str],
    past: pl.DataFrame | None,
) -> pl.DataFrame:
    """The history as hierarchicalforecast reads it (`Y_df`): `unique_id`, `ds`, `y`, and for
    the methods in FROM_ERRORS the backtest forecasts `past` of it (`base`)."""
    ts, y = columns.timestamp, columns.target
    observed = history.join(paths, on=SERIES)
    fitted: list[pl.Expr] = []
    if FROM_ERRORS & set(methods):
        if past is None:
            needing = ", ".join(sorted(FROM_ERRORS & set(methods)))
            raise ValueError(f"{needing}: these reconcilers need the backtest forecasts (`past`)")
        # null where no window forecast the row: their covariance skips those
        observed = observed.join(
            past.select(SERIES, ts, pl.col("forecast").alias("_base")), on=[SERIES, ts], how="left"
        )
        fitted = [pl.col("_base").alias("base")]
    return observed.select("unique_id", pl.col(ts).alias("ds"), pl.col(y).alias("y"), *fitted)


def _reconciler(method: str, sparse: bool) -> tuple[Any, str]:
    """`method`'s hierarchicalforecast reconciler (its sparse form where `sparse` and it has one)
    and the name of its output column (hierarchicalforecast's: class, then its arguments)."""
    import hierarchicalforecast.methods as hf_methods

    name, arguments = _CLASSES[method]
    if sparse and method not in DENSE_ONLY:
        name += "Sparse"
    column = "_".join([name, *(f"{k}-{v}" for k, v in arguments.items())])
    return getattr(hf_methods, name)(**arguments), column


def check_methods(methods: Sequence[str], series: int, free: int | None = None) -> None:
    """A method that cannot fit in memory is an error before the run, not the driver killed
    after it: the dense methods' n × n matrices for `series` series must take at most half the
    `free` bytes (the memory available now, by default)."""
    dense = [m for m in methods if m in DENSE_ONLY]
    if not dense:
        return
    if free is None:
        import psutil

        free = int(psutil.virtual_memory().available)
    need = DENSE_BYTES_PER_PAIR * series**2
    if need > free / 2:
        raise ConfigError(
            f"hierarchy.methods: {' and '.join(dense)} would hold {series} × {series} "
            f"matrices of the series' errors, about {need / 2**30:.1f} GiB, more than half the "
            f"{free / 2**30:.1f} GiB free here; use mint_wls_struct or mint_ols instead"
        )


def incoherence(
    reconciled: pl.DataFrame, column: str, columns: Columns, levels: list[list[str]]
) -> float:
    """The largest gap, relative to the aggregate's size (at least 1), between an aggregate
    series' value in `column` and the sum of its bottom series' values: 0 when every level adds
    up."""
    ids, ts = list(columns.ids), columns.timestamp
    bottom = reconciled.drop_nulls(ids)
    worst = 0.0
    for level in [[], *levels]:
        others = [c for c in ids if c not in level]
        aggregates = reconciled.filter(
            pl.all_horizontal(pl.col(c).is_not_null() for c in level) if level else pl.lit(True),
            pl.all_horizontal(pl.col(c).is_null() for c in others),
        )
        sums = bottom.group_by([*level, ts]).agg(pl.col(column).sum().alias("_sum"))
        both = aggregates.join(sums, on=[*level, ts]) if level else aggregates.join(sums, on=ts)
        if both.height != aggregates.height:
            return float("inf")  # an aggregate without bottom series
        gaps = (pl.col(column) - pl.col("_sum")).abs() / pl.max_horizontal(
            pl.col(column).abs(), pl.lit(1.0)
        )
        worst = max(worst, float(both.select(gaps.max()).item() or 0.0))
    return worst
