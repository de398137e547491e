"""Tensor parallelism with DTensor, and activation checkpointing: the two per-block transforms
`parallelize` applies between the pipeline split and data parallelism.

A tensor-parallel plan maps module names to torch's parallel styles (ColwiseParallel,
RowwiseParallel, SequenceParallel, PrepareModuleInput, …). It comes from `parallel.tp_plan`
(`package.module:function`, called as `function(model, sequence_parallel=...)`) or, when that is
empty, from the model's own `tp_plan(sequence_parallel=...)` method (the built-in GPT has one),
or for a GPT-2-style Hugging Face model from shardwise's plan for it (models/hf.py).
A plan names only modules present in the model it is given, so it works on a pipeline stage.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from shardwise.common.errors import ConfigError
from shardwise.models import hf, hf_init

PlanFn = Callable[..., dict[str, ParallelStyle]]


def tensor_parallel_plan(
    model: nn.Module, plan_fn: PlanFn | None, *, tp: int, sequence_parallel: bool
) -> dict[str, ParallelStyle]:
    """The plan from `parallel.tp_plan` if given, else the model's own `tp_plan()`."""
    if plan_fn is not None:
        return plan_fn(model, sequence_parallel=sequence_parallel)
    own = getattr(model, "tp_plan", None)
    hf_plan = hf.default_tp_plan(model)
    if hf_plan is not None and not callable(own):
        return hf_plan[0](model, sequence_parallel=sequence_parallel)
    if not callable(own):
        has = "declares" if hf_init.is_hf(model) else "has"
        raise ConfigError(
            f"parallel.tp = {tp} needs a tensor-parallel plan: {type(model).__name__} {has} "
            "none (no tp_plan() method), so set parallel.tp_plan = 'package.module:function' "
            "(see docs/training.md, 'Tensor parallelism')"
        )
    plan: dict[str, ParallelStyle] = own(sequence_parallel=sequence_parallel)
    return plan


def apply_tensor_parallel(
    model: nn.Module, tp_mesh: DeviceMesh, plan_fn: PlanFn | None, *, sequence_parallel: bool
) -> None:
    """Shard the model's layers over the `tp` axis, in place."""
    plan = tensor_parallel_plan(
        model, plan_fn, tp=tp_mesh.size(), sequence_parallel=sequence_parallel
    )
    parallelize_module(model, tp_mesh, plan)


# Ops whose outputs selective checkpointing keeps: the matrix multiplies of linear layers, the
# expensive part to recompute. Everything else (attention core, norms, activations, dropout) is
# recomputed: the "selective recomputation" of Korthikanti et al. (2022), §4.2, which stores the
# linear layers' outputs and recomputes the attention scores, softmax and dropout.
_SAVE_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(model: nn.Module, blocks: list[str], mode: str) -> None:
    """Wrap each block so that its activations are recomputed in backward (`full`), or all but
    the matrix-multiply outputs (`selective`)."""
    if mode == "none":
        return
    kwargs: dict[str, Any] = {"preserve_rng_state": True}  # dropout recomputes the same masks
    if mode == "selective":
        kwargs["context_fn"] = functools.partial(
            create_selective_checkpoint_contexts, _selective_policy
        )
    for name in blocks:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        block = parent._modules.get(leaf)
        if block is not None:
            parent._modules[leaf] = checkpoint_wrapper(block, **kwargs)


def check_plan(model: nn.Module, plan: dict[str, Any], tp: int) -> None:
    """One line before launch for a plan that cannot split `model` over `tp` ranks: heads or
    widths that `tp` does not divide, a layer the plan names but the model lacks, a style on a
    layer type it cannot split."""
    config = getattr(model, "config", None)  # transformers keeps the counts there
    for key, what in (("num_attention_heads", "attention"), ("num_key_value_heads", "key/value")):
        count = getattr(config, key, None)
        if isinstance(count, int) and count % tp:
            raise ConfigError(
                f"parallel.tp = {tp} does not divide the {count} {what} heads: each rank must "
                f"hold whole heads; use a tp that divides {count}"
            )
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
