"""`fault.mode = "live"` on this machine: one process per data-parallel replica, supervised by
launch/live_supervisor.py (a dead one is replaced, the others never stop), each training in a
world of its own with its replica of live recovery (fault/live_replica.py).

`launch_live` runs the job and returns the summary the reporting replica (slot 0) wrote;
`run_replica` is what each replica process runs.
"""

from __future__ import annotations

import json
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import HashStore  # type: ignore[attr-defined]

from shardwise.common.console import one_line_warnings
from shardwise.common.environment import visible_cpus
from shardwise.common.errors import ConfigError, first_line
from shardwise.common.redact import redacting_output
from shardwise.training.config.derive import derive
from shardwise.training.config.schema import JobConfig
from shardwise.training.launch.forkserver import restore_sigterm
from shardwise.training.launch.live_supervisor import ReplicaFailed, supervise
from shardwise.training.launch.outcome import WorkerFailed
from shardwise.training.launch.stores import loopback_collectives
from shardwise.training.trainer.train_summary import TrainSummary


def check_live(config: JobConfig, replicas: int, *, nodes: bool) -> None:
    """Refuse, in one line, a job live recovery cannot run (yet): one replica per process of
    this machine, the whole model on each, its gradients summed every step uncompressed."""
    degrees = derive(config, 1).degrees  # each replica is a world of its own
    why = None
    if nodes:
        why = "runs on one machine for now (drop --nnodes)"
    elif degrees["tp"] > 1 or degrees["pp"] > 1 or degrees["dp_shard"] > 1:
        why = "applies to data parallelism alone for now (parallel.tp, pp and dp_shard = 1)"
    elif config.train.sync != "every_step":
        why = "reduces gradients every step (train.sync = 'every_step')"
    elif config.parallel.grad_compression != "none":
        why = "reduces gradients in full (parallel.grad_compression = 'none')"
    elif config.train.precision == "fp16":
        why = "does not carry fp16's loss scaling across replicas yet (train.precision = 'bf16')"
    elif replicas < config.fault.min_replicas and replicas > 1:
        why = (
            f"starts {replicas} replicas, fewer than fault.min_replicas "
            f"({config.fault.min_replicas}): use --nproc {config.fault.min_replicas}"
        )
    if why:
        raise ConfigError(f"fault.mode = 'live' {why}, or set fault.mode = 'restart'")


def launch_live(config: JobConfig, replicas: int, resume: str | None) -> TrainSummary | None:
    """Train `config` on `replicas` live replicas of this machine, from the checkpoint `resume`
    (or the start); the summary slot 0 wrote."""
    started = time.time()
    args = (config.model_dump(mode="json"), resume, replicas)
    try:
        with loopback_collectives():  # the replicas' gloo groups, as the agent's ranks'
            supervise(
                replicas,
                run_replica,
                args,
                timeout_s=config.fault.timeout_s,
                restarts=config.fault.max_restarts,
                min_replicas=config.fault.min_replicas,
                forked=True,
            )
    except ReplicaFailed as failure:
        if failure.config:
            raise ConfigError(str(failure)) from None
        raise WorkerFailed(failure.slot, failure.exitcode, str(failure), traceback="") from None
    path = config.run_dir / "summary.json"
    if not path.exists() or path.stat().st_mtime < started:
        return None
    return TrainSummary(**json.loads(path.read_text()))


def run_replica(
    slot: int, incarnation: int, endpoint: str, config_data: dict[str, Any], resume: str | None,
    replicas: int,
) -> None:  # fmt: skip
    """One replica: a world of its own (gloo, one rank), a `LiveGroup` with the others, and the
    training loop; a replacement (`incarnation` > 0) heals from a replica instead of resuming."""
    restore_sigterm()
    with redacting_output(), one_line_warnings():
        config = JobConfig.model_validate(config_data)
        torch.set_num_threads(config.job.threads_per_rank or max(1, visible_cpus() // replicas))
        dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
        from shardwise.training.fault.live import LiveGroup  # the replica's, not the launcher's
        from shardwise.training.trainer import loop

        group = LiveGroup(endpoint, slot, incarnation, config.fault.timeout_s)
        try:
            loop.train(
                config,
                device=torch.device("cpu"),
                resume=resume if incarnation == 0 else None,
                live=group,
            )
        except Exception as error:  # said once, by the supervisor, rather than a traceback
            group.failed(first_line(error), config=isinstance(error, ConfigError))
            raise SystemExit(1) from None
        finally:
            group.close()
            dist.destroy_process_group()
