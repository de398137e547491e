"""`shardwise many-models`: read the series, compute features, then backtest, select and forecast
every series in chunks on Ray, persisting each chunk's results as it finishes.

Main flow (`run`): `load_series` → `feature_files.write_features` (chunks of whole series, on disk
in `<run_dir>/features/`) → one task per chunk (`backtest.run_chunk`, fractional CPUs/GPUs, retried
when its worker dies), each chunk read and put in Ray's object store as Arrow when it is submitted →
each finished chunk written atomically to `<run_dir>/chunks/` → output tables from them, a few
chunks at a time (`outputs.assemble`) → MLflow run, summary. `--resume` reuses the chunks already
written and runs only the rest.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import math
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import polars as pl
import tomli_w
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from shardwise.common.console import warn
from shardwise.common.errors import ConfigError
from shardwise.common.job_files import flatten, shown
from shardwise.common.ray_cluster import check_ray_address, loopback_ray, ray_logs_to
from shardwise.manymodel.backtest import ChunkResult, Plan, run_chunk
from shardwise.manymodel.columns import SERIES
from shardwise.manymodel.config import (
    BUILTIN_MODELS,
    BUILTIN_SOURCES,
    ManyModelsConfig,
    model_differenced,
    model_global,
    model_label,
    model_scale,
)
from shardwise.manymodel.context import ModelContext
from shardwise.manymodel.data import SeriesTable, load_series
from shardwise.manymodel.eta import Eta
from shardwise.manymodel.feature_files import FeatureChunks, write_features
from shardwise.manymodel.features import FeatureSpec
from shardwise.manymodel.outputs import TABLES, assemble, chosen_forecasts
from shardwise.manymodel.summary import Summary, print_summary, start_tracking, summarise, track
from shardwise.manymodel.transforms import TARGET, TargetTransform

GLOBAL_FILE = "global.parquet"
_MAX_CHUNK = 100
_CHUNKS_PER_SLOT = 4
_IGNORED_ON_RESUME = ("runner.", "tracking.", "features.backend", "features.spark_master")
"""Keys a resumed run may change: where and how it runs, not what it computes."""
_CHUNK_NAME = re.compile(r"chunk-([0-9]{6,})")
"""A finished chunk's directory (`_write_chunk`); other entries in `chunks/` are not results."""
THREAD_ENV = {
    name: "1"
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "POLARS_MAX_THREADS")
}


def run(
    config: ManyModelsConfig, *, resume: bool = False, console: Console | None = None
) -> Summary:
    """Run a many-models job; the CLI and `shardwise.many_models` call this."""
    console = console or Console(stderr=True)
    started = time.perf_counter()
    run_dir = config.run_dir
    done = _finished_chunks(run_dir, config, resume)
    ray_module = sys.modules.get("ray")
    connected = ray_module is not None and ray_module.is_initialized()  # the Python API's caller
    if config.runner.ray_address and not connected:  # fail in seconds, before reading the data
        check_ray_address(
            config.runner.ray_address, f"runner.ray_address = '{config.runner.ray_address}'"
        )
    table = load_series(config)
    if table.skipped.height:
        console.print(
            f"skipping {table.skipped.height} series too short for the backtest "
            f"(listed in {run_dir / 'skipped.parquet'})"
        )
    spec = FeatureSpec.from_config(config, table.season_length)
    others = set(table.frame.columns) - {table.columns.target}
    clash = sorted(set(spec.columns()) & set(table.frame.columns) | {TARGET} & others)
    if clash:
        raise ConfigError(
            f"input column '{clash[0]}' has the name of a computed feature (or of the target's "
            "name inside models, 'y'); rename it in the data"
        )
    plan = make_plan(config, table, spec)
    saved_size = _saved_chunk_size(run_dir, table.num_series, done)
    _start_run_dir(run_dir, config)
    mlflow_run = start_tracking(config, run_dir)
    ray, started_ray = start_ray(config)
    try:
        slots = task_slots(ray, config)
        chunk_size = saved_size or _chunk_size(run_dir, config, table.num_series, slots)
        n_chunks = math.ceil(table.num_series / chunk_size)
        todo = [i for i in range(n_chunks) if i not in done]
        fitted = (run_dir / "chunks" / GLOBAL_FILE).exists()
        features_started = time.perf_counter()
        features = write_features(
            table.frame, spec, table.columns, run_dir / "features", chunk_size,
            todo if fitted or not plan.global_models else None,  # global fits read every chunk
            backend=config.features.backend, spark_master=config.features.spark_master,
            source=_file_rows(config),
        )  # fmt: skip
        features_seconds = time.perf_counter() - features_started
        console.print(
            f"{table.num_series} series, {table.freq} steps, season {table.season_length}; "
            f"{len(spec.columns())} features ({features.made_by}) in "
            f"{features_seconds:.1f} s"
        )
        if done:
            console.print(
                f"resuming: {len(done)} of {n_chunks} chunks already done, {len(todo)} to run"
            )
        train_started = time.perf_counter()
        given = _global_forecasts(ray, config, plan, features, todo, slots, console)
        intervals = _run_chunks(ray, config, plan, (features, given), todo, slots, done, console)
        train_seconds = time.perf_counter() - train_started
    finally:
        if started_ray:
            ray.shutdown()
        shutil.rmtree(run_dir / "features", ignore_errors=True)  # scratch: big, and redone
    outputs, selection, calibration = assemble(config, table, n_chunks, chunk_size)
    # the chosen forecasts were streamed to their file: read back once, for what needs them
    wanted = bool(config.hierarchy.levels) or config.tracking.plots
    chosen = chosen_forecasts(run_dir, table) if wanted else None
    if chosen is not None and config.hierarchy.levels:
        from shardwise.manymodel.reconciliation import reconcile_run

        reconcile_run(config, table, chosen, console)
    summary = summarise(
        config,
        table,
        outputs,
        selection,
        calibration,
        chunks_run=len(todo),
        chunks_reused=len(done),
        peak=_peak_concurrency(intervals),
        seconds={
            "features": features_seconds,
            "models": train_seconds,
            "total": time.perf_counter() - started,
        },
    )
    if chosen is not None and config.tracking.plots:
        from shardwise.manymodel.plots import write_plots

        write_plots(run_dir, table, {**outputs, "forecasts": chosen}, seed=config.job.seed)
    summary.mlflow_run_id = track(mlflow_run, config, summary, run_dir)
    print_summary(console, summary)
    if config.tracking.plots:
        console.print(f"plots: {run_dir / 'plots'}")
    return summary


def _file_rows(config: ManyModelsConfig) -> str | None:
    """data.source where the checked table is its rows (a file, and no hierarchy's sums)."""
    source = config.data.source
    return None if source in BUILTIN_SOURCES or config.hierarchy.levels else source


def make_plan(config: ManyModelsConfig, table: SeriesTable, spec: FeatureSpec) -> Plan:
    level, spread = spec.target_scaled()
    context = ModelContext(
        target=TARGET,
        features=(*table.columns.covariates, *spec.columns()),
        categorical=tuple(name for name, _ in spec.calendar_columns),
        season_length=table.season_length,
        seed=config.job.seed,
        freq=table.freq,
    )
    models = tuple(
        (model_label(name), name, dict(config.models.args.get(model_label(name), {})))
        for name in config.models.names
    )
    # Build each model once here: a bad name or argument fails before any task starts.
    from shardwise.manymodel.models import build

    for _, name, args in models:
        build(name, args, context)
    return Plan(
        columns=table.columns,
        context=context,
        models=models,
        transforms={
            model_label(name): TargetTransform(
                scale=model_scale(config, name),
                anchor=spec.lag_columns[0] if model_differenced(config, name) else "",
                level=tuple(level),
                spread=tuple(spread),
            )
            for name in config.models.names
        },
        horizon=config.backtest.horizon,
        n_windows=config.backtest.n_windows,
        step=config.backtest_step,
        metric=config.backtest.metric,
        memory_mb=config.runner.memory_mb,
        ensemble_top_k=config.backtest.ensemble_top_k,
        levels=tuple(sorted(set(config.backtest.levels))),
        intervals=config.backtest.intervals,
        refit=config.refit_every,
        reselect=config.backtest.reselect,
        global_models=frozenset(
            model_label(name) for name in config.models.names if model_global(config, name)
        ),
    )


def _finished_chunks(run_dir: Path, config: ManyModelsConfig, resume: bool) -> set[int]:
    """The chunks an earlier run finished, checked against `--resume` and the job it ran."""
    chunk_dir = run_dir / "chunks"
    names = (_CHUNK_NAME.fullmatch(p.name) for p in chunk_dir.glob("chunk-*"))
    marked = {m[0] for m in names if m and (chunk_dir / m[0] / "done").exists()}
    if marked and not resume:
        raise ConfigError(
            f"{run_dir} already has results of an earlier run; pass --resume to finish it, or set "
            "job.name or job.run_dir for a new one"
        )
    # a chunk missing a file since (not as _write_chunk leaves one) is run again
    done = {int(name.removeprefix("chunk-")) for name in marked if _complete(chunk_dir / name)}
    saved = run_dir / "job.toml"
    if done and saved.exists():
        from shardwise.common.job_files import load_job_file

        try:
            before = flatten(load_job_file(saved, (), ManyModelsConfig))
        except ConfigError as e:  # written by an earlier shardwise, whose settings changed
            raise ConfigError(
                f"--resume: {saved}, the job its chunks were made by, no longer loads ({e}); "
                "they cannot be reused: use a new job.name or job.run_dir"
            ) from None
        now = flatten(config)
        changed = sorted(
            k
            for k in before.keys() | now.keys()
            if before.get(k) != now.get(k) and not k.startswith(_IGNORED_ON_RESUME)
        )
        if changed:
            raise ConfigError(
                f"--resume: {run_dir} was run with a different job ({', '.join(changed[:3])} "
                "changed); undo the change, or use a new job.name or job.run_dir"
            )
    return done


def _complete(chunk: Path) -> bool:
    """Whether a chunk directory holds everything `_write_chunk` writes (it always does, unless
    someone removed a file since)."""
    return (chunk / "done").exists() and all((chunk / f"{n}.parquet").exists() for n in TABLES)


def _start_run_dir(run_dir: Path, config: ManyModelsConfig) -> None:
    chunk_dir = run_dir / "chunks"
    try:
        chunk_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"cannot create {chunk_dir} ({e.strerror}); set job.run_dir to a writable directory"
        ) from None
    for stale in chunk_dir.glob("*.partial*"):  # a chunk being written when a run died
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)
    for chunk in chunk_dir.glob("chunk-*"):  # a chunk missing a file is run again
        if _CHUNK_NAME.fullmatch(chunk.name) and chunk.is_dir() and not _complete(chunk):
            shutil.rmtree(chunk, ignore_errors=True)
    (run_dir / "job.toml").write_text(tomli_w.dumps(shown(config)))


def _saved_chunk_size(run_dir: Path, series: int, done: set[int]) -> int:
    """The chunk size of the run being resumed (0 when no chunk is reused), checked against
    the data: chunks cut from other data would be reused for the wrong series."""
    if not done:
        return 0
    chunk_dir = run_dir / "chunks"
    try:
        saved = json.loads((chunk_dir / "layout.json").read_text())
        before, size = int(saved["series"]), int(saved["chunk_size"])
    except (OSError, ValueError, KeyError, TypeError):
        before, size = -1, 0
    if size < 1:
        raise ConfigError(
            f"--resume: {chunk_dir} holds finished chunks but no readable layout.json; use a new "
            "job.name or job.run_dir"
        )
    if before != series:
        raise ConfigError(
            f"--resume: the finished chunks in {chunk_dir} were cut from {before} series, the "
            f"data now has {series}; the data changed since: use a new job.name or job.run_dir"
        )
    if max(done) >= math.ceil(series / size):
        raise ConfigError(
            f"--resume: {chunk_dir / f'chunk-{max(done):06d}'} is beyond the "
            f"{math.ceil(series / size)} chunks of this run; remove it, or use a new job.run_dir"
        )
    return size


def _chunk_size(run_dir: Path, config: ManyModelsConfig, series: int, slots: int) -> int:
    """Series per task: enough chunks for every slot to take several (load balance), few enough
    that scheduling costs little."""
    size = config.runner.chunk_size or min(
        _MAX_CHUNK, max(1, math.ceil(series / (slots * _CHUNKS_PER_SLOT)))
    )
    (run_dir / "chunks" / "layout.json").write_text(
        json.dumps({"series": series, "chunk_size": size})
    )
    return size


def task_slots(ray: Any, config: ManyModelsConfig) -> int:
    """How many tasks the cluster can run at once with the requested CPUs, GPUs and memory per
    task; a request no node can satisfy is an error here, not a task pending forever."""
    runner = config.runner
    nodes = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
    needs = {"CPU": runner.num_cpus, "GPU": runner.num_gpus, "memory": runner.memory_mb * 2**20}
    keys = {"CPU": "runner.num_cpus", "GPU": "runner.num_gpus", "memory": "runner.memory_mb"}
    slots = 0
    for resource, need in needs.items():
        if not need:
            continue
        largest = max((node.get(resource, 0.0) for node in nodes), default=0.0)
        if need > largest:
            have = f"{largest / 2**20:.0f} MiB" if resource == "memory" else f"{largest:g}"
            raise ConfigError(
                f"{keys[resource]} asks for more {resource} per task than any Ray node has "
                f"(largest: {have}); lower it"
            )
    for node in nodes:
        fits = [node.get(r, 0.0) / need for r, need in needs.items() if need]
        slots += math.floor(min(fits) + 1e-9)
    return max(slots, 1)


def start_ray(config: ManyModelsConfig) -> tuple[Any, bool]:
    """Ray, and whether this call started it (and so should stop it). Locally, workers import
    user models from the working directory, as the driver does; on a cluster, the working
    directory is shipped to the workers (without virtualenvs, runs and VCS data). A local
    instance listens on loopback only (`LOCAL_RAY_ENV`)."""
    address = config.runner.ray_address or None
    with contextlib.nullcontext() if address else loopback_ray():
        import ray
    if ray.is_initialized():
        return ray, False
    cwd = os.getcwd()
    env = dict(THREAD_ENV)
    runtime_env: dict[str, Any] = {"env_vars": env}
    if address is None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (cwd, os.environ.get("PYTHONPATH")) if p)
    elif any(name not in BUILTIN_MODELS for name in config.models.names):
        runtime_env["working_dir"] = cwd
        runtime_env["excludes"] = [
            ".venv/", "runs/", ".git/", "**/__pycache__/", ".*_cache/", "*.egg-info/"
        ]  # fmt: skip
    try:
        with (
            contextlib.nullcontext() if address else loopback_ray(),
            ray_logs_to(config.run_dir / "ray.log"),
        ):
            ray.init(
                # "local": a fresh instance even when a `ray start` cluster runs on this machine
                address=address or "local",
                runtime_env=runtime_env,
                include_dashboard=False,
                configure_logging=False,
            )
    except ConnectionError as e:  # something answers at the address, but not Ray
        if address is None:
            raise
        raise ConfigError(
            f"runner.ray_address = '{address}': {str(e).strip().splitlines()[0]}; check that a "
            f"Ray {ray.__version__} cluster runs there"
        ) from None
    node: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
    if not address and not ipaddress.ip_address(node).is_loopback:
        warn(
            f"the local Ray instance listens on {node}, not only on loopback: ray was "
            "imported before shardwise started it",
            stacklevel=2,
        )
    return ray, True


def _global_forecasts(
    ray: Any,
    config: ManyModelsConfig,
    plan: Plan,
    features: FeatureChunks,
    todo: list[int],
    slots: int,
    console: Console,
) -> list[pl.DataFrame | None]:
    """Per chunk, the global models' forecasts of its series (None without global models).
    They are fitted once per run (`chunks/global.parquet`; a resumed run reuses them)."""
    if not plan.global_models or not todo:
        return [None] * len(features)
    saved = config.run_dir / "chunks" / GLOBAL_FILE
    if saved.exists():
        given = pl.read_parquet(saved)
    else:
        from shardwise.manymodel.global_models import fit_global

        started = time.perf_counter()
        workers = min(slots, config.runner.global_workers or slots)
        refs = [ray.put(features.read(i).to_arrow()) for i in range(len(features))]
        given = fit_global(ray, plan, refs, workers, config.runner.num_cpus)
        del refs
        partial = saved.with_suffix(f".partial-{os.getpid()}")
        given.write_parquet(partial)
        os.replace(partial, saved)
        console.print(
            f"global models ({', '.join(sorted(plan.global_models))}) fitted on "
            f"{min(workers, len(features))} workers in {time.perf_counter() - started:.1f} s"
        )
    keyed = given.with_columns((pl.col(SERIES) // features.size).alias("_chunk"))
    parts = keyed.partition_by("_chunk", as_dict=True, include_key=False)
    empty = given.clear()
    return [parts.get((i,), empty) for i in range(len(features))]


def _run_chunks(
    ray: Any,
    config: ManyModelsConfig,
    plan: Plan,
    parts: tuple[FeatureChunks, list[pl.DataFrame | None]],
    todo: list[int],
    slots: int,
    done: set[int],
    console: Console,
) -> list[tuple[float, float]]:
    runner = config.runner
    features, given = parts
    task = ray.remote(run_chunk).options(
        num_cpus=runner.num_cpus,
        num_gpus=runner.num_gpus,
        max_retries=runner.max_retries,
        memory=runner.memory_mb * 2**20 or None,
    )
    plan_ref = ray.put(plan)
    # Longest chunks first, so the run does not end waiting on one long chunk (the work grows
    # with the rows); a few per task slot in flight, each read from disk and put into the
    # object store when it is submitted, not all of them at the start.
    queue = sorted(todo, key=lambda i: -features.rows[i])
    in_flight = max(2, 2 * slots)
    pending: dict[Any, int] = {}

    def submit() -> None:
        while queue and len(pending) < in_flight:
            index = queue.pop(0)
            rows = ray.put(features.read(index).to_arrow())
            part = given[index]
            forecasts = part.to_arrow() if part is not None else None
            pending[task.remote(rows, plan_ref, forecasts)] = index

    submit()
    total_series = features.series
    reused = sum(len(features.series_of(i)) for i in done)
    intervals: list[tuple[float, float]] = []
    started, finished, failed = time.monotonic(), reused, 0
    eta = Eta(rows=sum(features.rows[i] for i in todo), slots=slots)
    with Progress(
        TextColumn("[bold]series"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} done · {task.fields[failed]} failed"),
        TimeElapsedColumn(),
        TextColumn("ETA {task.fields[eta]}"),
        console=console,
        transient=False,
        disable=not console.is_terminal,
    ) as progress:
        bar = progress.add_task("series", total=total_series, completed=reused, failed=0, eta="–")
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                index = pending.pop(ref)
                try:
                    result: ChunkResult = ray.get(ref)
                    took: float | None = result.finished - result.started
                except ray.exceptions.RayError as e:
                    result, took = _lost_chunk(features.series_of(index), e, plan.levels), None
                _write_chunk(config.run_dir / "chunks", index, result)
                intervals.append((result.started, result.finished))
                failed += result.failed_series
                finished += result.series
                eta.done(features.rows[index], took, result.pid)
                left = eta.seconds()
                progress.update(bar, completed=finished, failed=failed, eta=f"{left:.0f} s")
                submit()
                if not console.is_terminal:  # a log line per chunk instead of a bar
                    console.print(
                        f"series {finished}/{total_series} done · {failed} failed · "
                        f"{time.monotonic() - started:.0f} s · ETA {left:.0f} s",
                        highlight=False,
                    )
    return intervals


def _lost_chunk(series: range, error: Exception, levels: tuple[int, ...]) -> ChunkResult:
    """A chunk whose worker died more often than `max_retries`: every series in it failed (its
    tables have the interval columns of the others, `levels`)."""
    result = ChunkResult(started=time.time(), finished=time.time(), levels=levels)
    message = f"{type(error).__name__}: worker lost after retries ({str(error).splitlines()[0]})"
    for number in series:
        result.failures.append({SERIES: number, "model": "*", "stage": "task", "error": message})
        result.series += 1
        result.failed_series += 1
    return result


def _write_chunk(chunk_dir: Path, index: int, result: ChunkResult) -> None:
    """Write a chunk's tables to a temporary directory, then rename it into place: a chunk
    directory is either complete or absent."""
    final = chunk_dir / f"chunk-{index:06d}"
    partial = chunk_dir / f"chunk-{index:06d}.partial-{os.getpid()}"
    partial.mkdir()
    for name, frame in result.tables().items():
        frame.write_parquet(partial / f"{name}.parquet")
    (partial / "done").write_text(
        json.dumps({"started": result.started, "finished": result.finished, "pid": result.pid})
    )
    os.replace(partial, final)


def _peak_concurrency(intervals: list[tuple[float, float]]) -> int:
    """Most chunks that were running at the same moment, from their measured start and end."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    peak = running = 0
    for _, change in events:
        running += change
        peak = max(peak, running)
    return peak


many_models = run
