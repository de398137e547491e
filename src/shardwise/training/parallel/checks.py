"""Checks of a job's layout against its model before any process starts, on the meta device
(cheap at any size): enough blocks for the pipeline stages, a tensor-parallel plan whose layers
divide by `tp`. Each mistake is one `ConfigError` line that names the fix. This module must not
build a layout: it only asks whether one can be built.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.common.errors import ConfigError
from shardwise.training.config.derive import Derived
from shardwise.training.config.schema import JobConfig


def check_layout(config: JobConfig, derived: Derived) -> None:
    """Check the model against the layout before any process starts (the model is built on the
    meta device, so this is cheap at any size): blocks to recompute, pipeline stages that can
    be cut and run, a tensor-parallel plan that fits the model's layers."""
    from shardwise.training import job_names

    degrees = derived.degrees
    recompute = config.parallel.activation_checkpoint
    split = degrees["pp"] > 1 or degrees["tp"] > 1 or recompute != "none"
    cpus = config.job.device == "cpu" or not torch.cuda.is_available()
    synced_on_cpus = cpus and derived.world_size > 1  # what _check_sync_batch_norm refuses
    if not (split or synced_on_cpus):
        return
    model = job_names.build_on_meta(config)
    if synced_on_cpus:
        _check_sync_batch_norm(model)
    if split:
        # imported here: the pipeline and tensor-parallel parts import DTensor (0.5 s), which a
        # launcher of a data-parallel job never needs
        from shardwise.training.parallel.split_checks import check_split

        check_split(config, derived, model)


def _check_sync_batch_norm(model: nn.Module) -> None:
    """torch runs SyncBatchNorm across ranks on GPUs only: on CPUs, with more than one rank, it
    raises in the first step."""
    synced = [n for n, m in model.named_modules() if isinstance(m, nn.SyncBatchNorm)]
    if synced:
        raise ConfigError(
            f"{synced[0]} is an nn.SyncBatchNorm, which torch synchronises across ranks on GPUs "
            "only: use nn.BatchNorm (each rank's own statistics; DDP keeps rank 0's) or train "
            "on GPUs"
        )
