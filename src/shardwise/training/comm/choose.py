"""`build`: the run's `Sync`, chosen from the config (the one place that knows every mode)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwise.common.errors import ConfigError
from shardwise.training.comm.base import Sync
from shardwise.training.comm.compression import CompressedSync, fsdp_reduce_bytes
from shardwise.training.comm.hierarchical import Topology, topology
from shardwise.training.comm.local_sgd import DiLoCo, LocalSGD
from shardwise.training.comm.param_server import AsyncSync
from shardwise.training.comm.powersgd import PowerSGDSync
from shardwise.training.config.schema import JobConfig


def build(
    config: JobConfig,
    parts: list[nn.Module],
    optimizers: list[torch.optim.Optimizer],
    schedulers: list[Any],
    group: dist.ProcessGroup,
    *,
    wrapper: str,
    node: int,
) -> Sync:
    """`wrapper` is the layout's data-parallel wrapper (`ddp`, `fsdp`, `replicate`, `none`);
    `node` the index of the machine this rank runs on (for hierarchical reduction, and to count
    what crosses between machines)."""
    par = config.parallel
    ddp = wrapper == "ddp" and config.train.sync == "every_step"
    route = topology(group, node, par.hierarchical if ddp else False)
    sync = _chosen(config, parts, optimizers, schedulers, group, route=route, wrapper=wrapper)
    sync.traffic.spans_nodes = route.nodes > 1
    return sync


def _chosen(
    config: JobConfig,
    parts: list[nn.Module],
    optimizers: list[torch.optim.Optimizer],
    schedulers: list[Any],
    group: dist.ProcessGroup,
    *,
    route: Topology,
    wrapper: str,
) -> Sync:
    train, par = config.train, config.parallel
    if train.sync == "async":
        return _asynchronous(config, parts, optimizers, schedulers, group)
    if train.sync == "local_sgd":
        return LocalSGD(parts, group, every=train.sync_every, optimizers=optimizers)
    if train.sync == "diloco":
        return DiLoCo(
            parts,
            group,
            every=train.sync_every,
            optimizers=optimizers,
            outer_lr=train.outer_lr,
            outer_momentum=train.outer_momentum,
            compression=train.outer_compression,
        )
    if wrapper != "ddp":
        return Sync(parts, group, reduce_bytes=fsdp_reduce_bytes(par.grad_compression))
    if par.grad_compression == "powersgd":
        return PowerSGDSync(
            parts,
            group,
            route,
            rank=par.powersgd_rank,
            start_step=par.powersgd_start_step,
            error_feedback=par.error_feedback,
            seed=config.job.seed,
        )
    if par.grad_compression != "none" or route.hierarchical:
        return CompressedSync(
            parts,
            group,
            route,
            compression=par.grad_compression,
            error_feedback=par.error_feedback,
        )
    return Sync(parts, group)


def _asynchronous(
    config: JobConfig,
    parts: list[nn.Module],
    optimizers: list[torch.optim.Optimizer],
    schedulers: list[Any],
    group: dist.ProcessGroup,
) -> AsyncSync:
    train = config.train
    replay = Path(train.async_replay) if train.async_replay else None
    if replay is not None and not replay.is_file():
        raise ConfigError(
            f"train.async_replay = {train.async_replay!r}: no such file (it is a run's "
            "async_order.jsonl)"
        )
    return AsyncSync(
        parts,
        group,
        optimizers=optimizers,
        scheduler=schedulers[0],
        staleness=train.max_staleness,
        steps=train.steps,
        record=config.run_dir / "async_order.jsonl",
        replay=replay,
    )
