"""Optimizer and learning-rate schedule from the `[train]` section."""

from __future__ import annotations

import math

import torch
from torch import nn

from shardwise.config import TrainSection


def build_optimizer(model: nn.Module, train: TrainSection, *, lr: float) -> torch.optim.Optimizer:
    """AdamW or SGD. Weight decay applies to matrices and embeddings only, not to biases and norm
    scales (as in GPT-2 and nanoGPT): decaying those only hurts."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": train.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    if train.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=train.betas)
    return torch.optim.SGD(groups, lr=lr, momentum=train.momentum)


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
