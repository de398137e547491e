"""Plan a shardwise job: its model, built on the meta device (parameters counted, nothing
allocated), and its own layout, in the planner's terms."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardwise import builders
from shardwise.config import ConfigError, JobConfig, derive
from shardwise.plan.layout import PRECISIONS, Layout, Precision
from shardwise.plan.model import Transformer


@dataclass(frozen=True)
class PlannedJob:
    model: Transformer
    layout: Layout
    precision: Precision
    optimizer: str
    dropout: bool
    fused_attention: bool


def model_of(config: JobConfig) -> tuple[Transformer, bool]:
    """The job's transformer shape (from its model arguments) with the parameter count of the
    model itself, built on the meta device; and whether it uses dropout."""
    args = {**_defaults(config), **config.model.args}
    needed = ("layers", "hidden", "heads")
    missing = [k for k in needed if k not in args]
    if missing:
        raise ConfigError(
            f"shardwise plan needs a transformer's shape; model {config.model.name!r} has no "
            f"{', '.join(missing)} argument(s): plan it by size instead (shardwise plan --params "
            "N --seq S …)"
        )
    with torch.device("meta"):
        model = builders.build_model(config)
    count = sum(p.numel() for p in model.parameters())
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
    return shape, float(args.get("dropout", 0.0)) > 0


def _defaults(config: JobConfig) -> dict[str, object]:
    """The model builder's default arguments (e.g. the built-in GPT's 4 layers)."""
    import inspect

    builder = builders.resolve(config.model.name, builders.MODELS, "model.name")
    return {
        name: p.default
        for name, p in inspect.signature(builder).parameters.items()
        if p.default is not inspect.Parameter.empty
    }


def plan_job(config: JobConfig, nproc: int) -> PlannedJob:
    derived = derive(config, nproc)
    degrees = derived.degrees
    par = config.parallel
    model, dropout = model_of(config)
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
    key = precision if precision == "fp32" else f"{precision}-autocast"
    optimizer: str = config.train.optimizer
    if optimizer == "sgd" and config.train.momentum > 0:
        optimizer = "sgd-momentum"
    # PyTorch's fused attention kernels run without dropout; with it, CPU falls back to the
    # unfused path that keeps the s × s scores.
    return PlannedJob(model, layout, PRECISIONS[key], optimizer, dropout, not dropout)
