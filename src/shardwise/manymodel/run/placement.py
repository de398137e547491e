"""Where a many-models job's chunks run: on Ray, in worker processes of this machine
(local_tasks.py), or in this process where one worker would run every chunk anyway.

Ray pays for a cluster, for global models (its actors fit them together) and for GPUs it shares
out. On one machine it costs a local instance's start and stop and its own processes' time on the
cores the tasks need, which a small job feels (docs/benchmarks.md, against statsforecast).

A light module (the configuration's imports only): the CLI decides where the chunks run, and
starts the workers' fork server, before it imports the runner.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardwise.common.environment import visible_cpus
from shardwise.common.errors import ConfigError
from shardwise.manymodel.config import ManyModelsConfig, model_global
from shardwise.manymodel.run.warm_imports import start_server


@dataclass(frozen=True)
class Backend:
    """What runs a job's chunks, and why (the start line says both)."""

    name: str
    """`ray`, `processes` or `in-process`."""
    slots: int
    """Chunks run at once (for Ray: decided once it has started, `ray_tasks.task_slots`)."""
    why: str


def choose(config: ManyModelsConfig, global_models: bool, ray_running: bool) -> Backend:
    """`runner.backend` resolved: "auto" takes Ray for a cluster (`runner.ray_address`), a Ray
    the caller started, global models or GPUs, else this machine's processes (this process
    where only one task fits on the cores)."""
    runner = config.runner
    needs = [
        (runner.ray_address, f"runner.ray_address = '{runner.ray_address}'"),
        (global_models, "global models fit on Ray's actors"),
        (runner.num_gpus, "runner.num_gpus shares GPUs out through Ray"),
    ]
    reasons = [why for need, why in needs if need]  # what only Ray gives
    preferred = [*reasons, *(["Ray already runs in this process"] if ray_running else [])]
    if runner.backend == "ray" or (runner.backend == "auto" and preferred):
        why = "runner.backend = 'ray'" if runner.backend == "ray" else preferred[0]
        return Backend("ray", 0, why)
    if reasons:  # runner.backend = "local", and something only Ray gives
        raise ConfigError(
            f"runner.backend = 'local' cannot run this job: {reasons[0]}; set runner.backend = "
            "'auto' or 'ray'"
        )
    slots = max(1, math.floor(visible_cpus() / runner.num_cpus + 1e-9))
    how = "runner.backend = 'local'" if runner.backend == "local" else "no Ray cluster, "
    if runner.backend == "auto":
        how += "global model or GPU asked for: Ray would cost its start and its processes' time"
    if slots == 1:
        return Backend("in-process", 1, f"{how}; one task at a time fits on {visible_cpus()} cores")
    return Backend("processes", slots, how)


def describe(backend: Backend) -> str:
    """The start line's words for where the chunks run."""
    where = {
        "ray": "on Ray",
        "processes": f"in {backend.slots} worker processes on this machine",
        "in-process": "in this process",
    }[backend.name]
    return f"models run {where} ({backend.why})"


def prestart(config: ManyModelsConfig) -> None:
    """Start the workers' fork server now where the job will run on worker processes of this
    machine (as `choose` decides with no Ray running), so that the models' libraries are
    imported while this process imports the runner and reads the data."""
    global_models = any(model_global(config, name) for name in config.models.names)
    if choose(config, global_models, ray_running=False).name == "processes":
        start_server(config.models.names)
