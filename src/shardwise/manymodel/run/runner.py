"""`shardwise many-models`: read the series, compute features, then backtest, select and forecast
every series in chunks, on worker processes of this machine or on Ray (placement.choose),
persisting each chunk's results as it finishes.

Main flow (`run`): `load_series` → `feature_files.write_features` (chunks of whole series, on disk
in `<run_dir>/features/`) → one task per chunk (`chunk.run_chunk`, retried when its worker dies:
`local_tasks.run_local` in worker processes of this machine, or `ray_tasks.run_chunks` with
fractional CPUs/GPUs, each chunk put in Ray's object store as Arrow when it is submitted) → each
finished chunk written atomically to the chunk store (`chunk_store.py`, `<run_dir>/chunks/`) →
output tables from them, a few chunks at a time (`outputs.assemble`) → MLflow run, summary.
`--resume` reuses the chunks already written and runs only the rest.
"""

from __future__ import annotations

import math
import shutil
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

from rich.console import Console

from shardwise.common.errors import ConfigError
from shardwise.common.ray_cluster import check_ray_address
from shardwise.manymodel.config import (
    BUILTIN_MODELS,
    BUILTIN_SOURCES,
    ManyModelsConfig,
    model_differenced,
    model_global,
    model_label,
    model_scale,
)
from shardwise.manymodel.data.long_table import SeriesTable, load_series
from shardwise.manymodel.evaluation.backtest import Plan
from shardwise.manymodel.features.feature_files import FeatureChunks, write_features
from shardwise.manymodel.features.spec import FeatureSpec
from shardwise.manymodel.models.context import ModelContext
from shardwise.manymodel.models.transforms import TARGET, TargetTransform
from shardwise.manymodel.run.chunk_store import (
    GLOBAL_FILE,
    choose_chunk_size,
    finished_chunks,
    saved_chunk_size,
    start_run_dir,
)
from shardwise.manymodel.run.chunk_tasks import peak_concurrency
from shardwise.manymodel.run.local_tasks import Pool, run_local
from shardwise.manymodel.run.outputs import assemble, chosen_forecasts
from shardwise.manymodel.run.placement import Backend, choose, describe
from shardwise.manymodel.run.ray_tasks import global_forecasts, run_chunks, start_ray, task_slots
from shardwise.manymodel.run.summary import Summary, print_summary, start_tracking, summarise, track


def run(
    config: ManyModelsConfig, *, resume: bool = False, console: Console | None = None
) -> Summary:
    """Run a many-models job; the CLI and `shardwise.many_models` call this."""
    console = console or Console(stderr=True)
    started = time.perf_counter()
    run_dir = config.run_dir
    done = finished_chunks(run_dir, config, resume)
    ray_module = sys.modules.get("ray")
    connected = ray_module is not None and ray_module.is_initialized()  # the Python API's caller
    if config.runner.ray_address and not connected:  # fail in seconds, before reading the data
        check_ray_address(
            config.runner.ray_address, f"runner.ray_address = '{config.runner.ray_address}'"
        )
    backend = choose(config, any(model_global(config, n) for n in config.models.names), connected)
    with Pool(config, backend.slots) if backend.name == "processes" else nullcontext() as pool:
        return _run(config, (backend, pool), done, console, started)


def _run(
    config: ManyModelsConfig,
    where: tuple[Backend, Pool | None],
    done: set[int],
    console: Console,
    started: float,
) -> Summary:
    """`run`, once it knows where the models run (`where`: a `Pool` already starting): the
    data read and planned, the chunks run, the outputs reported."""
    table, spec, plan = _prepare(config, console)
    saved_size = saved_chunk_size(config.run_dir, table.num_series, done)
    start_run_dir(config.run_dir, config)
    mlflow_run = start_tracking(config, config.run_dir)
    ran = _run_chunks(config, where, (table, spec, plan), saved_size, done, console)
    return _report(config, table, ran, (done, mlflow_run, started), console)


def _prepare(config: ManyModelsConfig, console: Console) -> tuple[SeriesTable, FeatureSpec, Plan]:
    """The series read and checked, their features declared, and the plan every chunk runs."""
    table = load_series(config)
    if table.skipped.height:
        console.print(
            f"skipping {table.skipped.height} series too short for the backtest "
            f"(listed in {config.run_dir / 'skipped.parquet'})"
        )
    spec = FeatureSpec.from_config(config, table.season_length)
    others = set(table.frame.columns) - {table.columns.target}
    clash = sorted(set(spec.columns()) & set(table.frame.columns) | {TARGET} & others)
    if clash:
        raise ConfigError(
            f"input column '{clash[0]}' has the name of a computed feature (or of the target's "
            "name inside models, 'y'); rename it in the data"
        )
    return table, spec, make_plan(config, table, spec)


@dataclass
class _Ran:
    """What running the chunks leaves for the report."""

    n_chunks: int
    chunk_size: int
    todo: list[int]
    intervals: list[tuple[float, float]]
    """Each chunk's start and end."""
    seconds: dict[str, float]
    """`features` and `models`."""


def _run_chunks(
    config: ManyModelsConfig,
    where: tuple[Backend, Pool | None],
    prepared: tuple[SeriesTable, FeatureSpec, Plan],
    saved_size: int,
    done: set[int],
    console: Console,
) -> _Ran:
    """The features written by chunk, then the chunks `done` has not run, where `where` says
    (Ray started and stopped here where it runs them); the workers stopped and the features
    removed however it ends."""
    run_dir = config.run_dir
    backend = where[0]
    table, spec, plan = prepared
    ray, started_ray = start_ray(config) if backend.name == "ray" else (None, False)
    try:
        slots = task_slots(ray, config) if ray is not None else backend.slots
        chunk_size = saved_size or choose_chunk_size(run_dir, config, table.num_series, slots)
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
        console.print(describe(backend), highlight=False)
        train_started = time.perf_counter()
        intervals = _run_models((ray, *where, slots), config, plan, (features, todo, done), console)
        seconds = {"features": features_seconds, "models": time.perf_counter() - train_started}
    finally:
        if started_ray and ray is not None:
            ray.shutdown()
        if where[1] is not None:  # idle now: not held through the assembly
            where[1].stop()
        shutil.rmtree(run_dir / "features", ignore_errors=True)  # scratch: big, and redone
    return _Ran(n_chunks, chunk_size, todo, intervals, seconds)


def _report(
    config: ManyModelsConfig,
    table: SeriesTable,
    ran: _Ran,
    run: tuple[set[int], Any, float],
    console: Console,
) -> Summary:
    """The output tables assembled from the chunks (reconciled, plotted where asked), the
    summary made, tracked in MLflow (`run`: the chunks reused, the MLflow run, when the job
    started) and printed, and the forecasts registered where asked."""
    done, mlflow_run, started = run
    run_dir = config.run_dir
    assembly_started = time.perf_counter()
    outputs, selection, calibration = assemble(config, table, ran.n_chunks, ran.chunk_size)
    assembly_seconds = time.perf_counter() - assembly_started
    # the chosen forecasts were streamed to their file: read back once, for what needs them
    wanted = bool(config.hierarchy.levels) or config.tracking.plots
    chosen = chosen_forecasts(run_dir, table) if wanted else None
    if chosen is not None and config.hierarchy.levels:
        from shardwise.manymodel.hierarchy.reconciliation import reconcile_run

        reconcile_run(config, table, chosen, console)
    summary = summarise(
        config,
        table,
        outputs,
        selection,
        calibration,
        chunks_run=len(ran.todo),
        chunks_reused=len(done),
        peak=peak_concurrency(ran.intervals),
        seconds={
            **ran.seconds,
            "outputs": assembly_seconds,
            "total": time.perf_counter() - started,
        },
    )
    if chosen is not None and config.tracking.plots:
        from shardwise.manymodel.run.plots import write_plots

        write_plots(run_dir, table, {**outputs, "forecasts": chosen}, seed=config.job.seed)
    summary.mlflow_run_id = track(mlflow_run, config, summary, run_dir)
    print_summary(console, summary)
    if config.tracking.plots:
        console.print(f"plots: {run_dir / 'plots'}")
    if config.tracking.registered_model:
        summary.model_uri = _register(config, summary, list(table.columns.ids))
        console.print(f"mlflow model: {summary.model_uri}")
    return summary


def _run_models(
    where: tuple[Any, Backend, Pool | None, int],
    config: ManyModelsConfig,
    plan: Plan,
    chunks: tuple[FeatureChunks, list[int], set[int]],
    console: Console,
) -> list[tuple[float, float]]:
    """Run the chunks `todo` of `features` (`done`: those a resumed run has) where `where`
    says: on Ray where it runs, in `slots` tasks at once, else as the backend says; each
    chunk's start and end."""
    ray, backend, pool, slots = where
    features, todo, done = chunks
    if ray is not None:
        given = global_forecasts(ray, config, plan, features, todo, slots, console)
        return run_chunks(ray, config, plan, (features, given), todo, slots, done, console)
    return run_local(config, (backend, pool), plan, features, todo, done, console)


def _register(config: ManyModelsConfig, summary: Summary, ids: list[str]) -> str:
    """The run's forecasts registered (serving/registered_forecasts.py); a store that is down
    is one line, the run's results left as they are."""
    from shardwise.common.model_registry import RegistryError
    from shardwise.manymodel.serving.registered_forecasts import register_forecasts

    try:
        registered = register_forecasts(
            config, config.run_dir, ids, run_id=summary.mlflow_run_id, metrics=summary.overall
        )
    except RegistryError as e:
        raise RegistryError(
            f"{e}; the run's results in {config.run_dir} are intact: run it again with "
            "--resume to register them (its chunks are reused)"
        ) from None
    return registered.model_uri


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
    # Build each model once here: a bad name or argument fails before any task starts. A
    # built-in without arguments has nothing to check: building it would only import its
    # library here (statsforecast: a second of CPU the workers need, as they import it too).
    from shardwise.manymodel.models.per_series import build

    for _, name, args in models:
        if args or name not in BUILTIN_MODELS:
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


many_models = run
