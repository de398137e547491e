"""Calibrating the intervals of many series: time and the driver's peak memory of
`intervals.calibrate` on the backtest rows of N series, read a few chunks at a time as a run
reads them (`outputs.assemble`), against the same call given every chunk as one part (what the
driver held before: every backtest row at once), in the same run. Both must give the same
widths and scores; the bench checks that they do.

The rows are those of 4 models × 3 windows × 12 steps per series (the issue's case), written as
chunk files of 1,000 series; errors are gamma noise around each series' scale. Each measurement
runs in a fresh process, after a small call that warms polars up; the memory is that process's
peak resident set above what it held before the call (sampled every 10 ms).

    python bench/calibrate_scale.py                          # about 1 minute on 2 cores
    python bench/calibrate_scale.py --series 20000 --method auto
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import polars as pl
from peak_memory import in_fresh_process, measured

MODELS, WINDOWS, STEPS, CHUNK = 4, 3, 12, 1000


def write_chunks(series: int, directory: Path) -> list[Path]:
    """The backtest files of `series` series, CHUNK series each, as a run's chunks write them."""
    from shardwise.manymodel.columns import SERIES

    rng = np.random.default_rng(0)
    per_series = MODELS * WINDOWS * STEPS
    paths = []
    for start in range(0, series, CHUNK):
        count = min(CHUNK, series - start)
        n = count * per_series
        scale = np.repeat(rng.gamma(2.0, 5.0, count), per_series)
        actual = 100 + scale * rng.normal(0, 1, n)
        frame = pl.DataFrame(
            {
                SERIES: np.repeat(np.arange(start, start + count), per_series),
                "model": np.tile(
                    np.repeat([f"m{i}" for i in range(MODELS)], WINDOWS * STEPS), count
                ),
                "window": np.tile(np.repeat(np.arange(WINDOWS), STEPS), count * MODELS),
                "origin": 0,
                "step": np.tile(np.arange(1, STEPS + 1), count * MODELS * WINDOWS),
                "forecast": actual + scale * rng.gamma(1.5, 1.0, n) * rng.choice([-1, 1], n),
                "actual": actual,
                "scale": scale,
            }
        )
        path = directory / f"backtest-{start // CHUNK:06d}.parquet"
        frame.write_parquet(path)
        paths.append(path)
    return paths


def measure(directory: Path, whole: bool, method: str) -> dict[str, object]:
    """One `calibrate` call in this process: in parts of `PART_SERIES` series (as outputs.py
    reads them) or, `whole`, every file as one part."""
    from shardwise.manymodel.evaluation.intervals import calibrate
    from shardwise.manymodel.run import outputs

    files = sorted(directory.glob("backtest-*.parquet"))
    parts = [pl.scan_parquet(files)] if whole else outputs._parts(files, CHUNK)
    # polars' first query of each kind allocates its pools: not this call's memory
    calibrate([pl.scan_parquet(files[0]).head(2000)], [80, 95], WINDOWS, method, lambda r: r)
    got, seconds, mib = measured(
        lambda: calibrate(
            parts, [80, 95], WINDOWS, method, sources=lambda rows: rows, spacing=STEPS
        )
    )
    pooled = got.pooled.sort("model", "window", "step")
    return {
        "seconds": seconds,
        "mib": mib,
        "parts": len(parts),
        "pooled": pooled.to_dicts(),
        "scores": {level: v.scores for level, v in got.levels.items()},
        "methods": {level: v.method for level, v in got.levels.items()},
    }


def _same(one: dict, other: dict) -> str:
    """Whether two measurements' results agree: widths and methods equal, scores within
    1e-12 (sums over parts add in another order)."""
    if one["pooled"] != other["pooled"] or one["methods"] != other["methods"]:
        return "NO: the widths differ"
    for level, scores in one["scores"].items():
        for name, value in scores.items():
            if not np.isclose(value, other["scores"][level][name], rtol=1e-12, atol=0):
                return f"NO: {name}"
    return "yes (widths equal, scores within 1e-12)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--series", default="20000,100000", help="comma-separated sizes")
    parser.add_argument("--method", default="pooled", help="backtest.intervals")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # directory:form, in a child process
    args = parser.parse_args()
    if args.one:
        directory, form = args.one.rsplit(":", 1)
        print(json.dumps(measure(Path(directory), form == "whole", args.method)))
        return
    print(
        f"calibrate({args.method}, [80, 95]): {MODELS} models × {WINDOWS} windows × {STEPS} "
        f"steps per series, chunks of {CHUNK} series"
    )
    print(f"{'series':>8} {'rows':>11} {'read as':>16} {'seconds':>8} {'MiB':>7}  same result")
    for series in (int(s) for s in args.series.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            write_chunks(series, Path(tmp))
            got = {}
            for form in ("whole", "parts"):
                one = in_fresh_process(
                    [sys.executable, __file__, "--method", args.method, "--one", f"{tmp}:{form}"]
                )
                if one is None:
                    print(f"{series:>8} {form:>16}  killed: out of memory", flush=True)
                    continue
                got[form] = one
                read_as = "one part" if form == "whole" else f"{got[form]['parts']} parts"
                same = ""
                if form == "parts" and "whole" in got:
                    same = _same(got["whole"], got[form])
                rows = series * MODELS * WINDOWS * STEPS
                print(
                    f"{series:>8} {rows:>11,} {read_as:>16} {got[form]['seconds']:>8.1f} "
                    f"{got[form]['mib']:>7.0f}  {same}",
                    flush=True,
                )
            if len(got) == 2:
                ratio = got["whole"]["mib"] / max(got["parts"]["mib"], 1)
                print(f"{'':>8} memory, one part / in parts: {ratio:.1f}×", flush=True)


if __name__ == "__main__":
    main()
