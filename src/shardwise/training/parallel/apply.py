"""`parallelize`: the one function that turns a model into this rank's share of its layout.

The transforms apply in a fixed order, each to what the previous one produced:

1. pipeline split: which blocks live on this rank (one copy of the model per local stage, the
   other stages' blocks removed), because every later step works per stage;
2. tensor parallel: shards the linear layers of the plain modules (it must see them unwrapped);
3. activation checkpointing: wraps whole blocks, which may now hold DTensor parameters; then
   `compile` compiles each block's own forward inside its wrapper where a wrapper needs the
   blocks (FSDP2, pipeline stages, tensor parallelism, checkpointing); elsewhere the trainer
   compiles the whole model (parallel/compilation.py);
4. data parallel, last, so its gradient hooks cover every parameter of the final module tree:
   FSDP2 `fully_shard` per block and then the root (ZeRO-3, or ZeRO-2 with
   `reshard_after_forward = false`; HSDP when both data-parallel axes are > 1), FSDP2's
   `replicate` when data is only replicated but tensor or pipeline parallelism is on, and DDP
   for plain data parallelism (the fastest there).

Between 4's FSDP2 and DDP, `init` gives the parameters storage: FSDP2 and tensor parallelism work on
meta tensors, so each rank allocates only its shard; DDP broadcasts rank 0's weights when it wraps,
so it needs real ones. Without `init` (a dry run) the parameters stay on the meta device and DDP,
which has nothing to broadcast, is named but not applied.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from shardwise.models import hf
from shardwise.training.config.derive import Derived
from shardwise.training.config.schema import ParallelSection
from shardwise.training.parallel.compilation import apply_compile, whole_model
from shardwise.training.parallel.float8 import Float8, convert
from shardwise.training.parallel.norms import statistics_apart
from shardwise.training.parallel.pipeline import (
    Pipeline,
    group_blocks,
    has_blocks,
    has_own_blocks,
    has_submodule,
    held_names,
    model_blocks,
    pipeline_blocks,
    stage_indices,
    stage_module,
)
from shardwise.training.parallel.tensor import (
    PlanFn,
    apply_activation_checkpointing,
    apply_tensor_parallel,
)
from shardwise.training.parallel.ties import connect, retie, spanning_ties, tied_groups
from shardwise.training.parallel.traced import trace_split

REDUCE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
"""FSDP2's reduce-scatter precision for `parallel.grad_compression` (its one compression)."""


@dataclass
class Layout:
    """This rank's share of the model."""

    parts: list[nn.Module]
    """The model parts on this rank: one, or one per local stage under pipeline parallelism."""
    pipeline: Pipeline | None
    wrapper: str
    """The data-parallel wrapper: `none`, `ddp`, `replicate` or `fsdp`."""
    applied: list[str] = field(default_factory=list)
    """What each transform was applied to on this rank, one line each (printed at start)."""
    compiled: str = ""
    """`train.compile`: `whole` (the model compiled whole, by the trainer with its loss) or
    `blocks` (each block's forward compiled here); "" when not compiled."""
    backend: str = ""
    """The torch.compile backend where compiled (`train.compile_backend`)."""


def data_parallel_wrapper(degrees: dict[str, int], *, every_step: bool = True) -> str:
    """`every_step` false: the ranks synchronise some other way (train.sync), so replicas get
    no wrapper that would all-reduce their gradients."""
    if degrees["dp_shard"] > 1:
        return "fsdp"
    if degrees["dp_replicate"] > 1 and every_step:
        plain = degrees["tp"] == 1 and degrees["pp"] == 1
        return "ddp" if plain else "replicate"
    return "none"


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    derived: Derived,
    parallel: ParallelSection,
    *,
    device: torch.device,
    init: Callable[[list[nn.Module]], None] | None,
    tp_plan: PlanFn | None = None,
    param_dtype: torch.dtype | None = None,
    block_costs: list[float] | None = None,
    example: Any = None,
    every_step: bool = True,
    compile: str | None = None,
    float8: Float8 | None = None,
) -> Layout:
    """`example` is one micro-batch of inputs, which a pipeline traces models that are not a
    sequence of blocks with; `every_step` false leaves replicas unwrapped (train.sync);
    `compile`: the torch.compile backend to compile the blocks with (train.compile), None not
    to compile them; `float8`: the linears to swap for float8 ones (train.float8), before
    anything else (a pipeline's stages, FSDP's all-gather, compile) sees them."""
    degrees = derived.degrees
    ties = tied_groups(model)
    all_blocks = model_blocks(model)
    converted = convert(model, float8, compiled=bool(compile)) if float8 is not None else []
    # 1. Pipeline split.
    pipe = (
        split_pipeline(model, mesh, derived, parallel, block_costs, example, device)
        if degrees["pp"] > 1
        else None
    )
    parts = [pipe.modules[i] for i in sorted(pipe.modules)] if pipe else [model]
    wrapper = data_parallel_wrapper(degrees, every_step=every_step)
    held = [b for part in parts for b in all_blocks if has_submodule(part, b)]
    compiled, backend = "", compile or ""
    if compile:
        whole = whole_model(degrees, parallel.activation_checkpoint, wrapper)
        compiled = "whole" if whole else "blocks"
    applied = describe(model, held, degrees, parallel, wrapper, compiled=compiled, backend=backend)
    applied += converted
    if pipe is not None:  # before compiling: the graphs trace the forward it gets
        applied += _statistics_apart(parts)
    for part in parts:
        blocks = [b for b in all_blocks if has_submodule(part, b)]
        # 2. Tensor parallel (which gives each name of a tied weight a parameter of its own).
        if degrees["tp"] > 1:
            apply_tensor_parallel(
                part, mesh["tp"], tp_plan, sequence_parallel=parallel.sequence_parallel
            )
            retie(part, ties)
        # 3. Activation checkpointing.
        apply_activation_checkpointing(part, blocks, parallel.activation_checkpoint)
        if compiled == "blocks":
            apply_compile(part, blocks, backend=backend)
        # 4a. FSDP2 or its replicate mode.
        if wrapper in ("fsdp", "replicate"):
            shard(part, blocks, mesh, degrees, parallel, param_dtype=param_dtype)
    if init is not None:
        init(parts)
    # 4b. DDP.
    if wrapper == "ddp" and init is not None:
        parts = [
            DistributedDataParallel(
                part,
                device_ids=[device.index] if device.type == "cuda" else None,
                device_mesh=mesh["dp_replicate"],
                # Gradients live inside DDP's all-reduce buckets: one copy fewer per step.
                gradient_as_bucket_view=True,
            )
            for part in parts
        ]
    if pipe is not None:
        pipe.modules = dict(zip(sorted(pipe.modules), parts, strict=True))
    return Layout(
        parts=parts,
        pipeline=pipe,
        wrapper=wrapper,
        applied=applied,
        compiled=compiled,
        backend=backend,
    )


def describe(
    model: nn.Module,
    blocks: list[str],
    degrees: dict[str, int],
    parallel: ParallelSection,
    wrapper: str,
    *,
    compiled: str = "",
    backend: str = "inductor",
) -> list[str]:
    """One line per transform: what it applies to on this rank (nothing is silently skipped)."""
    units = _units(model, blocks)
    name = type(model).__name__
    compiler = "torch.compile" if backend == "inductor" else f"torch.compile ({backend})"
    lines = []
    if degrees["tp"] > 1:
        if parallel.tp_plan:
            plan = "parallel.tp_plan"
        elif callable(getattr(model, "tp_plan", None)):
            plan = f"{name}.tp_plan()"
        else:
            declared = hf.default_tp_plan(model)
            plan = declared[1] if declared else "the model's plan"
        lines.append(f"tensor parallel over {degrees['tp']} ranks splits the layers of {plan}")
    if parallel.activation_checkpoint != "none":
        lines.append(
            f"activation checkpointing ({parallel.activation_checkpoint}) recomputes {units}"
        )
    if compiled == "whole":
        inside = " inside DDP, split at its gradient buckets" if wrapper == "ddp" else ""
        lines.append(f"{compiler} compiles {name} whole{inside}")
    elif compiled:
        needs = _needs(degrees, parallel, wrapper)
        lines.append(
            f"{compiler} compiles the forward of {units} one at a time ({needs} the blocks "
            "eager around their graphs); the rest runs eagerly"
            if units
            else f"{compiler} compiles {name} whole, since it has no blocks"
        )
    if wrapper == "fsdp":
        zero = "ZeRO-3" if parallel.reshard_after_forward else "ZeRO-2"
        lines.append(
            f"FSDP2 ({zero}) shards {units} one at a time, then the rest of the model"
            if units
            else f"FSDP2 ({zero}) shards {name} as one unit, since it has no blocks (no "
            "pipeline_blocks(), not an nn.Sequential, no list of repeated layers): every rank "
            "gathers all of its parameters at once"
        )
    elif wrapper == "replicate":
        lines.append(f"data parallel (FSDP2 replicate) reduces {units or name + ' as one unit'}")
    elif wrapper == "ddp":
        lines.append("data parallel (DDP): every rank holds the whole model")
    return lines


def _statistics_apart(parts: list[nn.Module]) -> list[str]:
    """Pipeline stages' batch norms made safe for the schedule (parallel/norms.py), said."""
    apart = [name for part in parts for name in statistics_apart(part)]
    if not apart:
        return []
    return [
        f"pipeline: {len(apart)} batch norms on this rank ({span(apart)}) update their running "
        "statistics apart from normalising (torch's in-place update would break the schedule's "
        "backward)"
    ]


def _needs(degrees: dict[str, int], parallel: ParallelSection, wrapper: str) -> str:
    """What in the layout keeps compilation per block, in words."""
    needs = []
    if wrapper in ("fsdp", "replicate"):
        needs.append("FSDP2 gathers and reduces around each block")
    if degrees["pp"] > 1:
        needs.append("the pipeline runs stages of blocks")
    if degrees["tp"] > 1:
        needs.append("tensor parallelism redistributes between layers")
    if parallel.activation_checkpoint != "none":
        needs.append("activation checkpointing recomputes each block")
    return "; ".join(needs) + (": they need" if len(needs) == 1 else ": these need")


def _units(model: nn.Module, blocks: list[str]) -> str:
    """The blocks a transform applies to, in words ("" when the model has none)."""
    if has_own_blocks(model):
        return f"{len(blocks)} blocks ({span(blocks)})"
    if blocks:
        kind = type(model.get_submodule(blocks[0])).__name__
        return f"{len(blocks)} repeated {kind} layers ({span(blocks)}, found in the model)"
    return ""


def span(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]} … {names[-1]}"


def shard(
    part: nn.Module,
    blocks: list[str],
    mesh: DeviceMesh,
    degrees: dict[str, int],
    parallel: ParallelSection,
    *,
    param_dtype: torch.dtype | None,
) -> None:
    """FSDP2 on each block, then on the root (which takes every parameter outside the blocks).
    Gradients are reduce-scattered in fp32, or in the half precision `grad_compression` names."""
    reduce_dtype = REDUCE_DTYPES.get(parallel.grad_compression, torch.float32)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    wrap: Callable[[nn.Module], Any]
    if degrees["dp_shard"] > 1:
        axes = ("dp_replicate", "dp_shard") if degrees["dp_replicate"] > 1 else ("dp_shard",)
        wrap = functools.partial(
            fully_shard,
            mesh=mesh[axes],
            reshard_after_forward=parallel.reshard_after_forward,
            mp_policy=policy,
        )
    else:
        wrap = functools.partial(replicate, mesh=mesh["dp_replicate"], mp_policy=policy)
    for group in _blocks_by_shared_parameters(part, blocks):
        # blocks that share a parameter (a tied embedding and output layer) form one group
        wrap(
            [part.get_submodule(name) for name in group]
            if len(group) > 1
            else part.get_submodule(group[0])
        )
    wrap(part)
    for module in part.modules():
        if isinstance(module, FSDPModule):
            # gloo turns ReduceOp.AVG into a plain sum in reduce-scatter (pytorch#162338):
            # reduce with SUM and let FSDP divide by the data-parallel size itself.
            module.set_force_sum_reduction_for_comms(True)


def _blocks_by_shared_parameters(part: nn.Module, blocks: list[str]) -> list[list[str]]:
    """The blocks in groups of those that share a parameter (most blocks are alone)."""
    parent = list(range(len(blocks)))

    def root(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i

    first_holder: dict[int, int] = {}
    for i, name in enumerate(blocks):
        for param in part.get_submodule(name).parameters():
            if id(param) in first_holder:
                parent[root(i)] = root(first_holder[id(param)])
            else:
                first_holder[id(param)] = i
    groups: dict[int, list[str]] = {}
    for i, name in enumerate(blocks):
        groups.setdefault(root(i), []).append(name)
    return list(groups.values())


def split_pipeline(
    model: nn.Module,
    mesh: DeviceMesh,
    derived: Derived,
    parallel: ParallelSection,
    block_costs: list[float] | None,
    example: Any,
    device: torch.device,
) -> Pipeline:
    """This rank's stages: pp × stages_per_rank stages placed by the schedule. A sequence of
    blocks is split into consecutive groups of blocks (explicitly, or balanced by parameter
    count or measured cost), each stage a copy of the model without the others' blocks; any
    other model is traced on `example` (a micro-batch of inputs) and its graph cut into stages
    (traced.py)."""
    pp, per_rank = derived.degrees["pp"], derived.stages_per_rank
    num_stages = pp * per_rank
    schedule = parallel.pipeline_schedule
    owner = [0] * num_stages
    for r in range(pp):
        for s in stage_indices(schedule, pp_rank=r, pp=pp, stages_per_rank=per_rank):
            owner[s] = r
    pp_rank = mesh.get_local_rank("pp")
    mine = [s for s in range(num_stages) if owner[s] == pp_rank]
    static_batch, split_by = None, "blocks" if has_own_blocks(model) else "declared"
    if has_blocks(model):
        blocks = pipeline_blocks(model)
        stage_blocks = group_blocks(model, blocks, parallel.pipeline_split, num_stages, block_costs)
        held = {s: held_names(model, blocks, set(stage_blocks[s])) for s in range(num_stages)}
        modules = {s: stage_module(model, blocks, set(stage_blocks[s])) for s in mine}
    else:
        traced = trace_split(
            model, example, num_stages=num_stages, split=parallel.pipeline_split, device=device
        )
        stage_blocks, held = traced.blocks, traced.held
        modules = {s: traced.modules[s] for s in mine}
        static_batch, split_by = derived.micro_batch, "traced"
    ties = spanning_ties(model, held, owner, pp_rank)
    connect(ties, pp_slices(mesh), mesh.get_group("pp"))
    return Pipeline(
        schedule_name=schedule,
        num_stages=num_stages,
        num_microbatches=derived.grad_accum,
        group=mesh.get_group("pp"),
        owner=owner,
        modules=modules,
        block_names=stage_blocks,
        ties=ties,
        static_batch=static_batch,
        split_by=split_by,
    )


def pp_slices(mesh: DeviceMesh) -> list[list[int]]:
    """The global ranks of every pipeline (each pp group), in pp order."""
    pp = mesh["pp"].size()
    ranks: list[list[int]] = mesh.mesh.movedim(0, -1).reshape(-1, pp).tolist()
    return ranks


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside whatever wrapper `parallelize` added."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def gradient_sync(model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager[None]:
    """Skip the gradient reduction for all but the last micro-batch of a step: gradients then
    accumulate locally and are reduced once, as if the whole batch had gone through at once."""
    if isinstance(model, DistributedDataParallel):
        return contextlib.nullcontext() if enabled else model.no_sync()
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
    return contextlib.nullcontext()
