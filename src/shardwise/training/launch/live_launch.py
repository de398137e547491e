"""`fault.mode = "live"` on this machine: the data-parallel replicas, supervised by
launch/live_supervisor.py (a dead one is replaced, the others never stop), each training in a
world of its own with its replica of live recovery (fault/live_replica.py): one process holding
the whole model, or under HSDP (`parallel.dp_shard` > 1) a replica group of that many processes
sharding it with FSDP.

`launch_live` runs the job and returns the summary the reporting replica (slot 0) wrote;
`run_replica` is what each replica process runs.
"""

from __future__ import annotations

import contextlib
import json
import time
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import HashStore, PrefixStore, TCPStore  # type: ignore[attr-defined]

from shardwise.common.console import one_line_warnings
from shardwise.common.environment import visible_cpus
from shardwise.common.errors import ConfigError, first_line
from shardwise.common.redact import redacting_output
from shardwise.training.config.derive import derive
from shardwise.training.config.schema import JobConfig
from shardwise.training.launch.agent import Nodes
from shardwise.training.launch.forkserver import restore_sigterm
from shardwise.training.launch.live_nodes import serve_node
from shardwise.training.launch.live_processes import ReplicaFailed, Starter
from shardwise.training.launch.live_supervisor import supervise
from shardwise.training.launch.outcome import WorkerFailed
from shardwise.training.launch.stores import LOOPBACK, loopback_collectives
from shardwise.training.trainer.train_summary import TrainSummary


def width_of(config: JobConfig) -> int:
    """The processes of one replica: its pipeline ranks, or its FSDP ranks times its
    tensor-parallel ones (`parallel.pp` × `dp_shard` × `tp`), 1 for a replica of one
    process."""
    return config.parallel.pp * config.parallel.dp_shard * config.parallel.tp


def check_live(config: JobConfig, processes: int, *, nodes: int = 1) -> None:
    """Refuse, in one line, a job live recovery cannot run (yet): replicas of one process or
    of FSDP, tensor-parallel and pipeline ranks each, `processes` on each of `nodes` machines,
    their gradients summed every step uncompressed."""
    width = width_of(config)
    replicas = processes // width * nodes
    why = _pipeline_refusal(config) or _refusal(config, processes, width, replicas, nodes)
    if why:
        raise ConfigError(f"fault.mode = 'live' {why}, or set fault.mode = 'restart'")
    derived = derive(one_replica(config), width)  # what one replica's world can run
    share = derived.grad_accum // max(replicas, 1)  # a pipeline's, at the fewest
    least = config.parallel.pp if config.parallel.pipeline_schedule == "1F1B" else 1
    if config.parallel.pp > 1 and share < least:
        raise ConfigError(
            f"fault.mode = 'live' gives each pipeline of its {replicas} replicas {share} "
            f"micro-batch(es) of {derived.micro_batch} a step, fewer than the {least} "
            f"{config.parallel.pipeline_schedule} needs: raise train.global_batch or lower "
            "train.micro_batch"
        )


def _pipeline_refusal(config: JobConfig) -> str | None:
    """Why a pipeline cannot be a replica (yet), or None: under a schedule that takes any
    number of micro-batches a step (a replica's share follows its membership)."""
    if config.parallel.pp > 1 and config.parallel.pipeline_schedule not in ("GPipe", "1F1B"):
        return (
            "re-splits each step's micro-batches over the replicas, which the GPipe and 1F1B "
            "pipeline schedules allow (parallel.pipeline_schedule)"
        )
    return None


def _refusal(
    config: JobConfig, processes: int, width: int, replicas: int, nodes: int
) -> str | None:
    """Why these replicas cannot run live (yet), or None."""
    if processes % width:
        return (
            f"splits --nproc {processes} into replicas of parallel.pp × dp_shard × tp = "
            f"{width} processes: use a multiple of it"
        )
    if config.parallel.dp_replicate not in (-1, 1, replicas):  # -1: what is left
        return (
            f"makes each replica of parallel.pp × dp_shard × tp = {width} processes: --nproc "
            f"{processes} on {nodes} node(s) gives {replicas}, not parallel.dp_replicate = "
            f"{config.parallel.dp_replicate}"
        )
    if config.train.sync != "every_step":
        return "reduces gradients every step (train.sync = 'every_step')"
    if config.parallel.grad_compression != "none":
        return "reduces gradients in full (parallel.grad_compression = 'none')"
    if config.train.precision == "fp16":
        return "does not carry fp16's loss scaling across replicas yet (train.precision = 'bf16')"
    if replicas < config.fault.min_replicas and replicas > 1:
        return (
            f"starts {replicas} replicas, fewer than fault.min_replicas "
            f"({config.fault.min_replicas}): use --nproc {config.fault.min_replicas}"
        )
    return None


def one_replica(config: JobConfig) -> JobConfig:
    """The job as one replica's world runs it: FSDP over its processes, no replicate axis."""
    return config.model_copy(update={"parallel": config.parallel.model_copy(
        update={"dp_replicate": 1})})  # fmt: skip


def launch_live(
    config: JobConfig, processes: int, resume: str | None, nodes: Nodes | None = None
) -> TrainSummary | None:
    """Train `config` on the live replicas `processes` make on this machine (of
    `parallel.pp` × `dp_shard` × `tp` processes each), and on each of `nodes`' others, from
    the checkpoint `resume` (or the start); the summary the reporting replica wrote (None on a
    node that does not host the coordinator)."""
    started = time.time()
    width = width_of(config)
    args = (one_replica(config).model_dump(mode="json"), resume, processes)
    count, timeout = 1 if nodes is None else nodes.count, config.fault.timeout_s
    try:
        if nodes is not None and not nodes.hosts_here():
            starter = Starter(run_replica, args, nodes.endpoint, forked=True, width=width)
            serve_node(nodes.endpoint, starter, processes // width, timeout_s=timeout, nodes=count)
            return None
        host, port = (LOOPBACK, 0) if nodes is None else _host_port(nodes.endpoint)
        # on one machine the replicas' gloo groups use loopback, as the agent's ranks'
        with loopback_collectives() if nodes is None else contextlib.nullcontext():
            supervise(
                processes // width * count, run_replica, args, timeout_s=timeout,
                restarts=config.fault.max_restarts, min_replicas=config.fault.min_replicas,
                forked=True, width=width, nodes=count, host=host, port=port,
            )  # fmt: skip
    except ReplicaFailed as failure:
        if failure.config:
            raise ConfigError(str(failure)) from None
        raise WorkerFailed(
            failure.slot, failure.exitcode, str(failure), traceback=failure.traceback
        ) from None
    path = config.run_dir / "summary.json"
    if not path.exists() or path.stat().st_mtime < started:
        return None
    return TrainSummary(**json.loads(path.read_text()))


def _host_port(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


def run_replica(
    slot: int, local: int, incarnation: int, endpoint: str, config_data: dict[str, Any],
    resume: str | None, processes: int,
) -> None:  # fmt: skip
    """Process `local` of a replica: a world of its own (gloo: one rank, or the replica's FSDP
    ranks), a `LiveGroup` with the same process of the other replicas, and the training loop;
    a replacement (`incarnation` > 0) heals from a replica instead of resuming."""
    restore_sigterm()
    with redacting_output(), one_line_warnings():
        config = JobConfig.model_validate(config_data)
        threads = config.job.threads_per_rank or max(1, visible_cpus() // processes)
        torch.set_num_threads(threads)
        width = width_of(config)
        dist.init_process_group(
            "gloo", store=_world_store(endpoint, slot, incarnation, width, config),
            rank=local, world_size=width,
        )  # fmt: skip
        # the replica's, not the launcher's
        from shardwise.training.fault.live import LiveGroup, Siblings
        from shardwise.training.trainer import loop

        siblings = Siblings() if width > 1 else None
        group = LiveGroup(
            endpoint, slot, incarnation, config.fault.timeout_s, local=local, siblings=siblings
        )
        try:
            loop.train(
                config,
                device=torch.device("cpu"),
                resume=resume if incarnation == 0 else None,
                live=group,
            )
        except Exception as error:  # said once, by the supervisor, rather than a traceback
            config_error = isinstance(error, ConfigError)
            trace = "" if config_error else traceback.format_exc()
            group.failed(first_line(error), config=config_error, traceback=trace)
            raise SystemExit(1) from None
        finally:
            group.close()
            dist.destroy_process_group()


def _world_store(endpoint: str, slot: int, incarnation: int, width: int, config: JobConfig) -> Any:
    """Where a replica's processes meet to form its world: in-process for one, else the
    coordinator's store under a prefix of this incarnation of the slot."""
    if width == 1:
        return HashStore()
    host, _, port = endpoint.rpartition(":")
    timeout = timedelta(seconds=config.fault.timeout_s)
    store = TCPStore(host, int(port), is_master=False, timeout=timeout)
    return PrefixStore(f"sw/world/{slot}/{incarnation}/", store)
