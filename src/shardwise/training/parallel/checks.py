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
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

from shardwise.common.errors import ConfigError
from shardwise.training.config.derive import Derived
from shardwise.training.config.schema import JobConfig
from shardwise.training.parallel.norms import statistics_apart
from shardwise.training.parallel.pipeline import (
    example_batch,
    group_blocks,
    has_blocks,
    has_submodule,
    model_blocks,
    pipeline_blocks,
    stage_module,
)
from shardwise.training.parallel.tensor import tensor_parallel_plan
from shardwise.training.parallel.traced import trace_split


def check_layout(config: JobConfig, derived: Derived) -> None:
    """Check the model against the layout before any process starts (the model is built on the
    meta device, so this is cheap at any size): blocks to recompute, pipeline stages that can
    be cut and run, a tensor-parallel plan that fits the model's layers."""
    from shardwise.training import builders

    degrees = derived.degrees
    recompute = config.parallel.activation_checkpoint
    split = degrees["pp"] > 1 or degrees["tp"] > 1 or recompute != "none"
    cpus = config.job.device == "cpu" or not torch.cuda.is_available()
    synced_on_cpus = cpus and derived.world_size > 1  # what _check_sync_batch_norm refuses
    if not (split or synced_on_cpus):
        return
    with torch.device("meta"):
        model = builders.build_model(config)
    if synced_on_cpus:
        _check_sync_batch_norm(model)
    if not split:
        return
    if recompute != "none" and not model_blocks(model):
        raise ConfigError(
            f"parallel.activation_checkpoint = '{recompute}' recomputes blocks, but "
            f"{type(model).__name__} has none (no pipeline_blocks(), not an nn.Sequential, no "
            "list of repeated layers); give it pipeline_blocks() (see docs/training.md, "
            "'Bring your own model and data') or set parallel.activation_checkpoint = 'none'"
        )
    if degrees["pp"] > 1:
        train_set, _ = builders.build_datasets(config)
        example = example_batch(train_set[0], derived.micro_batch, torch.device("meta"))
        _check_buffers_in_forward(model, example, degrees["pp"])
        _check_pipeline(config, derived, model, example)
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


def _check_buffers_in_forward(model: nn.Module, example: Any, pp: int) -> None:
    """A module that changes a buffer in place in forward breaks a pipeline schedule's backward
    (a later micro-batch's forward changes what an earlier one's backward needs), but torch's
    batch norms (whose statistics the stages update apart: parallel/norms.py) and instance norms
    (torch keeps copies). Run on the meta device, where in-place updates count too."""
    statistics_apart(model)  # as the stages will have them (momentum=None reads no number)
    versions = {name: b._version for name, b in model.named_buffers()}
    try:
        with torch.no_grad():
            model(example)
    except Exception:
        return  # the model does not run on the meta device: its stages are checked as they run
    for name, buffer in model.named_buffers():
        if buffer._version == versions[name]:
            continue
        owner, _, short = name.rpartition(".")
        module = model.get_submodule(owner)
        if isinstance(module, _BatchNorm | _InstanceNorm) and not isinstance(
            module, nn.SyncBatchNorm
        ):
            continue
        raise ConfigError(
            f"parallel.pp = {pp}: {owner or 'the model'} ({type(module).__name__}) changes its "
            f"buffer '{short}' in place in forward, which breaks a pipeline's backward (the next "
            "micro-batch's forward changes what the last one's backward needs); update it under "
            "torch.no_grad() on a new tensor (self.x = self.x + 1), or set parallel.pp = 1"
        )


def _check_pipeline(config: JobConfig, derived: Derived, model: nn.Module, example: Any) -> None:
    parallel, degrees = config.parallel, derived.degrees
    num_stages = degrees["pp"] * derived.stages_per_rank
    name = type(model).__name__
    if not has_blocks(model):
        if degrees["tp"] > 1:
            raise ConfigError(
                f"tensor parallelism cannot split a traced pipeline stage: {name} is not a "
                "sequence of blocks, so the pipeline traces its forward into graphs, where the "
                "plan's layers are no longer layers; give the model pipeline_blocks() (see "
                "docs/training.md, 'Pipeline parallelism') or set parallel.tp = 1"
            )
        if parallel.pipeline_balance == "cost":
            raise ConfigError(
                "parallel.pipeline_balance = 'cost' times each block on its own, which needs a "
                f"model that is a sequence of blocks; {name} is traced instead: use 'params' "
                "or name the split with parallel.pipeline_split"
            )
        trace_split(model, example, num_stages=num_stages, split=parallel.pipeline_split)
        return
    blocks = pipeline_blocks(model)
    for block in blocks:
        if not has_submodule(model, block):
            raise ConfigError(
                f"pipeline_blocks() names '{block}', which {name} does not have; it must name "
                "the model's own modules in the order data flows through them (see "
                "docs/training.md, 'Pipeline parallelism')"
            )
    if num_stages > len(blocks):
        raise ConfigError(
            f"parallel.pp = {degrees['pp']} × stages_per_rank {derived.stages_per_rank} = "
            f"{num_stages} pipeline stages, but the model has only {len(blocks)} blocks "
            f"({blocks[0]} … {blocks[-1]}); lower parallel.pp or stages_per_rank, or add layers"
        )
    stage_blocks = group_blocks(model, blocks, parallel.pipeline_split, num_stages)
    _check_stages_run(model, blocks, stage_blocks, example)


def _check_stages_run(
    model: nn.Module, blocks: list[str], stage_blocks: dict[int, list[str]], example: Any
) -> None:
    """Run every stage (a copy of the model without the other stages' blocks) on the meta
    device, on what its first block receives in the whole model: a forward that calls blocks
    it does not skip when they are missing fails here, not in every rank after launch."""
    firsts = {names[0] for names in stage_blocks.values()}
    received: dict[str, tuple[Any, ...]] = {}
    hooks = [
        model.get_submodule(b).register_forward_pre_hook(
            lambda _m, args, b=b: received.setdefault(b, args)
        )
        for b in firsts
    ]
    try:
        with torch.no_grad():
            model(example)
    except Exception:
        return  # the whole model does not run on the meta device: nothing to compare with
    finally:
        for hook in hooks:
            hook.remove()
    for index, names in sorted(stage_blocks.items()):
        stage = stage_module(model, blocks, set(names))
        args = (example,) if index == 0 else received[names[0]]
        try:
            with torch.no_grad():
                stage(*args)
        except Exception as e:
            raise ConfigError(
                f"{type(model).__name__}.forward calls a block this stage does not hold "
                f"({type(e).__name__}: {e}): a pipeline stage is a copy of the model with the "
                "other stages' blocks set to None, so forward must skip blocks that are None "
                "(if self.embed is not None: h = self.embed(h)); or remove pipeline_blocks() "
                "and the pipeline traces the forward instead (see docs/training.md, 'Pipeline "
                "parallelism')"
            ) from None


def _check_tp_plan(model: nn.Module, plan: dict[str, Any], tp: int) -> None:
    for module in model.modules():
        heads = getattr(module, "heads", getattr(module, "num_heads", None))
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
        _check_style_fits(name, module, style)
        dim = getattr(
            style, "weight_dim", {ColwiseParallel: 0, RowwiseParallel: 1}.get(type(style))
        )
        weight = getattr(module, "weight", None)
        if dim is None or weight is None or weight.dim() < 2:
            continue
        if isinstance(module, nn.Embedding):
            dim = 0 if isinstance(style, RowwiseParallel) else 1
        size = weight.shape[dim] // getattr(style, "fused", 1)
        if size % tp:
            raise ConfigError(
                f"parallel.tp = {tp} does not divide {name}'s {size} "
                f"{'output' if dim == 0 else 'input'} features; pick a tp that divides the "
                "model's widths"
            )


# The layer types torch's row- and column-wise styles split (their `_apply` raises otherwise).
_LINEAR_STYLES = (ColwiseParallel, RowwiseParallel)
_SPLITS = (nn.Linear, nn.Embedding)


def _check_style_fits(name: str, module: nn.Module, style: Any) -> None:
    """A row- or column-wise style on a layer type it cannot split fails in every rank after
    launch with torch's NotImplementedError; here it is one line. A style of its own names the
    types it splits in `layer_types`."""
    if not isinstance(style, _LINEAR_STYLES):
        return
    types = getattr(style, "layer_types", _SPLITS)
    if isinstance(module, types):
        return
    kind = type(style).__name__
    names = " and ".join(
        f"nn.{t.__name__}" if t.__module__.startswith("torch.nn") else t.__name__ for t in types
    )
    raise ConfigError(
        f"the tensor-parallel plan applies {kind} to '{name}', a {type(module).__name__}; "
        f"{kind} splits {names} only: leave '{name}' out of the plan or give it a style for "
        "its type"
    )
