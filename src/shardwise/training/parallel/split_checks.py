"""The layout checks of a job that splits its model (pipeline stages, tensor parallelism,
recomputed blocks), on the meta device before any process starts: enough blocks for the
stages, stages that can be cut and run, a tensor-parallel plan whose layers divide by `tp`.
Called by checks.check_layout, which builds the model; each mistake is one `ConfigError` line
that names the fix.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

from shardwise.common.errors import ConfigError, first_line
from shardwise.training.config.derive import Derived
from shardwise.training.config.schema import JobConfig
from shardwise.training.parallel.norms import statistics_apart
from shardwise.training.parallel.pipeline import (
    example_batch,
    group_blocks,
    has_blocks,
    has_own_blocks,
    has_submodule,
    model_blocks,
    pipeline_blocks,
    run_stage,
    stage_module,
)
from shardwise.training.parallel.tensor import check_plan, tensor_parallel_plan
from shardwise.training.parallel.traced import TracedSplit, trace_split


def check_split(config: JobConfig, derived: Derived, model: nn.Module) -> None:
    """Check `model` (built on the meta device) against the job's pipeline, tensor-parallel
    and recompute settings."""
    from shardwise.training import job_names

    degrees = derived.degrees
    recompute = config.parallel.activation_checkpoint
    if recompute != "none" and not model_blocks(model):
        raise ConfigError(
            f"parallel.activation_checkpoint = '{recompute}' recomputes blocks, but "
            f"{type(model).__name__} has none (no pipeline_blocks(), not an nn.Sequential, no "
            "list of repeated layers); give it pipeline_blocks() (see docs/training.md, "
            "'Bring your own model and data') or set parallel.activation_checkpoint = 'none'"
        )
    if degrees["pp"] > 1:
        train_set, _ = job_names.build_datasets(config)
        example = example_batch(train_set[0], derived.micro_batch, torch.device("meta"))
        _check_buffers_in_forward(model, example, degrees["pp"])
        _check_pipeline(config, derived, model, example)
    if degrees["tp"] > 1:
        tp = degrees["tp"]
        plan_fn = (
            job_names.resolve(config.parallel.tp_plan, {}, "parallel.tp_plan")
            if config.parallel.tp_plan
            else None
        )
        plan = tensor_parallel_plan(
            model, plan_fn, tp=tp, sequence_parallel=config.parallel.sequence_parallel
        )
        check_plan(model, plan, tp)


def _check_buffers_in_forward(model: nn.Module, example: Any, pp: int) -> None:
    """A module that changes a buffer in place in forward breaks a pipeline schedule's backward
    (a later micro-batch's forward changes what an earlier one's backward needs), but torch's
    batch norms (whose statistics the stages update apart: parallel/norms.py) and instance norms
    (torch keeps copies). Run on the meta device, where in-place updates count too, on a copy:
    a traced pipeline traces the model as it is."""
    model = copy.deepcopy(model)
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
            raise _no_cost_balance(name, "is traced instead")
        traced = trace_split(model, example, num_stages=num_stages, split=parallel.pipeline_split)
        _check_traced_stages_run(model, traced, example, parallel.pipeline_split)
        return
    if parallel.pipeline_balance == "cost" and not has_own_blocks(model):
        raise _no_cost_balance(name, "is cut as transformers declares (its layers take masks too)")
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


def _no_cost_balance(name: str, instead: str) -> ConfigError:
    return ConfigError(
        "parallel.pipeline_balance = 'cost' times each block on its own, which needs blocks "
        f"that take what the one before returns; {name} {instead}: use 'params' or name the "
        "split with parallel.pipeline_split"
    )


def _check_stages_run(
    model: nn.Module, blocks: list[str], stage_blocks: dict[int, list[str]], example: Any
) -> None:
    """Run the stages (copies of the model without the other stages' blocks) one after another
    on the meta device, as the pipeline will: a forward that calls blocks it does not skip
    when they are missing fails here, not in every rank after launch."""
    stages = [stage_module(model, blocks, set(names)) for _, names in sorted(stage_blocks.items())]
    failed, wrong_shape = _run_stages(model, stages, example)
    if failed is None:
        return
    if wrong_shape:
        raise ConfigError(
            f"{type(model).__name__}'s pipeline stages, run one after another, do not give "
            f"what the model gives: {failed}; its forward must do nothing between its blocks "
            "but pass on what one returns (see docs/training.md, 'Pipeline parallelism')"
        )
    if not has_own_blocks(model):  # the stages of a plan transformers declares
        raise ConfigError(
            f"{type(model).__name__}'s pipeline plan (declared by transformers) cuts it into "
            f"stages that do not run ({failed}); name where stages begin with "
            "parallel.pipeline_split = ['module.name', …] (see docs/training.md, 'Pipeline "
            "parallelism')"
        )
    raise ConfigError(
        f"{type(model).__name__}.forward calls a block this stage does not hold "
        f"({failed}): a pipeline stage is a copy of the model with the "
        "other stages' blocks set to None, so forward must skip blocks that are None "
        "(if self.embed is not None: h = self.embed(h)); or remove pipeline_blocks() "
        "and the pipeline traces the forward instead (see docs/training.md, 'Pipeline "
        "parallelism')"
    )


def _check_traced_stages_run(
    model: nn.Module, split: TracedSplit, example: Any, named: list[str]
) -> None:
    """torch.export may trace a forward into stages that cannot run (pytorch/pytorch#184361: a
    stage that expects an input no stage before it sends): run them, on the meta device."""
    stages = [split.modules[index] for index in sorted(split.modules)]
    failed, _ = _run_stages(model, stages, example)
    if failed is not None:
        where = (
            f"cut where parallel.pipeline_split = {named} says"
            if named
            else f"cut into {len(stages)} pipeline stages"
        )
        other = "other boundaries in" if named else "where stages begin with"
        raise ConfigError(
            f"{type(model).__name__}'s forward, traced and {where}, does not run ({failed}); "
            f"name {other} parallel.pipeline_split = ['module.name', …], or give the model "
            "pipeline_blocks() (see docs/training.md, 'Pipeline parallelism')"
        )


def _run_stages(model: nn.Module, stages: list[nn.Module], example: Any) -> tuple[str | None, bool]:
    """Run `stages` in order on `example`, each on what the one before returned, and compare
    what the last returns with the whole model's output: what went wrong, in words (None if
    nothing), and whether it is that comparison (else a stage raised).
    They run on fake tensors (shapes without values, over the meta model), where transformers
    skips the checks that read values; nothing is judged where the whole model does not run
    so (its forward reads values): the stages would fail for the same reason."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from shardwise.training.job_names import model_output

    with FakeTensorMode(allow_non_fake_inputs=True) as fake, torch.no_grad():
        inputs = fake.from_tensor(example)
        try:
            whole = model_output(model(inputs))
        except Exception:
            return None, False
        h = inputs
        for index, stage in enumerate(stages):
            try:
                h = run_stage(stage, index, h)
            except Exception as e:
                return f"stage {index}: {type(e).__name__}: {first_line(e)[:200]}", False
        out = model_output(h)
    if out.shape != whole.shape:
        shapes = f"{tuple(out.shape)}, the model {tuple(whole.shape)}"
        return f"the last stage returns shape {shapes}", True
    return None, False
