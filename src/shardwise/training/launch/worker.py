"""What every rank runs, whoever started it (shardwise's elastic launcher, torchrun, Slurm's
srun): choose the device, join the process group, agree on the restart count and where to start
(checkpoint/resume.py decides, on rank 0, for everyone), train, leave cleanly."""

from __future__ import annotations

import gc
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, Store, TCPStore  # type: ignore[attr-defined]
from torch.distributed.elastic.multiprocessing.errors import get_error_handler

from shardwise.common.console import one_line_warnings
from shardwise.common.environment import visible_cpus
from shardwise.common.errors import ConfigError
from shardwise.common.redact import redacting_output
from shardwise.training.checkpoint.resume import start_point
from shardwise.training.config.schema import JobConfig
from shardwise.training.fault.watchdog import after_a_peer
from shardwise.training.launch.env import WorkerEnv, detect
from shardwise.training.launch.forkserver import restore_sigterm
from shardwise.training.launch.outcome import PREEMPTED_EXIT
from shardwise.training.launch.stores import worker_store

if TYPE_CHECKING:
    from shardwise.training.trainer.train_summary import TrainSummary


def run_worker(
    config_data: dict[str, Any],
    resume: str | None,
    dry_run: bool = False,
    decided: bool = True,
    store_host: str | None = None,
) -> TrainSummary | None:
    """What every rank runs: join the process group on the right device, agree where to start,
    train, leave cleanly. `resume` is the checkpoint the launcher chose (`decided`), or, under
    torchrun/Slurm, the user's `--resume` request, which rank 0 resolves for everyone.
    `store_host`: shardwise's own launcher has rank 0 host the workers' store on that address
    only (loopback on one machine; "" for the address the agent gives, across machines)."""
    restore_sigterm()
    with redacting_output(), one_line_warnings():  # what this rank prints, as the CLI does
        env = detect()
        assert env is not None, "run_worker runs under torch elastic or Slurm"
        config = JobConfig.model_validate(config_data)
        device = pick_device(config.job.device, local_rank=env.local_rank)
        threads = config.job.threads_per_rank or max(1, visible_cpus() // env.local_world_size)
        torch.set_num_threads(threads)
        # A backstop: the watchdog names a hang after fault.timeout_s, before gloo/NCCL give up.
        timeout = timedelta(seconds=config.fault.timeout_s + 60)
        _join(env, device, timeout, store_host=store_host)
        # here: the launching process never needs the trainer
        from shardwise.training.trainer import dry_run as layout_only
        from shardwise.training.trainer import loop

        try:
            if dry_run:
                layout_only.dry_run(config, device)
                return None
            restarts = _agreed_restarts(env.restart_count)
            if restarts or not decided:
                resume = _decided_by_rank_0(lambda: start_point(config, resume, restarts, decided))
            summary = loop.train(
                config, device=device, resume=resume, restarts=restarts, node=env.node
            )
        except Exception as e:
            # This rank's own error on record (torch elastic's error file) before its group goes:
            # leaving the group is what fails the other ranks' collectives, and the launcher
            # names the rank whose error is not such an echo (agent.py's _first_failure).
            if not after_a_peer(str(e)):
                get_error_handler().record_exception(e)
            raise
        finally:
            # Free DDP's reducer (which holds the process group) while the group is still
            # registered: if the group's last reference died inside the reducer's destructor,
            # gloo's destructor would run holding the GIL while its worker thread waits for the
            # GIL (pytorch#56297).
            gc.collect()
            dist.destroy_process_group()
    if summary.preempted and store_host is not None:
        # Under shardwise's launcher a rank that saved on SIGTERM leaves at once: the elastic
        # agent, stopping on that signal, reads no return value and would hold a returned rank
        # for 30 s, past a scheduler's grace period. Rank 0's summary is in the run directory.
        raise SystemExit(PREEMPTED_EXIT)
    return summary if env.rank == 0 else None


def _join(
    env: WorkerEnv, device: torch.device, timeout: timedelta, *, store_host: str | None
) -> None:
    """Join the job's process group: NCCL bound to this rank's GPU (`device_id`: torch then
    knows the device of every collective, and says nothing about guessing it), gloo on CPU."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    bound: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
    if env.restart_count and env.agent_store:
        # Under torchrun, after a restart the agent's store still holds the previous attempt's
        # addresses and gloo would dial the dead workers: give every attempt its own key space.
        # (shardwise's own launcher gives every attempt a new store: see _fresh_worker_store.)
        store: Store = PrefixStore(
            f"shardwise/attempt_{env.restart_count}/",
            TCPStore(env.master_addr, env.master_port, env.world_size, False, timeout=timeout),
        )
    elif store_host is not None:  # shardwise's launcher: rank 0's store, on that address only
        store = worker_store(
            rank=env.rank,
            world_size=env.world_size,
            host=store_host or env.master_addr,
            port=env.master_port,
            timeout=timeout,
        )
    else:  # torchrun, srun: as they set it up
        dist.init_process_group(
            backend,
            init_method=env.init_method,
            rank=env.rank,
            world_size=env.world_size,
            timeout=timeout,
            **bound,
        )
        return
    dist.init_process_group(
        backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout, **bound
    )


def _agreed_restarts(mine: int) -> int:
    """How many times the group has been restarted, as every rank agrees. Each node's agent
    counts only the restarts its own workers' failures caused, so after one node's workers fail
    the other nodes' workers start again with a count of 0: take the largest."""
    counts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(counts, mine)
    return int(max(counts))


def _decided_by_rank_0(decide: Callable[[], str | None]) -> str | None:
    """What `decide` returns (or raises, for a ConfigError) on rank 0, on every rank: one look at
    the checkpoints, one set of warnings, the same answer everywhere."""
    outcome: list[str | ConfigError | None] = [None]
    if dist.get_rank() == 0:
        try:
            outcome[0] = decide()
        except ConfigError as e:
            outcome[0] = e
    dist.broadcast_object_list(outcome, src=0)
    if isinstance(outcome[0], ConfigError):
        raise outcome[0]
    return outcome[0]


def pick_device(choice: str, *, local_rank: int) -> torch.device:
    """`auto`: this rank's GPU when CUDA is present, else the CPU."""
    check_devices(choice, local_rank + 1)  # also where the launcher is not shardwise's
    if choice == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def check_devices(choice: str, per_node: int, *, gpus: int | None = None) -> None:
    """Before launch: a job on GPUs needs one for each of a node's `per_node` ranks (`gpus`:
    how many this machine shows; CUDA's count by default). `auto` with no GPU is the CPU."""
    gpus = torch.cuda.device_count() if gpus is None else gpus
    if choice == "cuda" and gpus == 0:
        raise ConfigError("job.device = 'cuda' but no GPU is visible; use 'auto' or 'cpu'")
    if choice != "cpu" and 0 < gpus < per_node:
        shown = "1 GPU is visible" if gpus == 1 else f"{gpus} GPUs are visible"
        raise ConfigError(
            f"--nproc {per_node} ranks on this node but {shown} (one rank per GPU): "
            f"use --nproc {gpus}, or job.device = 'cpu' to train on the CPU"
        )
