"""A many-models job against statsforecast alone, for the same work on the same cores: 20, 500 and
10,000 monthly series by default, each size in the same run, interleaved, ratios printed.

The series (60 months: trend, yearly season, noise; seeded) are written once per size to a
Parquet file both read. shardwise runs `shardwise many-models` on it as a user does (its start
line says where the models ran: worker processes or Ray, `runner.backend`), with the same models,
horizon (12) and windows (3, 12 apart, each model fitted again on every one) and its defaults
for the rest. statsforecast runs `cross_validation` of the same models with `n_jobs` = the cores
and then `forecast`: what its user runs for the same outputs. Each side is a fresh process timed
from start to exit, imports included: both are what a user waits for. The CPU seconds of every
process each side started are printed too (counted by the kernel), per series.

    python bench/against_statsforecast.py                          # about 25 minutes on 2 cores
    python bench/against_statsforecast.py --series 20,500 --repeats 3
    python bench/against_statsforecast.py --models seasonal_naive,auto_ets,auto_theta,mstl
    python bench/against_statsforecast.py --series 20 --backend ray   # as before issue 57
    python bench/against_statsforecast.py --series 20 --set tracking.mlflow=false
    python bench/against_statsforecast.py --series 10000 --repeats 2 --set tracking.mlflow=false

Each repeat runs both sides, shardwise first in even repeats and statsforecast first in odd ones.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import polars as pl

BIN = Path(sys.executable).parent
MONTHS, HORIZON, WINDOWS = 60, 12, 3
STATSFORECAST = {
    "seasonal_naive": "SeasonalNaive(season_length=12)",
    "auto_ets": "AutoETS(season_length=12)",
    "auto_theta": "AutoTheta(season_length=12)",
    "auto_arima": "AutoARIMA(season_length=12)",
    "mstl": "MSTL(season_length=12)",
}
BASELINE = """
import os, sys
import pandas as pd
from statsforecast import StatsForecast
from statsforecast.models import AutoARIMA, AutoETS, AutoTheta, MSTL, SeasonalNaive

frame = pd.read_parquet(sys.argv[1])
sf = StatsForecast(models=[{models}], freq="MS", n_jobs={cores})
sf.cross_validation(df=frame, h={horizon}, n_windows={windows}, step_size={horizon}, refit=True)
sf.forecast(df=frame, h={horizon})
"""


def write_series(path: Path, count: int) -> None:
    rng = np.random.default_rng(count)
    month = np.arange(MONTHS)
    level = rng.uniform(50, 500, (count, 1))
    trend = rng.normal(0, 0.5, (count, 1)) * month
    season = rng.uniform(0, 0.3, (count, 1)) * level * np.sin(2 * np.pi * month / 12)
    noise = rng.normal(0, 1, (count, MONTHS)) * level * 0.05
    values = level + trend + season + noise
    dates = pl.date_range(pl.date(2015, 1, 1), pl.date(2019, 12, 1), "1mo", eager=True)
    pl.DataFrame(
        {
            "unique_id": np.repeat([f"s{i:05d}" for i in range(count)], MONTHS),
            "ds": np.tile(dates.to_numpy(), count),
            "y": values.reshape(-1),
        }
    ).with_columns(pl.col("ds").cast(pl.Datetime("ns"))).write_parquet(path)


def job_file(directory: Path, data: Path, models: list[str]) -> Path:
    path = directory / "job.toml"
    path.write_text(
        f"""[job]
name = "against-statsforecast"

[data]
source = "{data}"
id_columns = ["unique_id"]
timestamp = "ds"
target = "y"

[models]
names = {models!r}

[backtest]
horizon = {HORIZON}
n_windows = {WINDOWS}
"""
    )
    return path


def timed(command: list[str], env: dict[str, str]) -> tuple[float, str, float]:
    """`command`'s wall seconds (to its exit), its output, and the CPU seconds of it and of
    every process below it, exactly: the kernel adds a process's CPU time to its parent's
    children's time when the parent reaps it, and what a process leaves running when it ends is
    reparented here (`_adopt_orphans`) and reaped here once it ends."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with tempfile.TemporaryFile("w+") as output:
        began = time.perf_counter()
        process = subprocess.Popen(
            command, stdout=output, stderr=subprocess.STDOUT, text=True, env=env
        )
        process.wait()
        seconds = time.perf_counter() - began
        with contextlib.suppress(ChildProcessError):
            while True:  # what it left running (a server ending after it), until none is left
                os.wait()
        output.seek(0)
        out = output.read()
    if process.returncode:
        raise SystemExit(f"{command[:3]} failed:\n{out[-4000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return seconds, out, cpu


def _adopt_orphans() -> None:
    """Make this process the one that a command's descendants are reparented to when their
    parent ends first (Linux's child subreaper), so that their CPU time is counted here."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


_PR_SET_CHILD_SUBREAPER = 36


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--series", default="20,500,10000")
    parser.add_argument("--models", default="seasonal_naive,auto_ets,auto_theta")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--backend", default="auto", help="shardwise's runner.backend")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="more of shardwise's settings, e.g. tracking.mlflow=false (the baseline tracks none)",
    )
    args = parser.parse_args()
    _adopt_orphans()
    models = args.models.split(",")
    cores = len(os.sched_getaffinity(0))
    env = {**os.environ, "COLUMNS": "200", "PYTHONWARNINGS": "ignore"}
    print(f"{cores} cores; models {', '.join(models)}; horizon {HORIZON}, {WINDOWS} windows")
    baseline = BASELINE.format(
        models=", ".join(STATSFORECAST[m] for m in models),
        cores=cores,
        horizon=HORIZON,
        windows=WINDOWS,
    )
    rows = []
    for count in (int(s) for s in args.series.split(",")):
        with tempfile.TemporaryDirectory() as temp:
            directory = Path(temp)
            data = directory / "series.parquet"
            write_series(data, count)
            job = job_file(directory, data, models)
            times: dict[str, list[float]] = {"shardwise": [], "statsforecast": []}
            cpu: dict[str, list[float]] = {"shardwise": [], "statsforecast": []}
            where = ""
            for repeat in range(args.repeats):
                run_dir = directory / f"run-{repeat}"  # a fresh run each time
                command = [str(BIN / "shardwise"), "many-models", str(job)]
                sets = [
                    "--set",
                    f"job.run_dir={run_dir}",
                    "--set",
                    f"runner.backend={args.backend}",
                    *(part for pair in args.set for part in ("--set", pair)),
                ]
                commands = {
                    "shardwise": [*command, *sets],
                    "statsforecast": [sys.executable, "-c", baseline, str(data)],
                }
                # each side first in every other repeat: a machine that speeds up or slows
                # down over a run favours neither
                sides = list(commands)
                if repeat % 2:
                    sides.reverse()
                for side in sides:
                    seconds, out, used = timed(commands[side], env)
                    times[side].append(seconds)
                    cpu[side].append(used)
                    if side == "shardwise":
                        where = next((ln for ln in out.splitlines() if "models run" in ln), where)
            ours, theirs = (statistics.median(times[k]) for k in ("shardwise", "statsforecast"))
            ours_cpu, theirs_cpu = (statistics.median(cpu[k]) for k in cpu)
            print(
                f"{count:>6} series: shardwise {ours:7.1f} s {times['shardwise']}, statsforecast "
                f"{theirs:7.1f} s {times['statsforecast']}: {theirs / ours:.2f}x "
                f"(> 1: shardwise faster)\n        CPU, every process: shardwise "
                f"{ours_cpu:.1f} s ({1000 * ours_cpu / count:.1f} ms a series), statsforecast "
                f"{theirs_cpu:.1f} s ({1000 * theirs_cpu / count:.1f} ms a series); each "
                f"repeat: {_rounded(cpu['shardwise'])} and {_rounded(cpu['statsforecast'])}"
                f"\n        {where.strip()}",
                flush=True,
            )
            rows.append((count, ours, theirs))
    print("\n| series | shardwise | statsforecast (CV + forecast) | statsforecast / shardwise |")
    print("|---|---|---|---|")
    for count, ours, theirs in rows:
        print(f"| {count:,} | {ours:.1f} s | {theirs:.1f} s | {theirs / ours:.2f}× |")


def _rounded(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.1f}" for v in values) + "]"


if __name__ == "__main__":
    main()
