"""Prediction intervals from the backtest's own errors (split conformal), pooled across series,
chosen and scored on windows apart, and their scores.

A forecast with an interval at level L for step j is the forecast ± the ⌈(n + 1)·L⌉-th smallest
of n errors at step j from earlier windows: for errors exchangeable with the one to come it
covers with probability at least L, whatever the model. With fewer than L / (1 − L) errors (4 at
80%, 19 at 95%) that rank does not exist, and the level cannot be honoured: the interval is
null, never a narrower band under the level's name. Where the errors come from (`method`):

- `pooled`: every series' scale-free errors |y − ŷ| / s, s the series' in-sample seasonal naive
  MAE before the window (MASE's scale), per model and step; a series' half-width is q·s. With
  thousands of series, three windows give thousands of errors per step.
- `series`: each series' own absolute errors, one per window (19 windows for 95%).
- `model`: a model's own intervals where it has them (`backtest.intervals = "model"`), pooled
  for the rest.

`backtest.intervals = "auto"` chooses between pooled and series on windows no interval is then
reported on: window 0 has no earlier errors, so windows 1 … n − 1 can be scored; the first half
of them choose (the lowest mean MSIS among the methods that give an interval wherever pooled
does), the second half report the chosen method's coverage, Winkler score and MSIS. With fewer
than two such windows nothing is chosen: pooled. The forecasts' intervals use every window.

Scores, per level, on windows whose interval comes from the windows before them only: coverage
(share of actual values inside), the Winkler (interval) score (width plus 2/α times the miss,
mean over steps: lower is better) and MSIS (the Winkler score scaled like MASE).

The coverage comes with a 95% interval of its own (`coverage_<L>_low`, `_high`). Series move
together (a shock in one month hits the whole panel), so thousands of series are not thousands
of independent checks: the interval resamples time steps (a window's step j is the time step
`window · spacing + j`, the same for every series that ends with the panel), in moving blocks
(serial dependence), each time step with all its series' rows. With fewer than
`FEWEST_TIME_STEPS` time steps it is not estimated, and the summary says the coverage is from
too few to judge.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import polars as pl

from shardwise.manymodel.columns import SERIES

AUTO = ("pooled", "series")
"""The methods `backtest.intervals = "auto"` chooses between."""
FEWEST_TIME_STEPS = 10
"""Time steps the reported windows need for the coverage's own interval."""
DRAWS = 2000
"""Bootstrap resamples for the coverage's interval."""
METADATA_KEY = "shardwise.intervals"
"""The forecast files' Parquet metadata key: each level's method and whether it is honoured."""


def bound_names(level: int) -> tuple[str, str]:
    """The forecast columns of an interval: `lo_80`, `hi_80`."""
    return (f"lo_{level}", f"hi_{level}")


def score_names(level: int) -> tuple[str, str, str]:
    return (f"coverage_{level}", f"winkler_{level}", f"msis_{level}")


def spread_names(level: int) -> tuple[str, str, str]:
    """The coverage's own 95% interval and the time steps it comes from."""
    return (f"coverage_{level}_low", f"coverage_{level}_high", f"coverage_{level}_time_steps")


def needed(level: int) -> int:
    """The fewest errors with a conformal rank at `level` percent: ⌈L / (1 − L)⌉."""
    return -(-level // (100 - level))


@dataclass(frozen=True)
class Level:
    """How the intervals at one level were made and how they scored."""

    level: int
    method: str
    chosen_on: list[int]
    """The windows the method was chosen on (empty: not chosen, as configured or too few)."""
    reported_on: list[int]
    scores: dict[str, float] = field(default_factory=dict)
    """Coverage, Winkler score and MSIS of the forecasts' intervals on `reported_on`."""
    missing: int = 0
    """Forecast rows (of every model) whose interval is null: the level is not honoured."""
    total: int = 0
    needs: str = ""
    """What honouring the level takes, where it is not honoured."""

    @property
    def honoured(self) -> bool:
        return self.missing == 0


@dataclass(frozen=True)
class Calibration:
    """The intervals of a run: the method per level and what it needs to make the bounds of
    any forecast row (a backtest window's or the final forecast's)."""

    levels: dict[int, Level]
    pooled: pl.DataFrame
    """model, window (the window the interval is for; n_windows: the forecast), step, and
    `q_<level>`: the pooled scale-free half-width."""
    series: pl.DataFrame
    """series, model, window, step, and `w_<level>`: the series' own half-width (no rows
    where no level's method uses them)."""
    n_windows: int
    """The backtest's windows: the forecast's intervals are those of window n_windows."""

    def bounds(self, rows: pl.LazyFrame) -> pl.LazyFrame:
        """`rows` (series, model, window, step, forecast, scale and the own interval columns)
        with `lo_<level>`, `hi_<level>` by each level's method; null where not honoured."""
        return with_bounds(
            rows, self.pooled, self.series, {n: v.method for n, v in self.levels.items()}
        )

    def forecast_bounds(self, rows: pl.LazyFrame) -> pl.LazyFrame:
        """The final forecasts' `rows` (a chunk's forecasts table) with their bounds, which
        every window's errors make."""
        window = pl.lit(self.n_windows, pl.Int64).alias("window")
        return self.bounds(rows.with_columns(window)).drop("window")

    def metadata(self) -> dict[str, str]:
        """The Parquet metadata the forecast files carry (METADATA_KEY)."""
        shown = {
            str(level): {
                "method": v.method, "honoured": v.honoured, "missing": v.missing,
                "needs": v.needs, "chosen_on_windows": v.chosen_on,
                "reported_on_windows": v.reported_on, **v.scores,
            }
            for level, v in self.levels.items()
        }  # fmt: skip
        return {METADATA_KEY: json.dumps(shown)}


def calibrate(
    backtest: pl.LazyFrame,
    levels: Sequence[int],
    n_windows: int,
    method: str,
    sources: Callable[[pl.LazyFrame], pl.LazyFrame],
    spacing: int | None = None,
) -> Calibration:
    """The run's intervals from every chunk's `backtest` rows (backtest.py: series, model,
    window, step, forecast, actual, scale, own intervals): `method` is `backtest.intervals`;
    `sources` keeps the rows of the model each series' forecasts come from (selection.py),
    which the scores are of; `spacing`: steps between windows' origins (None: the horizon)."""
    rows = backtest.with_columns(
        (pl.col("actual") - pl.col("forecast")).abs().alias("_error"),
        pl.when(pl.col("scale") > 0).then(pl.col("scale")).alias("scale"),
    ).with_columns((pl.col("_error") / pl.col("scale")).alias("_scaled"))
    frame = rows.collect()
    targets = range(1, n_windows + 1)  # the windows an interval can be made for
    pooled = _widths(frame, ["model", "step"], "_scaled", "q", levels, targets)
    # each series' own: as many rows as the backtest, so only where a method may use them
    series = _widths(
        frame if method in ("auto", "series") else frame.clear(),
        [SERIES, "model", "step"], "_error", "w", levels, targets,
    )  # fmt: skip
    scored = list(range(1, n_windows))
    half = len(scored) // 2 if len(scored) >= 2 else 0
    choose_on, report_on = scored[:half], scored[half:]
    chosen: dict[int, Level] = {}
    if method != "auto":
        choose_on = []
    for level in levels:
        picked = "pooled" if method == "auto" else method
        if choose_on:
            window = pl.col("window").is_in(choose_on)
            counts, msis = {}, {}
            for name in AUTO:
                got = _scored(frame.lazy().filter(window), pooled, series, level, name)
                counts[name], msis[name] = got["_n"], got[score_names(level)[2]]
            # those that give an interval wherever pooled does, by their MSIS
            eligible = {n: msis[n] for n in AUTO if counts[n] >= counts["pooled"] > 0}
            finite = {n: v for n, v in eligible.items() if math.isfinite(v)}
            picked = min(finite, key=lambda n: finite[n]) if finite else "pooled"
        source = sources(frame.lazy().filter(pl.col("window").is_in(report_on)))
        got = (
            _scored(source, pooled, series, level, picked, spread=True, spacing=spacing)
            if report_on
            else {}
        )
        scores = {k: v for k, v in got.items() if not k.startswith("_")}
        missing, total, needs = _honoured(frame, pooled, series, level, picked, n_windows)
        chosen[level] = Level(level, picked, choose_on, report_on, scores, missing, total, needs)
    return Calibration(chosen, pooled, series, n_windows)


def _widths(
    frame: pl.DataFrame,
    keys: list[str],
    error: str,
    prefix: str,
    levels: Sequence[int],
    targets: range,
) -> pl.DataFrame:
    """Per target window t and `keys`, the conformal half-width at each level from the
    `error` values of the windows before t (null: too few for the rank)."""
    parts = []
    for t in targets:
        earlier = (
            frame.lazy()
            .filter(pl.col("window") < t)
            .group_by(keys)
            .agg(pl.col(error).drop_nulls().drop_nans().sort().alias("_sorted"))
            .with_columns(pl.col("_sorted").list.len().alias("_n"), pl.lit(t).alias("window"))
        )
        parts.append(
            earlier.with_columns(
                pl.col("_sorted")
                .list.get(((pl.col("_n") + 1) * level + 99) // 100 - 1, null_on_oob=True)
                .alias(f"{prefix}_{level}")
                for level in levels
            ).drop("_sorted")
        )
    return pl.concat(parts).collect().cast({"window": pl.Int64})  # targets: never empty


def with_bounds(
    rows: pl.LazyFrame, pooled: pl.DataFrame, series: pl.DataFrame, methods: dict[int, str]
) -> pl.LazyFrame:
    """`rows` with each level's bounds by its method (module docstring)."""
    wanted_q = [f"q_{level}" for level in methods]
    wanted_w = [f"w_{level}" for level in methods]
    joined = rows.join(
        pooled.lazy().select("model", "window", "step", *wanted_q),
        on=["model", "window", "step"],
        how="left",
    ).join(
        series.lazy().select(SERIES, "model", "window", "step", *wanted_w),
        on=[SERIES, "model", "window", "step"],
        how="left",
    )
    bounds = []
    for level, method in methods.items():
        lo, hi = bound_names(level)
        if method == "series":
            half = pl.col(f"w_{level}")
        else:
            half = pl.col(f"q_{level}") * pl.col("scale")
        low, high = pl.col("forecast") - half, pl.col("forecast") + half
        if method == "model" and f"own_{lo}" in rows.collect_schema():
            low = pl.coalesce(pl.col(f"own_{lo}"), low)
            high = pl.coalesce(pl.col(f"own_{hi}"), high)
        bounds += [low.alias(lo), high.alias(hi)]
    return joined.with_columns(bounds).drop(*wanted_q, *wanted_w)


def _scored(
    rows: pl.LazyFrame,
    pooled: pl.DataFrame,
    series: pl.DataFrame,
    level: int,
    method: str,
    *,
    spread: bool = False,
    spacing: int | None = None,
) -> dict[str, float]:
    """Coverage, Winkler score and MSIS at `level` of `rows`' intervals by `method`, over the
    rows with an actual value and an interval (`_n` of them); with `spread`, the coverage's own
    interval too (`_coverage_spread`), from the same sums per time step (`spacing`: the steps
    between windows' origins; None: the horizon)."""
    lo, hi = bound_names(level)
    alpha = 1 - level / 100
    miss = (pl.col(lo) - pl.col("actual")).clip(0) + (pl.col("actual") - pl.col(hi)).clip(0)
    winkler = (pl.col(hi) - pl.col(lo)) + 2 / alpha * miss
    gap = spacing or pl.col("step").max()
    per_time = (
        with_bounds(rows, pooled, series, {level: method})
        .filter(pl.col("actual").is_not_null() & pl.col(lo).is_not_null())
        .group_by((pl.col("window") * gap + pl.col("step")).alias("_time"))
        .agg(
            pl.len().alias("_n"),
            ((pl.col("actual") >= pl.col(lo)) & (pl.col("actual") <= pl.col(hi)))
            .sum()
            .alias("_inside"),
            winkler.sum().alias("_winkler"),
            (winkler / pl.col("scale")).sum().alias("_msis"),
        )
        .sort("_time")
        .collect()
    )
    n = int(per_time["_n"].sum())
    names = score_names(level)
    sums = (per_time[c].sum() for c in ("_inside", "_winkler", "_msis"))
    got = {
        "_n": float(n),
        **{k: float(v) / n if n else math.nan for k, v in zip(names, sums, strict=True)},
    }
    if spread:
        got |= _coverage_spread(per_time, level)
    return got


def _coverage_spread(per_time: pl.DataFrame, level: int) -> dict[str, float]:
    """The coverage's 95% interval at `level` by a moving-block bootstrap of the time steps of
    `per_time` (module docstring; rows in time order), and how many there are; NaN bounds
    below `FEWEST_TIME_STEPS`."""
    low, high, count = spread_names(level)
    times = per_time.height
    if times < FEWEST_TIME_STEPS:
        return {low: math.nan, high: math.nan, count: float(times)}
    inside = per_time["_inside"].to_numpy().astype(np.float64)
    total = per_time["_n"].to_numpy().astype(np.float64)
    block = max(1, round(times ** (1 / 3)))
    blocks = -(-times // block)
    rng = np.random.default_rng(level)  # the same interval for the same rows
    starts = rng.integers(0, times - block + 1, size=(DRAWS, blocks))
    drawn = (starts[:, :, None] + np.arange(block)).reshape(DRAWS, -1)[:, :times]
    rates = inside[drawn].sum(axis=1) / total[drawn].sum(axis=1)
    bounds = np.quantile(rates, [0.025, 0.975])
    return {low: float(bounds[0]), high: float(bounds[1]), count: float(times)}


def _honoured(
    frame: pl.DataFrame,
    pooled: pl.DataFrame,
    series: pl.DataFrame,
    level: int,
    method: str,
    n_windows: int,
) -> tuple[int, int, str]:
    """How many final forecast rows get no interval at `level` by `method` (counted on the
    model × step pairs every series' forecasts have: the last window's rows stand for them),
    and what honouring the level takes."""
    last = frame.lazy().filter(pl.col("window") == n_windows - 1)
    final = with_bounds(
        last.with_columns(pl.lit(n_windows, pl.Int64).alias("window")),
        pooled,
        series,
        {level: method},
    )
    lo = bound_names(level)[0]
    counts = final.select(pl.len(), pl.col(lo).is_null().sum()).collect().row(0)
    total, missing = int(counts[0]), int(counts[1])
    if not missing:
        return 0, total, ""
    need = needed(level)
    if method == "series":
        return (
            missing,
            total,
            (
                f"{need} errors per series and step: backtest.n_windows ≥ {need} "
                f"(has {n_windows}), or backtest.intervals = 'pooled'"
            ),
        )
    with_scale = frame.filter(pl.col("scale").is_not_null())[SERIES].n_unique()
    windows = -(-need // max(with_scale, 1))
    return (
        missing,
        total,
        (
            f"{need} errors per model and step pooled over {with_scale} series with a seasonal "
            f"naive scale: backtest.n_windows ≥ {windows} (has {n_windows}), or more series"
        ),
    )


def describe(levels: dict[int, Level]) -> str:
    """The summary's line on the intervals: each level's method, coverage where it was
    reported, or what it needs."""
    parts = []
    for level, v in levels.items():
        coverage, winkler, msis = (v.scores.get(n, math.nan) for n in score_names(level))
        shown = f"{level}% → {coverage:.1%}" if math.isfinite(coverage) else f"{level}% → –"
        low, high, times = (v.scores.get(n, math.nan) for n in spread_names(level))
        if math.isfinite(low):
            shown += f" [{low:.0%}–{high:.0%} over {times:.0f} time steps]"
        elif math.isfinite(coverage) and math.isfinite(times):
            shown += (
                f" [{times:.0f} time steps: too few to judge, {FEWEST_TIME_STEPS} needed: "
                "more backtest.n_windows]"
            )
        if math.isfinite(winkler):
            shown += f" (Winkler {winkler:.4g}, MSIS {msis:.3g})"
        if not v.honoured:
            shown += f" (not honoured for {v.missing} of {v.total} forecasts: needs {v.needs})"
        parts.append(shown)
    first = next(iter(levels.values()))
    how = f"{first.method}" if len({v.method for v in levels.values()}) == 1 else "per level"
    chosen = f", chosen on window {_windows(first.chosen_on)}" if first.chosen_on else ""
    where = f" on held-out window {_windows(first.reported_on)}" if first.reported_on else ""
    return f"intervals ({how}{chosen}) covered{where}: {', '.join(parts)}"


def _windows(windows: list[int]) -> str:
    return ", ".join(str(w) for w in windows)
