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

The backtest's rows are read a part of the series at a time (`Parts`; a run's are a few chunks'
files), so the driver's memory does not grow with the series: the pooled widths are exact ranks
found from counts per bucket of values and the few values of the buckets the ranks fall in
(`_pooled_widths`); a series' own widths come from its own rows; the scores are sums per time
step, added part by part.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
from collections import defaultdict
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
    n_windows: int
    """The backtest's windows: the forecast's intervals are those of window n_windows."""

    def series_widths(self, backtest: pl.LazyFrame) -> pl.DataFrame | None:
        """The own widths of the series in `backtest` (their backtest rows), which the levels
        by the `series` method take; None where no level is."""
        own = [n for n, v in self.levels.items() if v.method == "series"]
        if not own:
            return None
        targets = range(1, self.n_windows + 1)
        return _widths(_errors(backtest).collect(), _SERIES_KEYS, "_error", "w", own, targets)

    def bounds(self, rows: pl.LazyFrame, series: pl.DataFrame | None) -> pl.LazyFrame:
        """`rows` (series, model, window, step, forecast, scale and the own interval columns)
        with `lo_<level>`, `hi_<level>` by each level's method; null where not honoured.
        `series`: those series' `series_widths`."""
        methods = {n: v.method for n, v in self.levels.items()}
        return with_bounds(rows, self.pooled, series, methods)

    def forecast_bounds(self, rows: pl.LazyFrame, series: pl.DataFrame | None) -> pl.LazyFrame:
        """The final forecasts' `rows` (a chunk's forecasts table) with their bounds, which
        every window's errors make (`series`: as for `bounds`)."""
        window = pl.lit(self.n_windows, pl.Int64).alias("window")
        return self.bounds(rows.with_columns(window), series).drop("window")

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


Parts = Sequence[pl.LazyFrame]
"""A backtest's rows (backtest.py: series, model, window, step, forecast, actual, scale, own
intervals) in parts of whole series, read one part at a time."""
_SERIES_KEYS = [SERIES, "model", "step"]
_POOLED_KEYS = ["model", "step"]
_BUCKET_SHIFT = 46
"""A non-negative float's bits shifted right by 52 − 6: its exponent and 6 leading mantissa
bits, a bucket index in the values' order (64 buckets per power of two)."""


@dataclass
class _Tally:
    """What scoring needs of every part, summed as the parts are read: sums per time step
    of the choosing and the reported windows, and the final forecasts without an interval,
    per level and method; series with a seasonal naive scale."""

    choose: defaultdict[tuple[int, str], list[pl.DataFrame]] = field(
        default_factory=lambda: defaultdict(list)
    )
    report: defaultdict[tuple[int, str], list[pl.DataFrame]] = field(
        default_factory=lambda: defaultdict(list)
    )
    unbounded: defaultdict[tuple[int, str], np.ndarray] = field(
        default_factory=lambda: defaultdict(lambda: np.zeros(2, dtype=np.int64))
    )
    scaled_series: int = 0


def calibrate(
    parts: Parts,
    levels: Sequence[int],
    n_windows: int,
    method: str,
    sources: Callable[[pl.LazyFrame], pl.LazyFrame],
    spacing: int | None = None,
) -> Calibration:
    """The run's intervals from the backtest's rows in `parts` (at least one), read a part at
    a time: the driver holds one part and tallies that grow with models, steps and windows,
    not series. `method` is `backtest.intervals`; `sources` keeps the rows of the model each
    series' forecasts come from (selection.py), which the scores are of; `spacing`: steps
    between windows' origins (None: the horizon)."""
    targets = range(1, n_windows + 1)  # the windows an interval can be made for
    pooled = _pooled_widths(parts, levels, targets)
    scored = list(range(1, n_windows))
    half = len(scored) // 2 if len(scored) >= 2 else 0
    choose_on = scored[:half] if method == "auto" else []
    report_on = scored[half:]
    candidates = AUTO if method == "auto" else (method,)
    gap = spacing or int(pooled.select(pl.col("step").max()).item() or 1)
    tally = _Tally()
    for part in parts:
        frame = _errors(part).collect()
        series = (
            _widths(frame, _SERIES_KEYS, "_error", "w", levels, targets)
            if "series" in candidates
            else None
        )
        reported = sources(frame.lazy().filter(pl.col("window").is_in(report_on)))
        last = frame.lazy().filter(pl.col("window") == n_windows - 1)
        for level, name in itertools.product(levels, candidates):
            bounded = functools.partial(
                _per_time, pooled=pooled, series=series, level=level, method=name, gap=gap
            )
            if choose_on:
                window = pl.col("window").is_in(choose_on)
                tally.choose[level, name].append(bounded(frame.lazy().filter(window)))
            if report_on:
                tally.report[level, name].append(bounded(reported))
            tally.unbounded[level, name] += _unbounded(last, pooled, series, level, name, n_windows)
        tally.scaled_series += frame.filter(pl.col("scale").is_not_null())[SERIES].n_unique()
    chosen: dict[int, Level] = {}
    for level in levels:
        picked = _picked(tally, level) if choose_on else "pooled" if method == "auto" else method
        got = _scores(tally.report[level, picked], level, spread=True) if report_on else {}
        scores = {k: v for k, v in got.items() if not k.startswith("_")}
        missing, total = (int(n) for n in tally.unbounded[level, picked])
        needs = _needs(level, picked, n_windows, tally.scaled_series) if missing else ""
        chosen[level] = Level(level, picked, choose_on, report_on, scores, missing, total, needs)
    return Calibration(chosen, pooled, n_windows)


def _errors(rows: pl.LazyFrame) -> pl.LazyFrame:
    """`rows` with each forecast's absolute error, and that scaled by the series' scale
    (null where the scale is not positive)."""
    return rows.with_columns(
        (pl.col("actual") - pl.col("forecast")).abs().alias("_error"),
        pl.when(pl.col("scale") > 0).then(pl.col("scale")).alias("scale"),
    ).with_columns((pl.col("_error") / pl.col("scale")).alias("_scaled"))


def _picked(tally: _Tally, level: int) -> str:
    """The method `auto` chooses at `level`: of those that give an interval wherever pooled
    does on the choosing windows, the lowest MSIS (pooled if none is finite)."""
    counts, msis = {}, {}
    for name in AUTO:
        got = _scores(tally.choose[level, name], level)
        counts[name], msis[name] = got["_n"], got[score_names(level)[2]]
    eligible = {n: msis[n] for n in AUTO if counts[n] >= counts["pooled"] > 0}
    finite = {n: v for n, v in eligible.items() if math.isfinite(v)}
    return min(finite, key=lambda n: finite[n]) if finite else "pooled"


def _pooled_widths(parts: Parts, levels: Sequence[int], targets: range) -> pl.DataFrame:
    """Per target window t, model and step, `q_<level>`: the conformal rank of the scale-free
    errors of the windows before t, pooled over series (null: too few for the rank). Exact, in
    two reads of the parts that keep no more than a few buckets' values: the first counts the
    errors per bucket (`_BUCKET_SHIFT`), which says the bucket each rank falls in and its rank
    there; the second keeps the values of those buckets (none where a bucket holds one value,
    as all the zeros do)."""
    keys = [*_POOLED_KEYS, "window", "_bucket"]
    summed = [pl.col("_n").sum(), pl.col("_min").min(), pl.col("_max").max()]
    counts = None
    for part in parts:  # each part's counts added as it is read: the tallies stay one
        got = (
            _bucketed(part)
            .group_by(keys)
            .agg(
                pl.len().cast(pl.Int64).alias("_n"),
                pl.col("_scaled").min().alias("_min"),
                pl.col("_scaled").max().alias("_max"),
            )
        )
        counts = got if counts is None else pl.concat([counts, got]).group_by(keys).agg(summed)
    assert counts is not None, "calibrate needs at least one part"
    bases, ranked = [], []
    for t in targets:
        hist = (
            counts.lazy()
            .filter(pl.col("window") < t)
            .group_by(*_POOLED_KEYS, "_bucket")
            .agg(summed)
            .sort(*_POOLED_KEYS, "_bucket")
            .with_columns(
                pl.col("_n").cum_sum().over(_POOLED_KEYS).alias("_upto"),
                pl.col("_n").sum().over(_POOLED_KEYS).alias("_total"),
                pl.lit(t, pl.Int64).alias("window"),
            )
        )
        bases.append(hist.select(*_POOLED_KEYS, "window").unique())
        for level in levels:
            rank = ((pl.col("_total") + 1) * level + 99) // 100 - 1
            before = pl.col("_upto") - pl.col("_n")
            ranked.append(
                hist.filter((before <= rank) & (rank < pl.col("_upto"))).select(
                    *_POOLED_KEYS, "window", "_bucket", "_min", "_max",
                    (rank - before).alias("_within"), pl.lit(level).alias("_level"),
                )
            )  # fmt: skip
    ranks = pl.concat(ranked).collect()
    one_value = ranks.filter(pl.col("_min") == pl.col("_max"))
    several = ranks.filter(pl.col("_min") != pl.col("_max"))
    found = [one_value.select(*_POOLED_KEYS, "window", "_level", pl.col("_min").alias("_q"))]
    if several.height:  # the second read: the values of those buckets only
        wanted = several.select(*_POOLED_KEYS, "_bucket").unique()
        values = pl.concat(
            _bucketed(part).join(wanted, on=[*_POOLED_KEYS, "_bucket"], how="semi")
            for part in parts
        ).rename({"window": "_from"})
        found.append(
            several.join(values, on=[*_POOLED_KEYS, "_bucket"])
            .filter(pl.col("_from") < pl.col("window"))
            .group_by(*_POOLED_KEYS, "window", "_level")
            .agg(pl.col("_scaled").sort().get(pl.col("_within").first()).alias("_q"))
        )
    widths = pl.concat(found)
    out = pl.concat(bases).collect()
    for level in levels:
        got = widths.filter(pl.col("_level") == level).select(
            *_POOLED_KEYS, "window", pl.col("_q").alias(f"q_{level}")
        )
        out = out.join(got, on=[*_POOLED_KEYS, "window"], how="left")
    return out


def _bucketed(rows: pl.LazyFrame) -> pl.DataFrame:
    """`rows`' model, step, window and scale-free error where it is a number, with its
    bucket (`_BUCKET_SHIFT`)."""
    frame = (
        _errors(rows)
        .select(*_POOLED_KEYS, "window", "_scaled")
        .filter(pl.col("_scaled").is_not_null() & pl.col("_scaled").is_not_nan())
        .collect()
    )
    bits = frame["_scaled"].to_numpy().view(np.int64) >> _BUCKET_SHIFT
    return frame.with_columns(pl.Series("_bucket", bits))


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
    rows: pl.LazyFrame,
    pooled: pl.DataFrame,
    series: pl.DataFrame | None,
    methods: dict[int, str],
) -> pl.LazyFrame:
    """`rows` with each level's bounds by its method (module docstring); `series`: the
    series' own widths, where a method is `series`."""
    wanted_q = [f"q_{level}" for level, m in methods.items() if m != "series"]
    wanted_w = [f"w_{level}" for level, m in methods.items() if m == "series"]
    joined = rows
    if wanted_q:
        joined = joined.join(
            pooled.lazy().select("model", "window", "step", *wanted_q),
            on=["model", "window", "step"],
            how="left",
        )
    if wanted_w:
        assert series is not None, "a level by the series method needs the series' widths"
        joined = joined.join(
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


def _per_time(
    rows: pl.LazyFrame,
    *,
    pooled: pl.DataFrame,
    series: pl.DataFrame | None,
    level: int,
    method: str,
    gap: int,
) -> pl.DataFrame:
    """Per time step (`window · gap + step`: `gap` the steps between windows' origins), the
    sums the scores at `level` of `rows`' intervals by `method` are made of, over the rows
    with an actual value and an interval: `_n` rows, `_inside`, `_winkler`, `_msis`."""
    lo, hi = bound_names(level)
    alpha = 1 - level / 100
    miss = (pl.col(lo) - pl.col("actual")).clip(0) + (pl.col("actual") - pl.col(hi)).clip(0)
    winkler = (pl.col(hi) - pl.col(lo)) + 2 / alpha * miss
    return (
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
        .collect()
    )


def _scores(parts: list[pl.DataFrame], level: int, *, spread: bool = False) -> dict[str, float]:
    """Coverage, Winkler score and MSIS at `level` from the parts' sums per time step
    (`_per_time`), over `_n` rows; with `spread`, the coverage's own interval too
    (`_coverage_spread`)."""
    names = score_names(level)
    sums = ["_n", "_inside", "_winkler", "_msis"]
    per_time = (
        pl.concat(parts).group_by("_time").agg(pl.col(sums).sum()).sort("_time")
        if parts
        else pl.DataFrame(schema=dict.fromkeys(["_time", *sums], pl.Float64))
    )
    n = int(per_time["_n"].sum())
    totals = (per_time[c].sum() for c in sums[1:])
    got = {
        "_n": float(n),
        **{k: float(v) / n if n else math.nan for k, v in zip(names, totals, strict=True)},
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


def _unbounded(
    last: pl.LazyFrame,
    pooled: pl.DataFrame,
    series: pl.DataFrame | None,
    level: int,
    method: str,
    n_windows: int,
) -> np.ndarray:
    """How many final forecast rows get no interval at `level` by `method`, of how many
    (counted on the model × step pairs every series' forecasts have: the `last` window's rows
    stand for them)."""
    final = with_bounds(
        last.with_columns(pl.lit(n_windows, pl.Int64).alias("window")),
        pooled,
        series,
        {level: method},
    )
    lo = bound_names(level)[0]
    total, missing = final.select(pl.len(), pl.col(lo).is_null().sum()).collect().row(0)
    return np.array([missing, total], dtype=np.int64)


def _needs(level: int, method: str, n_windows: int, scaled_series: int) -> str:
    """What honouring `level` by `method` takes (`scaled_series`: the series with a
    seasonal naive scale)."""
    need = needed(level)
    if method == "series":
        return (
            f"{need} errors per series and step: backtest.n_windows ≥ {need} "
            f"(has {n_windows}), or backtest.intervals = 'pooled'"
        )
    windows = -(-need // max(scaled_series, 1))
    return (
        f"{need} errors per model and step pooled over {scaled_series} series with a seasonal "
        f"naive scale: backtest.n_windows ≥ {windows} (has {n_windows}), or more series"
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
