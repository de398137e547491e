"""`parallelize`: the one function that turns a plain model into its parallel layout.

Layouts apply in a fixed order, because each wraps what the previous produced: pipeline split
(which modules live on this rank), then tensor parallel (which needs plain modules to shard), then
activation checkpointing, then the data-parallel wrapper (FSDP2 or DDP), which must see the final
module tree so that its gradient hooks cover every parameter. This version implements the
data-parallel step with DDP; the other steps slot in above it.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel


def parallelize(
    model: nn.Module, mesh: DeviceMesh, degrees: dict[str, int], *, device: torch.device
) -> nn.Module:
    model = model.to(device)
    if degrees["dp_replicate"] > 1:
        model = DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            device_mesh=mesh["dp_replicate"],
            # Gradients live inside DDP's all-reduce buckets: one copy fewer, no copy per step.
            gradient_as_bucket_view=True,
        )
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside whatever wrapper `parallelize` added."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def gradient_sync(model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager[None]:
    """Skip the gradient all-reduce for all but the last micro-batch of a step: gradients then
    accumulate locally and are reduced once, as if the whole batch had gone through at once."""
    if enabled or not isinstance(model, DistributedDataParallel):
        return contextlib.nullcontext()
    return model.no_sync()
