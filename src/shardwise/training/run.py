"""The front door of training: `shardwise.train` (and `shardwise train`). It checks the job, then
starts N workers on this machine through torch's elastic agent (launch/agent.py), or joins the
workers torchrun/Slurm started; reports what the launch ended in (launch/outcome.py); and logs
the final model where the job asks.

The path from the command line to `loss.backward()`: `cli._train` → `train` (here) →
`launch.agent.launch` → `worker.run_worker` (in every rank) → `trainer.loop.train` →
`trainer.step.train_step`. Where a run starts is checkpoint/resume.py's decision, shared with
every launcher.
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from shardwise.common.console import warn
from shardwise.common.errors import ConfigError
from shardwise.common.job_files import apply_override
from shardwise.training import job_names
from shardwise.training.checkpoint.export import check_weights
from shardwise.training.checkpoint.resume import resume_point
from shardwise.training.config.derive import derive
from shardwise.training.config.load import load_config, validate
from shardwise.training.config.schema import JobConfig
from shardwise.training.launch.agent import Nodes, launch
from shardwise.training.launch.env import WorkerEnv, detect
from shardwise.training.launch.forkserver import discard_unused_server, start_method
from shardwise.training.launch.live_launch import check_live, launch_live, one_replica, width_of
from shardwise.training.launch.outcome import Interrupted, WorkerFailed, outcome
from shardwise.training.launch.stores import LOOPBACK
from shardwise.training.launch.worker import check_devices, run_worker
from shardwise.training.parallel.checks import check_layout

if TYPE_CHECKING:
    from shardwise.training.trainer.train_summary import TrainSummary


def train(
    config: JobConfig | str | Path,
    *,
    nproc: int | None = None,
    resume: str = "never",
    overrides: list[str] | tuple[str, ...] = (),
    dry_run: bool = False,
    nodes: Nodes | None = None,
) -> TrainSummary | None:
    """Train a job: start `nproc` local workers (on each of `nodes`, when given), or join the job
    torchrun/Slurm already started.

    `config` is a `JobConfig` or the path of a job file; `resume` is `never` (refuse to overwrite
    an earlier run's checkpoints), `auto` (continue from the newest complete checkpoint, if any) or
    the path of a checkpoint. Returns rank 0's summary (None where rank 0 does not run: other
    ranks under torchrun/Slurm, other nodes).
    With `dry_run`, the workers build the layout on the meta device and rank 0 prints what each
    rank would hold; nothing is trained or written, and None is returned.
    """
    config = _with_overrides(config, overrides)
    worker = _started_by_a_launcher(nodes)
    if worker is not None:
        if nproc not in (None, worker.world_size):
            warn(
                f"--nproc {nproc} ignored: this process is rank {worker.rank} of "
                f"{worker.world_size} started by {worker.launcher}",
                stacklevel=2,
            )
        check_job(config, worker.world_size, worker.local_world_size)
        if config.fault.mode == "live":
            raise ConfigError(
                "fault.mode = 'live' runs under shardwise's own supervisor, not "
                f"{worker.launcher}: start the job with `shardwise train --nproc N`, or set "
                "fault.mode = 'restart'"
            )
        # Every rank runs this; the ranks decide where to start together, once joined.
        return publish(
            config, run_worker(config.model_dump(mode="json"), resume, dry_run, decided=False)
        )
    # The ranks' server, before the checks below run anything of the job here (a data source's
    # client, a user's module): a `shardwise` command forks it from this process, which must not
    # have started a runtime that a fork breaks (launch/forkserver/).
    start_method()
    per_node = nproc or 1
    live = config.fault.mode == "live" and not dry_run
    if live:
        check_live(config, per_node, nodes=1 if nodes is None else nodes.count)
        if per_node == width_of(config) and (nodes is None or nodes.count == 1):
            warn(
                "fault.mode = 'live' needs two replicas or more (--nproc, a multiple of "
                "parallel.pp × dp_shard × tp): one replica restarts as fault.mode = 'restart' does",
                stacklevel=2,
            )
            live = False
    if live:  # each replica is a world of its own; its share of each step is not a fixed divisor
        if nodes is not None:
            nodes.check()
        checkpoint = _checked_here(one_replica(config), width_of(config), None, resume)
        return publish(config, launch_live(config, per_node, checkpoint, nodes))
    checkpoint = _checked_here(config, per_node, nodes, None if dry_run else resume)
    store_host = LOOPBACK if nodes is None else ""
    args = (config.model_dump(mode="json"), checkpoint, dry_run, True, store_host)
    started = time.time()
    try:
        summary: TrainSummary | None = launch(
            run_worker,
            args,
            nproc=per_node,
            max_restarts=config.fault.max_restarts,
            nodes=nodes and replace(nodes, run_id=nodes.run_id or config.job.name),
        ).get(0)
    except (Interrupted, WorkerFailed) as failure:
        summary = outcome(config.run_dir, started, failure=failure)
    return publish(config, summary)


def publish(config: JobConfig, summary: TrainSummary | None) -> TrainSummary | None:
    """Under `tracking.log_model`, the finished run's final checkpoint logged to MLflow (and
    registered) by this process once the ranks are done; a store that is down is said in the
    summary (`model_error`), the checkpoint left as it is."""
    if summary is None or summary.preempted or not config.tracking.log_model:
        return summary
    from shardwise.common.model_registry import RegistryError
    from shardwise.training.tracking.registered_model import log_checkpoint

    assert summary.checkpoint is not None  # the last step always saves
    try:
        logged = log_checkpoint(
            summary.checkpoint,
            name=config.tracking.registered_model,
            uri=config.tracking_uri,
            run_id=summary.mlflow_run_id,
            metrics=summary.metrics,
        )
    except RegistryError as e:
        summary.model_error = (
            f"{e}; the checkpoint {summary.checkpoint} is intact: `shardwise export "
            f"{summary.checkpoint} --mlflow {config.tracking.registered_model or 'NAME'}` logs "
            "it later"
        )
        return summary
    summary.model_uri = logged.model_uri
    return summary


def _checked_here(
    config: JobConfig, per_node: int, nodes: Nodes | None, resume: str | None
) -> str | None:
    """The job checked for a launch from this process, and the checkpoint it resumes from (none
    for a dry run: `resume` None). A refused job stops the server started for it, which would
    otherwise import the trainer for nothing on the cores the refusal's message waits on."""
    try:
        check_job(config, per_node * (nodes.count if nodes else 1), per_node)
        if nodes is not None:
            nodes.check()
        return None if resume is None else resume_point(config, resume)
    except BaseException:
        discard_unused_server()
        raise


def _started_by_a_launcher(nodes: Nodes | None) -> WorkerEnv | None:
    """This process's rank where torchrun or Slurm started it as one; None where it launches."""
    worker = detect()
    if worker is not None and worker.launcher == "slurm" and nodes is not None:
        return None  # srun started one shardwise agent per node (launch/slurm.py), not ranks
    return worker


def _with_overrides(
    config: JobConfig | str | Path, overrides: list[str] | tuple[str, ...]
) -> JobConfig:
    """The job, from its file or object, with the `--set` overrides applied and validated."""
    if not isinstance(config, JobConfig):
        return load_config(config, overrides)
    if not overrides:
        return config
    raw = config.model_dump(mode="json")
    for item in overrides:
        apply_override(raw, item)
    return validate(raw)


def check_job(
    config: JobConfig, world_size: int, per_node: int, *, devices_here: bool = True
) -> None:
    """Everything that can be checked before a worker starts, in this process (`devices_here`:
    also this machine's GPUs, where the job runs here)."""
    derived = derive(config, world_size)
    job_names.check(config)
    check_layout(config, derived)
    if config.model.init_from:
        check_weights(config.model.init_from, job_names.build_on_meta(config))
    if devices_here:
        check_devices(config.job.device, per_node)


def report_result(summary: TrainSummary | None) -> int:
    """What a finished launch prints, and its exit code: the summary; and where the model was
    not logged (the MLflow store down), why, in one line, with exit code 2."""
    if summary is None:
        return 0
    print_summary(summary)
    if summary.model_error:
        print(f"shardwise: {summary.model_error}", file=sys.stderr)
        return 2
    return 0


def print_summary(summary: TrainSummary) -> None:
    """What a finished (or preempted) training run prints: its metrics and checkpoint."""
    metrics = "  ".join(
        f"{k} {v:.4f}" for k, v in summary.metrics.items() if k.startswith(("loss", "eval/"))
    )
    if summary.preempted:
        print(f"preempted (SIGTERM): stopped at step {summary.step}  {metrics}")
        print(f"checkpoint: {summary.checkpoint} (--resume auto continues from it)")
    else:
        print(f"done: step {summary.step}  {metrics}")
        print(f"checkpoint: {summary.checkpoint}")
    if summary.mlflow_run_id:
        print(f"mlflow run: {summary.mlflow_run_id}")
    if summary.model_uri:
        print(f"mlflow model: {summary.model_uri}")
