"""Running a many-models job on Ray: starting (or joining) Ray, the task slots the cluster
offers, the global models fitted once per run, and the chunk tasks: submitted a few per slot,
longest first, each result written to the chunk store as it finishes."""

from __future__ import annotations

import contextlib
import ipaddress
import math
import os
import time
from typing import Any

import polars as pl
from rich.console import Console

from shardwise.common.console import warn
from shardwise.common.errors import ConfigError
from shardwise.common.ray_cluster import loopback_ray, ray_logs_to
from shardwise.manymodel.columns import SERIES
from shardwise.manymodel.config import (
    BUILTIN_MODELS,
    ManyModelsConfig,
)
from shardwise.manymodel.evaluation.backtest import Plan
from shardwise.manymodel.features.feature_files import FeatureChunks
from shardwise.manymodel.run.chunk import run_chunk
from shardwise.manymodel.run.chunk_result import ChunkResult
from shardwise.manymodel.run.chunk_store import GLOBAL_FILE
from shardwise.manymodel.run.chunk_tasks import longest_first, lost_chunk, progress_of
from shardwise.manymodel.run.warm_imports import THREAD_ENV


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
    """Ray, and whether this call started it (and so should stop it). The workers' numeric
    libraries use one thread each (`THREAD_ENV`). Locally, workers import user models from the
    working directory, as the driver does (on PYTHONPATH, so processes a model starts can too),
    and get both from the environment the instance starts in: a job's runtime environment would
    make Ray start workers of its own for the job and leave idle the ones it starts with the
    instance. Ray's own processes (its agents and monitors) start in that environment too. On a
    cluster, both come in the job's runtime environment, and the working directory is shipped to
    the workers (without virtualenvs, runs and VCS data) when a model is not a built-in one. A
    local instance listens on loopback only (`loopback_ray`)."""
    address = config.runner.ray_address or None
    with contextlib.nullcontext() if address else loopback_ray():
        import ray
    if ray.is_initialized():
        return ray, False
    cwd = os.getcwd()
    env = dict(THREAD_ENV)
    runtime_env: dict[str, Any] | None = None
    if address is None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (cwd, os.environ.get("PYTHONPATH")) if p)
    else:
        runtime_env = {"env_vars": env}
        if any(name not in BUILTIN_MODELS for name in config.models.names):
            runtime_env["working_dir"] = cwd
            runtime_env["excludes"] = [
                ".venv/", "runs/", ".git/", "**/__pycache__/", ".*_cache/", "*.egg-info/"
            ]  # fmt: skip
    try:
        with (
            contextlib.nullcontext() if address else loopback_ray(workers=env),
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
    node: str = ray.util.get_node_ip_address()
    if not address and not ipaddress.ip_address(node).is_loopback:
        warn(
            f"the local Ray instance listens on {node}, not only on loopback: ray was "
            "imported before shardwise started it",
            stacklevel=2,
        )
    return ray, True


def global_forecasts(
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
        from shardwise.manymodel.models.global_models import fit_global

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


def run_chunks(
    ray: Any,
    config: ManyModelsConfig,
    plan: Plan,
    parts: tuple[FeatureChunks, list[pl.DataFrame | None]],
    todo: list[int],
    slots: int,
    done: set[int],
    console: Console,
) -> list[tuple[float, float]]:
    """Run the chunks `todo` as Ray tasks, a few per task slot in flight (each read from disk
    and put in the object store when it is submitted, not all of them at the start); each
    chunk's start and end."""
    runner = config.runner
    features, given = parts
    task = ray.remote(run_chunk).options(
        num_cpus=runner.num_cpus,
        num_gpus=runner.num_gpus,
        max_retries=runner.max_retries,
        memory=runner.memory_mb * 2**20 or None,
    )
    plan_ref = ray.put(plan)
    queue = longest_first(features, todo)
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
    with progress_of(config, features, todo, done, slots, console) as finished:
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                index = pending.pop(ref)
                try:
                    result: ChunkResult = ray.get(ref)
                    took: float | None = result.finished - result.started
                except ray.exceptions.RayError as e:
                    why = f"{type(e).__name__}: {str(e).splitlines()[0]}"
                    result, took = lost_chunk(features.series_of(index), why, plan.levels), None
                finished.chunk(index, result, took)
                submit()
    return finished.intervals
