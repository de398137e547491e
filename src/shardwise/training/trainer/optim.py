"""Optimizer and learning-rate schedule from the `[train]` section."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from shardwise.training.config.schema import TrainSection


def build_optimizer(model: nn.Module, train: TrainSection, *, lr: float) -> torch.optim.Optimizer:
    """AdamW or SGD. Weight decay applies to matrices and embeddings only, not to biases and norm
    scales (as in GPT-2 and nanoGPT): decaying those only hurts."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": train.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    sharded = [isinstance(p, DTensor) for p in params]
    if train.optimizer == "adamw":
        # one fused kernel takes plain tensors or DTensors, not both (tensor parallelism leaves
        # the layers it does not split plain): such a mix gets the foreach implementation
        fused = _fused(params, all(sharded) or not any(sharded))
        return torch.optim.AdamW(groups, lr=lr, betas=train.betas, fused=fused)
    # DTensor has no sharding rule for fused SGD: sharded parameters get the foreach one
    fused = _fused(params, not any(sharded))
    return torch.optim.SGD(groups, lr=lr, momentum=train.momentum, fused=fused)


def states_per_param(train: TrainSection) -> int:
    """fp32 tensors shaped like each parameter that `build_optimizer`'s optimizer keeps: AdamW's
    two moments, SGD's momentum buffer (none without momentum)."""
    return 2 if train.optimizer == "adamw" else int(train.momentum > 0)


def _fused(params: list[nn.Parameter], allowed: bool) -> bool | None:
    """The fused implementation (one kernel for the whole update, and a skipped step costs no
    wait: comm.base.step_optimizers) where the parameters' device has it; else torch's default."""
    devices = {p.device.type for p in params}
    supported = _get_fused_kernels_supported_devices()  # torch's own list (2.1 and later)
    floating = all(p.is_floating_point() for p in params)
    return True if allowed and floating and devices <= set(supported) else None


def lr_factor(step: int, train: TrainSection) -> float:
    """The multiplier of the base learning rate at optimizer step `step` (1-based): linear warmup
    over `warmup_steps`, then cosine or linear decay to `min_lr_ratio` at `steps`."""
    if step <= train.warmup_steps:
        return step / train.warmup_steps
    if train.decay == "constant":
        return 1.0
    span = max(train.steps - train.warmup_steps, 1)
    progress = min((step - train.warmup_steps) / span, 1.0)
    if train.decay == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        shape = 1.0 - progress
    return train.min_lr_ratio + (1.0 - train.min_lr_ratio) * shape


def build_scheduler(
    optimizer: torch.optim.Optimizer, train: TrainSection
) -> torch.optim.lr_scheduler.LambdaLR:
    # LambdaLR evaluates its function at the number of scheduler steps taken so far (0 before the
    # first optimizer step), hence the +1 to get the 1-based optimizer step.
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda taken: lr_factor(taken + 1, train))
