"""`shardwise launch spark JOB.toml`: the job's ranks as the tasks of one Spark barrier stage,
through pyspark's `TorchDistributor` (Databricks' way of running PyTorch on Spark): one task per
rank (per GPU on GPU executors), each starting torchrun with that task's rank, rank 0's executor
as the rendezvous. Every rank runs the worker entry every other launcher runs
(launch/worker.py: `run_worker`), with the same job file.

Spark does not retry a failed barrier stage that collects its result (a "ResultStage"), so when
a rank or its executor fails this process runs the stage again, up to `fault.max_restarts`
times; every attempt resumes from the newest good checkpoint (`--resume auto` semantics, after
this process has refused to overwrite an earlier run where asked), so a lost executor costs the
steps since the last checkpoint. Relative paths in the job are made absolute here and must name
storage every executor sees.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shardwise.common.errors import ConfigError
from shardwise.training.launch.targets import (
    Target,
    absolute_paths,
    forwarded_env,
    run_with_restarts,
)

if TYPE_CHECKING:
    from shardwise.training.trainer.train_summary import TrainSummary


@dataclass(frozen=True)
class SparkOptions:
    master: str | None = None
    """The cluster's master URL; None: `local-cluster[nodes, ranks per node, 2048]` on this
    machine (executors in their own processes, as on a cluster)."""


def spark_rank(
    config_data: dict[str, Any], resume: str, forwarded: dict[str, str], attempt: int
) -> Any:
    """What each rank runs inside the task's torchrun (picklable by reference). Each attempt of
    the stage starts a fresh torchrun, whose restart count is 0: the driver's attempt number
    takes its place, so a stage run again is a restart as under the elastic agent (the ranks
    agree on it, and injected faults fire on the first attempt only)."""
    os.environ.update(forwarded)
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(attempt)
    from shardwise.training.launch.worker import run_worker

    return run_worker(config_data, resume, decided=False)


def describe(target: Target, options: SparkOptions, resume: str) -> str:
    """What `train_on_spark` would run, for --dry-run."""
    master = options.master or f"local-cluster[{target.nodes},{target.per_node},2048]"
    data = absolute_paths(target)
    return "\n".join(
        [
            f"# would start a Spark session on {master} and run:",
            f"TorchDistributor(num_processes={target.world_size}, local_mode=False, "
            f"use_gpu={bool(target.gpus_per_node)}).run(shardwise.training.launch.spark_tasks.spark_rank)",
            f"one barrier stage of {target.world_size} tasks, each a torchrun of one rank "
            "calling launch/worker.py's run_worker",
            f"restarts: up to {target.config.fault.max_restarts} (fault.max_restarts), the stage "
            "run again, from the newest good checkpoint",
            f"resume: {resume}; run_dir {data['job']['run_dir']}",
        ]
    )


def train_on_spark(target: Target, options: SparkOptions, resume: str) -> TrainSummary | None:
    """Run the job; rank 0's summary. `resume`: `auto`, or a checkpoint's path."""
    from pyspark.ml.torch.distributor import TorchDistributor

    from shardwise.common.spark_session import session

    master = options.master or f"local-cluster[{target.nodes},{target.per_node},2048]"
    if target.gpus_per_node and master.startswith("local"):
        raise ConfigError(
            f"--gpus-per-node with --spark-master {master}: a local Spark has no GPUs"
        )
    local = master.startswith("local")
    spark = session(master, app="shardwise-train", python=sys.executable if local else None)
    try:
        cores = int(spark.sparkContext.defaultParallelism)
        if not target.gpus_per_node and cores < target.world_size:
            raise ConfigError(
                f"{target.world_size} ranks need as many Spark task slots; {master} has {cores}"
            )
        forwarded = forwarded_env()
        config_data = absolute_paths(target)

        def attempt(n: int) -> TrainSummary | None:
            distributor = TorchDistributor(
                num_processes=target.world_size,
                local_mode=False,
                use_gpu=bool(target.gpus_per_node),
            )
            summary: TrainSummary | None = distributor.run(
                spark_rank, config_data, resume, forwarded, n
            )
            return summary

        return run_with_restarts(
            target.config.fault.max_restarts,
            attempt,
            again=lambda failure: f"the Spark stage failed ({_reason(failure)}); running it again",
            fatal=_stage_failed,
        )
    finally:
        spark.stop()


def _stage_failed(failure: Exception) -> Exception:
    """What the command reports once no attempt is left (py4j's, pyspark's or TorchDistributor's
    own error): one line naming the failure and the rank whose task failed first."""
    if isinstance(failure, ConfigError):
        return failure
    from shardwise.training.launch.outcome import WorkerFailed

    reason = _reason(failure)
    task = _FAILED_TASK.search(reason)
    message = f"the Spark stage failed: {reason} (the ranks' output is above)"
    return WorkerFailed(int(task.group(1)) if task else 0, 1, message, "")


_FAILED_TASK = re.compile(r"barrier task ResultTask\(\d+, (\d+)\)")
"""Spark's name for a failed task of the stage: (stage, partition); the partition is the rank."""


def _reason(failure: BaseException) -> str:
    """The line of Spark's error that says what failed, or the error's first line."""
    text = str(failure)
    for line in text.splitlines():
        if "failure reason" in line:
            return line.split("failure reason:")[-1].strip()[:300]
    return (text.strip().splitlines() or [type(failure).__name__])[0][:300]
