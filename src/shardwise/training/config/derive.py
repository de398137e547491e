"""The numbers that follow from a training config once the world size is known: the mesh's
degrees, data-parallel ranks, micro-batches and accumulation, the scaled learning rate; and the
checks that need them (batch divisibility, pipeline schedules, options that do not go with a
layout), each a one-line `ConfigError` naming the fix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardwise.common.errors import ConfigError
from shardwise.training.config.schema import (
    SINGLE_STAGE_SCHEDULES,
    V_SCHEDULES,
    JobConfig,
    ParallelSection,
)


@dataclass(frozen=True)
class Derived:
    """Numbers that follow from a config and a world size; printed at start, saved with the run."""

    world_size: int
    degrees: dict[str, int]
    dp: int
    """Data-parallel ranks: ranks that read different samples (dp_replicate × dp_shard)."""
    global_batch: int
    micro_batch: int
    grad_accum: int
    """Micro-batches per rank per optimizer step."""
    lr: float
    """The learning rate after the batch-size scaling rule."""
    eval_batch: int
    stages_per_rank: int
    """Pipeline stages on each rank (1 without pipeline parallelism)."""


def derive(config: JobConfig, world_size: int) -> Derived:
    """Check a config against a world size and compute what follows from it."""
    if world_size < 1:
        raise ConfigError(f"world size {world_size}: need at least one process (--nproc 1 or more)")
    degrees = config.parallel.degrees(world_size)
    par = config.parallel
    dp = degrees["dp_replicate"] * degrees["dp_shard"]
    train = config.train
    pp = degrees["pp"]
    if par.num_microbatches is not None and pp == 1:
        raise ConfigError(
            "parallel.num_microbatches applies to pipeline parallelism (parallel.pp > 1); "
            "for gradient accumulation set train.micro_batch"
        )
    stages_per_rank = _stages_per_rank(par, pp)
    microbatches = par.num_microbatches
    if pp > 1 and microbatches is None and train.micro_batch is None:
        microbatches = pp * stages_per_rank  # enough for every schedule to fill the pipeline
    micro = train.micro_batch
    if micro is None and microbatches is not None:
        micro = max(train.global_batch // (dp * microbatches), 1)
    micro = micro or train.global_batch // dp
    if micro == 0 or train.global_batch % (micro * dp):
        raise ConfigError(_batch_hint(train.global_batch, micro, dp))
    grad_accum = train.global_batch // (micro * dp)
    if microbatches not in (None, grad_accum):
        raise ConfigError(
            f"{microbatches} pipeline micro-batches per rank (parallel.num_microbatches) do not "
            f"divide train.global_batch ({train.global_batch}) over {dp} data-parallel ranks "
            f"with train.micro_batch = {micro}; set train.micro_batch or num_microbatches so "
            "that global_batch = micro_batch × num_microbatches × data-parallel ranks"
        )
    if pp > 1:
        _check_schedule(par.pipeline_schedule, pp, stages_per_rank, grad_accum)
    _check_combinations(config, degrees)
    lr = train.lr
    if train.lr_scaling == "linear":
        lr *= train.global_batch / train.lr_base_batch
    elif train.lr_scaling == "sqrt":
        lr *= math.sqrt(train.global_batch / train.lr_base_batch)
    return Derived(
        world_size=world_size,
        degrees=degrees,
        dp=dp,
        global_batch=train.global_batch,
        micro_batch=micro,
        grad_accum=grad_accum,
        lr=lr,
        eval_batch=config.eval.batch or micro,
        stages_per_rank=stages_per_rank,
    )


def _check_combinations(config: JobConfig, degrees: dict[str, int]) -> None:
    """Options that do not go together with the layout, named with the fix."""
    train, par = config.train, config.parallel
    _check_tracking(config)
    layered = degrees["pp"] > 1 or degrees["tp"] > 1 or degrees["dp_shard"] > 1
    if train.precision == "fp16" and layered:
        raise ConfigError(
            "train.precision = 'fp16' needs a gradient scaler, which shardwise supports with "
            "plain data parallelism only; use 'bf16' with FSDP, tensor or pipeline parallelism"
        )
    if par.grad_compression in ("powersgd", "int8") and layered:
        raise ConfigError(
            f"parallel.grad_compression = '{par.grad_compression}' compresses DDP's all-reduce; "
            "FSDP2 (dp_shard > 1, or tensor/pipeline parallelism) reduces in its own "
            "reduce-scatter, whose precision is the one lever: use 'bf16' or 'fp16'"
        )
    _check_float8(config, degrees)
    if par.hierarchical is True and (layered or train.sync != "every_step"):
        raise ConfigError(
            "parallel.hierarchical = true reduces DDP's gradients node by node; with FSDP use "
            "HSDP instead (dp_replicate = nodes, dp_shard = ranks per node), and it does not "
            "apply to train.sync other than 'every_step'"
        )
    if train.sync == "every_step":
        return
    if par.grad_compression != "none":
        raise ConfigError(
            f"parallel.grad_compression applies to every-step gradient all-reduce, not to "
            f"train.sync = '{train.sync}'"
            + (" (diloco: set train.outer_compression)" if train.sync == "diloco" else "")
        )
    if degrees["dp_shard"] > 1:
        raise ConfigError(
            f"train.sync = '{train.sync}' keeps a whole replica on each data-parallel rank; "
            "set parallel.dp_shard = 1 (use dp_replicate for the ranks)"
        )
    if train.sync == "async" and (degrees["pp"] > 1 or degrees["tp"] > 1):
        raise ConfigError(
            "train.sync = 'async' needs plain data parallelism (parallel.pp = 1, parallel.tp = 1)"
        )
    if train.sync == "async" and train.precision == "fp16":
        raise ConfigError("train.sync = 'async' cannot use fp16's gradient scaler; use 'bf16'")


def _check_float8(config: JobConfig, degrees: dict[str, int]) -> None:
    train = config.train
    if train.float8 == "off":
        if train.float8_all_gather:
            raise ConfigError("train.float8_all_gather needs train.float8 = 'tensorwise'")
        return
    why = None
    if train.precision == "fp16":
        why = "works with bf16 (or fp32) for now, not fp16's gradient scaler: use 'bf16'"
    elif degrees["tp"] > 1:
        why = "does not compose with tensor parallelism yet (parallel.tp = 1)"
    elif train.float8_all_gather and train.float8 != "tensorwise":
        why = "all-gathers float8 weights with 'tensorwise' scales only (float8_all_gather)"
    elif train.float8_all_gather and degrees["dp_shard"] == 1:
        why = "all-gathers float8 weights under FSDP only: set parallel.dp_shard > 1, or drop "
        why += "train.float8_all_gather"
    if why:
        raise ConfigError(f"train.float8 = '{train.float8}' {why}, or set train.float8 = 'off'")


def _check_tracking(config: JobConfig) -> None:
    tracking = config.tracking
    if tracking.log_model and not tracking.mlflow:
        raise ConfigError(
            "tracking.log_model = true logs the model to MLflow, which tracking.mlflow = false "
            "turns off; set tracking.mlflow = true (and tracking.uri for a server)"
        )
    if tracking.registered_model and not tracking.log_model:
        raise ConfigError(
            f"tracking.registered_model = {tracking.registered_model!r} registers the logged "
            "model: set tracking.log_model = true too"
        )


def _stages_per_rank(par: ParallelSection, pp: int) -> int:
    schedule = par.pipeline_schedule
    default = 1 if schedule in SINGLE_STAGE_SCHEDULES else 2
    chosen = par.stages_per_rank or default
    if pp == 1:
        return 1
    if schedule in SINGLE_STAGE_SCHEDULES and chosen != 1:
        raise ConfigError(
            f"parallel.pipeline_schedule = '{schedule}' runs one stage per rank but "
            f"parallel.stages_per_rank = {chosen}; use 'Interleaved1F1B' for several"
        )
    if schedule in V_SCHEDULES and chosen != 2:
        raise ConfigError(
            f"parallel.pipeline_schedule = '{schedule}' places exactly 2 stages per rank; "
            "set parallel.stages_per_rank = 2 or leave it out"
        )
    return chosen


def _check_schedule(schedule: str, pp: int, stages_per_rank: int, microbatches: int) -> None:
    """The micro-batch counts torch's schedules accept, checked before launch."""
    stages = pp * stages_per_rank
    fix = "raise train.global_batch or lower train.micro_batch (or set parallel.num_microbatches)"
    if schedule == "1F1B" and microbatches < pp:
        raise ConfigError(
            f"pipeline schedule 1F1B needs at least as many micro-batches as stages ({pp}), "
            f"got {microbatches}; {fix}"
        )
    if schedule == "DualPipeV" and microbatches < stages:
        raise ConfigError(
            f"pipeline schedule DualPipeV needs at least as many micro-batches as stages "
            f"({stages}), got {microbatches}; {fix}"
        )
    # torch's looped schedules run micro-batches in rounds of max(1, m // pp); m must divide.
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            raise ConfigError(
                f"pipeline schedule {schedule} runs micro-batches in rounds of {rounds}, which "
                f"does not divide {microbatches} micro-batches per step; use a multiple of "
                f"parallel.pp ({pp}): {fix}"
            )


def config_as_saved(config: JobConfig, derived: Derived) -> JobConfig:
    """The config with every default that depends on other values written out, as saved with a
    run: re-running the saved file reproduces the run."""
    return config.model_copy(
        update={
            "job": config.job.model_copy(update={"run_dir": str(config.run_dir)}),
            "train": config.train.model_copy(update={"micro_batch": derived.micro_batch}),
            "eval": config.eval.model_copy(update={"batch": derived.eval_batch}),
            "parallel": config.parallel.model_copy(
                update={**derived.degrees, "stages_per_rank": derived.stages_per_rank}
            ),
            "checkpoint": config.checkpoint.model_copy(update={"dir": config.checkpoint_dir}),
            "tracking": config.tracking.model_copy(
                update={"experiment": config.tracking.experiment or config.job.name}
            ),
        }
    )


def _batch_hint(global_batch: int, micro: int, dp: int) -> str:
    unit = max(micro, 1) * dp
    lower = global_batch // unit * unit
    options = [str(b) for b in (lower, lower + unit) if b > 0]
    return (
        f"train.global_batch ({global_batch}) must be a multiple of train.micro_batch ({micro}) × "
        f"data-parallel ranks ({dp}) = {unit}; try train.global_batch = {' or '.join(options)}"
    )
