"""Reconciling a large hierarchy: time and peak memory of one `hierarchy.reconcile` call (what a
hierarchical run makes once for its forecasts and once per scored backtest window) as the bottom
grows, with the sparse summing matrix shardwise uses above `DENSE_UP_TO` series against the dense
one (hierarchicalforecast's default, and shardwise's below that size) in the same run.

The hierarchy is stores × 50 items with the store level and the total, 104 weekly observations
and 8 weeks to reconcile; each series' forecast is its last 8 weeks' mean times noise, so that
they do not add up. Each measurement runs in a fresh process; the memory is that process's peak
resident set above what it held before the call.

    python bench/reconcile_scale.py                         # about 3 minutes on 2 cores
    python bench/reconcile_scale.py --bottom 1000,5000 --methods bottom_up,mint_ols
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import date, timedelta

import numpy as np
import polars as pl
from peak_memory import in_fresh_process, measured

WEEKS, HORIZON, ITEMS = 104, 8, 50


def hierarchy_frames(bottom: int) -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame]:
    """Every series' history, forecasts and backtest forecasts of the last 16 weeks."""
    from shardwise.manymodel.columns import SERIES

    stores = bottom // ITEMS
    rng = np.random.default_rng(0)
    weeks = [date(2020, 1, 6) + timedelta(weeks=k) for k in range(WEEKS + HORIZON)]
    names = [f"s{s:05d}" for s in range(stores)]
    text = {"store": pl.String, "item": pl.String}
    series = pl.concat(
        [
            pl.DataFrame({"store": [None], "item": [None]}, schema=text),
            pl.DataFrame({"store": names, "item": [None] * stores}, schema=text),
            pl.DataFrame(
                {
                    "store": np.repeat(names, ITEMS),
                    "item": np.tile([f"i{i:02d}" for i in range(ITEMS)], stores),
                }
            ),
        ]
    ).with_row_index(SERIES)
    series = series.with_columns(pl.col(SERIES).cast(pl.Int64))
    y = rng.gamma(2.0, 5.0, size=(stores * ITEMS, WEEKS))
    sums = np.vstack([y.sum(0, keepdims=True), y.reshape(stores, ITEMS, WEEKS).sum(1), y])
    n = sums.shape[0]
    history = series.join(pl.DataFrame({"week": weeks[:WEEKS]}), how="cross").sort(SERIES, "week")
    history = history.with_columns(pl.Series("units", sums.reshape(-1)))
    future = pl.DataFrame({"week": weeks[WEEKS:]})
    forecasts = series.select(SERIES).join(future, how="cross").sort(SERIES, "week")
    level = np.repeat(sums[:, -HORIZON:].mean(axis=1), HORIZON)
    forecasts = forecasts.with_columns(
        pl.Series("forecast", level * rng.uniform(0.9, 1.1, n * HORIZON))
    )
    recent = history.filter(pl.col("week") >= weeks[WEEKS - 2 * HORIZON])
    noise = pl.Series(rng.uniform(0.8, 1.2, recent.height))
    past = recent.select(SERIES, "week", (pl.col("units") * noise).alias("forecast"))
    return history, forecasts, past


def measure(bottom: int, methods: list[str], dense: bool) -> dict[str, float]:
    """One reconcile call in this process with the `dense` or the sparse summing matrix, whatever
    the size: seconds, MiB above the resident set before it, and the largest gap between a level
    and the sum below it."""
    from shardwise.manymodel.columns import SERIES, Columns
    from shardwise.manymodel.hierarchy import levels as hierarchy

    hierarchy.DENSE_UP_TO = sys.maxsize if dense else 0
    history, forecasts, past = hierarchy_frames(bottom)
    columns = Columns(ids=("store", "item"), timestamp="week", target="units", covariates=())
    reconciled, seconds, mib = measured(
        lambda: hierarchy.reconcile(forecasts, history, columns, [["store"]], methods, past)
    )
    gap = max(hierarchy.incoherence(reconciled, m, columns, [["store"]]) for m in methods)
    series = history[SERIES].n_unique()
    return {"seconds": seconds, "mib": mib, "gap": gap, "series": series}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bottom", default="1000,5000,20000,100000", help="bottom series")
    parser.add_argument("--methods", default="bottom_up,top_down,mint_ols,mint_wls_struct")
    parser.add_argument("--dense-up-to", type=int, default=20000, help="largest dense baseline")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # bottom:dense, in a child process
    args = parser.parse_args()
    methods = args.methods.split(",")
    if args.one:
        bottom, dense = args.one.split(":")
        print(json.dumps(measure(int(bottom), methods, dense == "dense")))
        return
    print(
        f"reconcile({', '.join(methods)}): stores × {ITEMS} items, {WEEKS} weeks, {HORIZON} ahead"
    )
    print(f"{'bottom':>8} {'series':>8} {'form':>7} {'seconds':>8} {'MiB':>7} {'largest gap':>12}")
    for bottom in (int(b) for b in args.bottom.split(",")):
        forms = ["sparse", "dense"] if bottom <= args.dense_up_to else ["sparse"]
        for form in forms:
            got = in_fresh_process(
                [sys.executable, __file__, "--methods", args.methods, "--one", f"{bottom}:{form}"]
            )
            if got is None:
                print(f"{bottom:>8} {'':>8} {form:>7}  killed: out of memory", flush=True)
                continue
            print(
                f"{bottom:>8} {got['series']:>8} {form:>7} {got['seconds']:>8.1f} "
                f"{got['mib']:>7.0f} {got['gap']:>12.1e}",
                flush=True,
            )


if __name__ == "__main__":
    main()
