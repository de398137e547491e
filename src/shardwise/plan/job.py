"""Plan a shardwise job: its model, built on the meta device (parameters counted, their shapes
kept, the bytes its forward pass saves for backward traced, nothing allocated), and its own layout
and data-parallel communication mode, in the planner's terms."""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 (the conventional name)
from torch import nn
from torch.overrides import TorchFunctionMode

from shardwise.common.errors import ConfigError
from shardwise.plan.comm_modes import Mode, Tensors
from shardwise.plan.hardware import Hardware
from shardwise.plan.layout import PRECISIONS, Layout, Precision
from shardwise.plan.memory_model import Traced
from shardwise.plan.model import Transformer
from shardwise.training import job_names
from shardwise.training.config.derive import derive
from shardwise.training.config.schema import JobConfig
from shardwise.training.parallel.pipeline import model_blocks


@dataclass(frozen=True)
class PlannedJob:
    model: Transformer
    layout: Layout
    precision: Precision
    optimizer: str
    dropout: bool
    fused_attention: bool
    traced: Traced
    tensors: Tensors
    """The shapes of the model's trainable parameters."""
    mode: Mode | None
    """How its data-parallel ranks synchronise (None: a mode the planner does not model)."""
    hierarchical_auto: bool
    """`parallel.hierarchical = "auto"`: on where the ranks span nodes (`comm_modes.job_mode`)."""


def model_of(config: JobConfig) -> tuple[Transformer, bool, Traced, Tensors]:
    """The job's transformer shape (from its model arguments) with the parameter count of the
    model itself, built on the meta device; whether it uses dropout; its traced activations; and
    its trainable parameters' shapes."""
    args = {**_defaults(config), **config.model.args}
    needed = ("layers", "hidden", "heads")
    missing = [k for k in needed if k not in args]
    if missing:
        raise ConfigError(
            f"shardwise plan needs a transformer's shape; model {config.model.name!r} has no "
            f"{', '.join(missing)} argument(s): plan it by size instead (shardwise plan --params "
            "N --seq S …)"
        )
    model = job_names.build_on_meta(config)
    count = sum(p.numel() for p in model.parameters())
    tensors = Tensors(tuple(tuple(p.shape) for p in model.parameters() if p.requires_grad))
    shape = Transformer(
        layers=int(args["layers"]),
        hidden=int(args["hidden"]),
        heads=int(args["heads"]),
        vocab=int(args.get("vocab", 256)),
        seq=int(args.get("seq_len", config.data.args.get("seq_len", 128))),
        ffn=int(args.get("mlp_ratio", 4)) * int(args["hidden"]),
        tied_embeddings=False,
        measured_params=count,
    )
    dropout = float(args.get("dropout", 0.0)) > 0
    traced = trace_activations(config, model, layers=shape.layers, fused_attention=not dropout)
    return shape, dropout, traced, tensors


def trace_activations(
    config: JobConfig, model: nn.Module, *, layers: int, fused_attention: bool
) -> Traced:
    """Run one sample through the meta-device model and its loss, recording the bytes of every
    tensor autograd saves for backward (each storage once, parameters excluded), attributed to
    the block running at the time: the repeated blocks are the transformer layers, those before
    and after them the rest (a model that is not a sequence of blocks: the whole trace over its
    `layers`). On the meta device attention decomposes into its unfused parts;
    with `fused_attention` it saves what the fused kernels keep instead (query, key, value, the
    output and a log-sum-exp per row)."""
    train_set, _ = job_names.build_datasets(config)
    inputs, target = (torch.as_tensor(x).unsqueeze(0).to("meta") for x in train_set[0])
    modules = {name: model.get_submodule(name) for name in model_blocks(model)}
    kind = Counter(type(m) for m in modules.values()).most_common(1)
    layer_type = kind[0][0] if kind else None
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    saved: dict[int, tuple[str, int]] = {}
    where = ["before"]

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage()._cdata
        if key not in params and key not in saved:
            saved[key] = (where[0], t.untyped_storage().nbytes())
        return t

    def entering(*_: Any) -> None:
        where[0] = "layer"

    def leaving(*_: Any) -> None:
        where[0] = "after"

    layer_modules = [m for m in modules.values() if type(m) is layer_type]
    handles = [m.register_forward_pre_hook(entering) for m in layer_modules]
    handles += [m.register_forward_hook(leaving) for m in layer_modules]
    mode = _FusedAttentionMode() if fused_attention else contextlib.nullcontext()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), mode:
            job_names.build_loss(config)(model(inputs), target)
    finally:
        for handle in handles:
            handle.remove()
    total = {
        w: sum(n for place, n in saved.values() if place == w) for w in ("before", "layer", "after")
    }
    if not modules:  # no blocks to tell apart: the whole trace, spread over the layers
        return Traced(layer=sum(total.values()) / layers, before=0.0, after=0.0)
    per_layer = total["layer"] / len(layer_modules)
    return Traced(layer=per_layer, before=total["before"], after=total["after"])


class _FusedAttention(torch.autograd.Function):
    """What a fused attention kernel saves for backward (PyTorch's flash and memory-efficient
    kernels, on CPU and GPU): its inputs, its output (in their layout, so that merging the heads
    back is a view, not a copy) and a log-sum-exp per query row."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        shape = (*q.shape[:-1], v.shape[-1])
        if q.dim() == 4:  # (batch, heads, sequence, dim), laid out as (batch, sequence, heads, dim)
            out = q.new_empty((shape[0], shape[2], shape[1], shape[3])).transpose(1, 2)
        else:
            out = q.new_empty(shape)
        ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:-1]))
        return out


class _FusedAttentionMode(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is F.scaled_dot_product_attention:
            return _FusedAttention.apply(*args[:3])  # type: ignore[no-untyped-call]
        return func(*args, **(kwargs or {}))


def _defaults(config: JobConfig) -> dict[str, object]:
    """The model builder's default arguments (e.g. the built-in GPT's 4 layers)."""
    import inspect

    builder = job_names.resolve(config.model.name, job_names.MODELS, "model.name")
    return {
        name: p.default
        for name, p in inspect.signature(builder).parameters.items()
        if p.default is not inspect.Parameter.empty
    }


def plan_job(config: JobConfig, nproc: int, hardware: Hardware | None = None) -> PlannedJob:
    """The job's model, layout and precision as the planner sees them; `train.precision =
    "auto"` is what a run picks on `hardware`: bf16 on a GPU, fp32 on a calibrated CPU (its
    profile measures fp32's rate only)."""
    derived = derive(config, nproc)
    degrees = derived.degrees
    par = config.parallel
    model, dropout, traced, tensors = model_of(config)
    sharded = degrees["dp_shard"] > 1
    layout = Layout(
        dp=derived.dp,
        tp=degrees["tp"],
        pp=degrees["pp"],
        zero=3 if sharded else 0,
        hold_gathered_params=sharded and not par.reshard_after_forward,
        unsharded_accumulation=sharded,
        micro_batch=derived.micro_batch,
        microbatches=derived.global_batch // (derived.dp * derived.micro_batch),
        recompute=par.activation_checkpoint,
        sequence_parallel=par.sequence_parallel and degrees["tp"] > 1,
        schedule=par.pipeline_schedule,
        stages_per_rank=derived.stages_per_rank,
    )
    precision = config.train.precision
    if precision == "auto":
        precision = "fp32" if hardware is not None and hardware.device == "cpu" else "bf16"
    key = precision if precision == "fp32" else f"{precision}-autocast"
    optimizer: str = config.train.optimizer
    if optimizer == "sgd" and config.train.momentum > 0:
        optimizer = "sgd-momentum"
    # PyTorch's fused attention kernels run without dropout; with it, CPU falls back to the
    # unfused path that keeps the s × s scores.
    return PlannedJob(
        model, layout, PRECISIONS[key], optimizer, dropout, not dropout, traced,
        tensors, mode_of(config), hierarchical_auto=par.hierarchical == "auto",
    )  # fmt: skip


def mode_of(config: JobConfig) -> Mode | None:
    """The job's data-parallel communication mode (`parallel.hierarchical = "auto"` left off:
    it depends on the nodes); None for a mode the planner does not model."""
    train, par = config.train, config.parallel
    if train.sync == "every_step":
        return Mode(
            compression=par.grad_compression,
            hierarchical=par.hierarchical is True,
            powersgd_rank=par.powersgd_rank,
            sync_every=train.sync_every,
        )
    if train.sync in ("local_sgd", "diloco"):
        return Mode(
            compression=train.outer_compression if train.sync == "diloco" else "none",
            sync="local_sgd" if train.sync == "local_sgd" else "diloco",
            sync_every=train.sync_every,
            powersgd_rank=par.powersgd_rank,
        )
    if train.sync == "async":
        return Mode(sync="async", max_staleness=train.max_staleness)
    return None
