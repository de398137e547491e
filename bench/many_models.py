"""Many-models throughput: series/s of shardwise's Ray runner against (a) a sequential Python
loop, (b) one Ray task per series, (c) joblib over the same function; and the feature engines:
polars against a pandas groupby implementation of the same spec, and Spark.

Every contender runs the same per-series work (`backtest.forecast_series`: rolling-origin
backtest of the same models, selection, refit, forecast) on the same feature table, with one
BLAS/OpenMP/torch thread per worker. shardwise is timed over its whole model stage as a user gets
it (tasks, object store, chunk files written). Ray and joblib workers are warmed up first; Ray's
start-up is reported separately. Contenders are interleaved and repeated; medians, spreads and
ratios are printed.

    python bench/many_models.py                       # about 20 minutes on 2 cores
    python bench/many_models.py --series 1000 --repeats 1
    python bench/many_models.py --scale 2000,20000,100000  # ~40 minutes: cost per series by size
    python bench/many_models.py --scale 20000 --no-refit   # each model fitted once per series
    python bench/many_models.py --scale 100000 --from-file # read from Parquet, as users' data is
    python bench/many_models.py --scale 100000 --levels 80,95  # with prediction intervals

`--scale` runs the whole job (`shardwise.many_models`: generate, features, Ray tasks, chunk
files, assembled outputs) once per size, each in a fresh driver process, and prints series/s,
seconds per 1000 series relative to the smallest size (flat means linear), and the driver's peak
resident memory (its own `ru_maxrss`: Ray's workers and object store are other processes).
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import polars as pl

from shardwise.common.job_files import validate_as
from shardwise.manymodel.columns import SERIES
from shardwise.manymodel.config import ManyModelsConfig
from shardwise.manymodel.data.long_table import SeriesTable, load_series
from shardwise.manymodel.evaluation.backtest import Plan
from shardwise.manymodel.features.spec import FeatureSpec, polars_features
from shardwise.manymodel.run.chunk import run_chunk
from shardwise.manymodel.run.ray_tasks import start_ray
from shardwise.manymodel.run.runner import make_plan, run
from shardwise.manymodel.run.warm_imports import THREAD_ENV

MODELS = {
    "names": ["seasonal_naive", "ridge", "lightgbm"],
    "args": {"lightgbm": {"n_estimators": 20}},
}
DATASETS = {
    "retail_synthetic": {
        "data": {"source": "retail_synthetic", "periods": 104},
        "features": {
            "lags": [4, 5, 6, 52],
            "rolling_windows": [4, 13],
            "rolling_stats": ["mean", "std"],
            "calendar": ["week"],
            "group_by": [["store"]],
        },
        "backtest": {"horizon": 4, "n_windows": 2, "metric": "mae", "min_train": 26},
    },
    "us_employment": {
        "data": {"source": "us_employment"},
        "features": {
            "lags": [12, 13, 24],
            "rolling_windows": [3, 12],
            "rolling_stats": ["mean", "std"],
            "calendar": ["month"],
        },
        "backtest": {"horizon": 12, "n_windows": 2},
    },
}


def job(name: str, series: int, run_dir: Path) -> ManyModelsConfig:
    raw = {k: dict(v) for k, v in DATASETS[name].items()}
    raw["data"] = {**raw["data"], "num_series": series if name == "retail_synthetic" else 0}
    raw["models"] = MODELS
    raw["job"] = {"name": name, "run_dir": str(run_dir)}
    raw["runner"] = {"num_cpus": 1}
    raw["tracking"] = {"mlflow": False}
    return validate_as(ManyModelsConfig, raw)


def prepared(config: ManyModelsConfig) -> tuple[SeriesTable, pl.DataFrame, Plan]:
    table = load_series(config)
    spec = FeatureSpec.from_config(config, table.season_length)
    features = polars_features(table.frame, spec, table.columns)
    return table, features, make_plan(config, table, spec)


def sequential(features: pl.DataFrame, plan: Plan, scratch: Path) -> float:
    """A plain loop over the series in a fresh process (the bench process is a Ray driver, whose
    background threads would slow a loop run here). Returns the loop's own time."""
    features.write_parquet(scratch / "features.parquet")
    (scratch / "plan.pkl").write_bytes(pickle.dumps(plan))
    code = (
        "import pickle, sys, time, polars as pl\n"
        "from shardwise.manymodel.run.chunk import run_chunk\n"
        "d = sys.argv[1]\n"
        "features = pl.read_parquet(d + '/features.parquet')\n"
        "plan = pickle.loads(open(d + '/plan.pkl', 'rb').read())\n"
        "run_chunk(features.head(1), plan)\n"  # warm-up: lazy imports of the model libraries
        "start = time.perf_counter()\n"
        "run_chunk(features, plan)\n"
        "print(time.perf_counter() - start)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(scratch)], capture_output=True, text=True, check=True
    )
    return float(out.stdout.strip().splitlines()[-1])


def ray_per_series(features: pl.DataFrame, plan: Plan) -> int:
    import ray

    task = ray.remote(run_chunk).options(num_cpus=1)
    plan_ref = ray.put(plan)
    refs = [task.remote(ray.put(p.to_arrow()), plan_ref) for p in features.partition_by(SERIES)]
    return sum(r.series for r in ray.get(refs))


def joblib_loky(features: pl.DataFrame, plan: Plan) -> int:
    from joblib import Parallel, delayed

    parts = features.partition_by(SERIES)
    results = Parallel(n_jobs=2)(delayed(run_chunk)(p, plan) for p in parts)
    return sum(r.series for r in results)


def shardwise_runner(
    config: ManyModelsConfig, fresh_dir: Callable[[], Path]
) -> Callable[[], float]:
    def go() -> float:
        summary = run(
            config.model_copy(
                update={"job": config.job.model_copy(update={"run_dir": str(fresh_dir())})}
            )
        )
        return summary.seconds["models"]

    return go


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_models(name: str, series: int, repeats: int, scratch: Path) -> None:
    counter = iter(range(10**6))

    def fresh_dir() -> Path:
        return scratch / f"{name}-{next(counter)}"

    config = job(name, series, fresh_dir())
    table, features, plan = prepared(config)
    n = table.num_series
    print(
        f"\n{name}: {n} series, models {MODELS['names']}, "
        f"{plan.n_windows} windows × horizon {plan.horizon}"
    )
    started = time.perf_counter()
    start_ray(config)
    print(f"  Ray start-up {time.perf_counter() - started:.1f} s (not counted below)")
    warm = features.filter(pl.col(SERIES) < 8)
    ray_per_series(warm, plan)
    joblib_loky(warm, plan)
    contenders: dict[str, Callable[[], float]] = {
        "sequential loop": lambda: sequential(features, plan, scratch),
        "shardwise (Ray, chunked)": shardwise_runner(config, fresh_dir),
        "one Ray task per series": lambda: timed(lambda: ray_per_series(features, plan)),
        "joblib (loky, 2 workers)": lambda: timed(lambda: joblib_loky(features, plan)),
    }
    seconds: dict[str, list[float]] = {k: [] for k in contenders}
    for r in range(repeats):
        for label, fn in contenders.items():
            seconds[label].append(fn())
            print(
                f"  repeat {r + 1}: {label:<28} {n / seconds[label][-1]:8.1f} series/s", flush=True
            )
    base = statistics.median(seconds["sequential loop"])
    print(f"  {'contender':<28} {'series/s':>9} {'vs sequential':>14}   spread (series/s)")
    for label, values in seconds.items():
        med = statistics.median(values)
        spread = f"{n / max(values):.1f}-{n / min(values):.1f}"
        print(f"  {label:<28} {n / med:9.1f} {base / med:13.2f}x   {spread}")


def pandas_features(
    frame: pl.DataFrame, spec: FeatureSpec, ids: list[str], ts: str, y: str
) -> object:
    """The same spec with pandas groupby operations: the common hand-written baseline."""
    df = frame.to_pandas().sort_values([*ids, ts])
    by = df.groupby(ids, sort=False)[y]
    for k in spec.lags:
        df[f"lag{k}"] = by.shift(k)
    df["_shifted"] = by.shift(spec.shift)
    shifted = df.groupby(ids, sort=False)["_shifted"]
    for name, w, stat in spec.rolling_columns:
        df[name] = shifted.transform(
            lambda s, w=w, stat=stat: getattr(s.rolling(w, min_periods=w), stat)()
        )
    for name, stat in spec.expanding_columns:
        df[name] = shifted.transform(lambda s, stat=stat: getattr(s.expanding(), stat)())
    for name, part in spec.calendar_columns:
        stamp = df[ts].dt
        df[name] = stamp.isocalendar().week if part == "week" else stamp.month
    for name, group, stat in spec.group_columns:
        df[name] = df.groupby([*group, ts])["_shifted"].transform(stat)
    return df.drop(columns="_shifted")


def bench_features(series: int, repeats: int, scratch: Path) -> None:
    from shardwise.common.spark_session import session
    from shardwise.manymodel.features.feature_files import write_features

    config = job("retail_synthetic", series, scratch / "features")
    table = load_series(config)
    spec = FeatureSpec.from_config(config, table.season_length)
    cols = table.columns
    rows = table.frame.height
    print(
        f"\nfeatures: retail_synthetic, {table.num_series} series, {rows:,} rows, "
        f"{len(spec.columns())} features"
    )
    started = time.perf_counter()
    session("local[*]")
    print(f"  Spark session start-up {time.perf_counter() - started:.1f} s (not counted below)")

    def to_files(backend: str, frame: pl.DataFrame = table.frame) -> None:
        """What the runner does: features written chunk by chunk (100 series each)."""
        out = scratch / "feature-files"
        write_features(frame, spec, cols, out, 100, backend=backend, spark_master="local[*]")

    to_files("spark", table.frame.filter(pl.col(SERIES) < 10))  # warm-up
    contenders = {
        "polars": lambda: polars_features(table.frame, spec, cols),
        "pandas groupby": lambda: pandas_features(
            table.frame, spec, list(cols.ids), cols.timestamp, cols.target
        ),
        "polars, to files": lambda: to_files("polars"),
        "spark local[*], to files": lambda: to_files("spark"),
    }
    seconds: dict[str, list[float]] = {k: [] for k in contenders}
    for r in range(repeats):
        for label, fn in contenders.items():
            seconds[label].append(timed(fn))
            print(f"  repeat {r + 1}: {label:<24} {seconds[label][-1]:7.2f} s", flush=True)
    base = statistics.median(seconds["pandas groupby"])
    print(f"  {'backend':<24} {'seconds':>8} {'rows/s':>12} {'vs pandas':>10}")
    for label, values in seconds.items():
        med = statistics.median(values)
        print(f"  {label:<24} {med:8.2f} {rows / med:12,.0f} {base / med:9.2f}x")


_SCALE_RUN = """
import json, resource, sys, time
from pathlib import Path
sys.path.insert(0, {bench!r})
from many_models import job
from shardwise.manymodel.run.runner import run
config = job("retail_synthetic", {series}, Path({run_dir!r}))
config.backtest.refit = {refit!r}
config.backtest.levels = {levels!r}
if {source!r}:  # the same series from a Parquet file, as a user's data would come
    config.data.source, config.data.num_series = {source!r}, 0
    config.data.id_columns, config.data.timestamp = ["store", "item"], "week"
    config.data.target, config.data.covariates = "sales", ["promo"]
began = time.perf_counter()
summary = run(config)
print(json.dumps({{
    "series": summary.series, "failed": summary.failed, "seconds": summary.seconds,
    "wall": time.perf_counter() - began,
    "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
}}))
"""


_WRITE_FILE = """
import sys
from pathlib import Path
sys.path.insert(0, {bench!r})
from many_models import job
from shardwise.manymodel.data import datasets
config = job("retail_synthetic", {series}, Path("unused"))
data = datasets.retail_synthetic(
    {series}, config.data.periods, future=config.backtest.horizon, seed=config.job.seed
)
data.frame.write_parquet({source!r})
"""


def bench_scale(
    sizes: list[int],
    scratch: Path,
    refit: bool = True,
    from_file: bool = False,
    levels: tuple[int, ...] = (),
) -> None:
    """The whole job at each size in a fresh driver process: time and the driver's memory.
    `from_file`: the series are read from a Parquet file (written first, by another process)
    rather than generated in the driver; `levels`: prediction intervals (backtest.levels)."""
    import json

    print(
        f"\nscale: retail_synthetic{' from a Parquet file' if from_file else ''}, models "
        f"{MODELS['names']}, backtest.refit = {str(refit).lower()}, backtest.levels = "
        f"{list(levels)}, one run per size"
    )
    rows = []
    bench = str(Path(__file__).parent)
    for size in sizes:
        source = str(scratch / f"retail-{size}.parquet") if from_file else ""
        if source:
            subprocess.run(
                [sys.executable, "-c", _WRITE_FILE.format(bench=bench, series=size, source=source)],
                check=True,
            )
        code = _SCALE_RUN.format(
            bench=bench,
            series=size,
            run_dir=str(scratch / f"scale-{size}"),
            refit=refit,
            source=source,
            levels=list(levels),
        )
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=False
        )
        if out.returncode:
            print(f"  {size}: failed\n{out.stderr[-2000:]}")
            continue
        got = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append((size, got))
        print(
            f"  {size:>7} series: {got['wall']:7.1f} s in all (features "
            f"{got['seconds']['features']:.1f} s, models {got['seconds']['models']:.1f} s, "
            f"outputs {got['seconds']['outputs']:.1f} s), "
            f"{size / got['wall']:6.1f} series/s, driver peak {got['peak_mb']:7.0f} MiB, "
            f"{got['failed']} failed",
            flush=True,
        )
    if rows:
        base = rows[0][1]["wall"] / rows[0][0]
        print(f"  {'series':>7} {'s per 1000':>11} {'vs smallest':>12} {'MiB per 1000':>13}")
        for size, got in rows:
            per = got["wall"] / size
            print(
                f"  {size:>7} {1000 * per:11.2f} {per / base:11.2f}x "
                f"{1000 * got['peak_mb'] / size:13.1f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--series", type=int, default=5000, help="synthetic series (≥ 5000 for the issue's figure)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", choices=("models", "features"), default=None)
    parser.add_argument(
        "--scale", default="", help="comma-separated series counts: the whole job at each size"
    )
    parser.add_argument(
        "--no-refit",
        action="store_true",
        help="with --scale: backtest.refit = false (each model fitted once per series)",
    )
    parser.add_argument(
        "--from-file",
        action="store_true",
        help="with --scale: read the series from a Parquet file, not generate them in the driver",
    )
    parser.add_argument(
        "--levels", default="", help="with --scale: backtest.levels, e.g. 80,95 (intervals)"
    )
    args = parser.parse_args()
    if (args.no_refit or args.from_file or args.levels) and not args.scale:
        parser.error("--no-refit, --from-file and --levels apply to --scale runs only")
    if args.scale:
        with tempfile.TemporaryDirectory(prefix="shardwise-bench-") as tmp:
            sizes = [int(n) for n in args.scale.split(",")]
            levels = tuple(int(n) for n in args.levels.split(",") if n)
            bench_scale(
                sizes, Path(tmp), refit=not args.no_refit, from_file=args.from_file, levels=levels
            )
        return
    if args.only is None:  # each part in its own process, with its own thread settings
        for part in ("features", "models"):
            command = [sys.executable, __file__, "--only", part]
            subprocess.run([*command, f"--series={args.series}", f"--repeats={args.repeats}"])
        return
    if args.only == "models" and os.environ.get("POLARS_MAX_THREADS") != "1":
        # The sequential loop runs here: give it the one-thread settings Ray's and joblib's
        # workers get (polars must see them before it is imported).
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **THREAD_ENV})
    with tempfile.TemporaryDirectory(prefix="shardwise-bench-") as tmp:
        scratch = Path(tmp)
        if args.only == "features":
            bench_features(args.series, args.repeats, scratch)
        else:
            bench_models("us_employment", 0, args.repeats, scratch)
            bench_models("retail_synthetic", args.series, args.repeats, scratch)


if __name__ == "__main__":
    main()
