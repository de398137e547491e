"""Checks of a job's layout against its model before any process starts, on the meta device
(cheap at any size): enough blocks for the pipeline stages, a tensor-parallel plan whose layers
divide by `tp`. Each mistake is one `ConfigError` line that names the fix. This module must not
build a layout: it only asks whether one can be built.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from shardwise.config import ConfigError, Derived, JobConfig
from shardwise.parallel.pipeline import explicit_split, pipeline_blocks
from shardwise.parallel.tensor import tensor_parallel_plan


def check_layout(config: JobConfig, derived: Derived) -> None:
    """Check the model against the layout before any process starts (the model is built on the
    meta device, so this is cheap at any size): enough blocks for the pipeline stages, a
    tensor-parallel plan whose layers divide by `tp`."""
    from shardwise import builders

    degrees = derived.degrees
    if degrees["pp"] == 1 and degrees["tp"] == 1:
        return
    with torch.device("meta"):
        model = builders.build_model(config)
    if degrees["pp"] > 1:
        blocks = pipeline_blocks(model)
        num_stages = degrees["pp"] * derived.stages_per_rank
        if num_stages > len(blocks):
            raise ConfigError(
                f"parallel.pp = {degrees['pp']} × stages_per_rank {derived.stages_per_rank} = "
                f"{num_stages} pipeline stages, but the model has only {len(blocks)} blocks "
                f"({blocks[0]} … {blocks[-1]}); lower parallel.pp or stages_per_rank, or add layers"
            )
        if config.parallel.pipeline_split:
            explicit_split(blocks, config.parallel.pipeline_split, num_stages)
    if degrees["tp"] > 1:
        tp = degrees["tp"]
        plan_fn = (
            builders.resolve(config.parallel.tp_plan, {}, "parallel.tp_plan")
            if config.parallel.tp_plan
            else None
        )
        plan = tensor_parallel_plan(
            model, plan_fn, tp=tp, sequence_parallel=config.parallel.sequence_parallel
        )
        _check_tp_plan(model, plan, tp)


def _check_tp_plan(model: nn.Module, plan: dict[str, Any], tp: int) -> None:
    for module in model.modules():
        heads = getattr(module, "heads", None)
        if isinstance(heads, int) and heads % tp:
            raise ConfigError(
                f"parallel.tp = {tp} does not divide the {heads} attention heads: each rank must "
                f"hold whole heads; use a tp that divides {heads}"
            )
    for name, style in plan.items():
        try:
            module = model.get_submodule(name)
        except AttributeError:
            raise ConfigError(
                f"the tensor-parallel plan names '{name}', which the model does not have"
            ) from None
        dim = {ColwiseParallel: 0, RowwiseParallel: 1}.get(type(style))
        weight = getattr(module, "weight", None)
        if dim is None or weight is None or weight.dim() < 2:
            continue
        if isinstance(module, nn.Embedding):
            dim = 0 if isinstance(style, RowwiseParallel) else 1
        size = weight.shape[dim]
        if size % tp:
            raise ConfigError(
                f"parallel.tp = {tp} does not divide {name}'s {size} "
                f"{'output' if dim == 0 else 'input'} features; pick a tp that divides the "
                "model's widths"
            )
