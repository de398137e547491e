"""The job file: one pydantic model per TOML section, `--set` overrides, and the numbers derived
from a config once the world size is known (data-parallel degree, micro-batches, accumulation).

Every user mistake in a job file surfaces here as a `ConfigError` whose message is one line naming
the key and the fix. This module must not import torch, start processes or touch the file system
beyond reading the job file: everything above it relies on loading a config being cheap and pure.
"""

from __future__ import annotations

import difflib
import math
import tomllib
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from shardwise.common.errors import ConfigError
from shardwise.common.redact import redacted

MESH_AXES = ("pp", "dp_replicate", "dp_shard", "tp")
"""Named device-mesh axes, outermost first; their degrees multiply to the world size."""

SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")
"""Pipeline schedules with one stage per rank."""
LOOPED_SCHEDULES = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
"""Schedules with `stages_per_rank` stages per rank, placed round-robin (r, r + pp, …)."""
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
"""Schedules with exactly two stages per rank, placed in a V (r and 2·pp − 1 − r)."""
Schedule = Literal[
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
]


def _not_only_dots(name: str) -> str:
    if set(name) == {"."}:
        raise ValueError("a name of dots only would point outside runs/; use letters or digits")
    return name


RunName = Annotated[
    str, StringConstraints(pattern=r"^[A-Za-z0-9._-]+$"), AfterValidator(_not_only_dots)
]
"""A name that is also a directory under `runs/`: letters, digits, `.`, `_` and `-`, no path
separators, and not `.` or `..`."""


Beta = Annotated[float, Field(ge=0, lt=1)]


class Section(BaseModel):
    """A job-file section: unknown keys are errors, assignments are validated, numbers are finite
    and never `true`/`false` (pydantic would read `steps = true` as 1)."""

    model_config = ConfigDict(
        extra="forbid",
        validate_assignment=True,
        populate_by_name=True,
        serialize_by_alias=True,
        allow_inf_nan=False,
    )

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields.get(info.field_name or "")
        if isinstance(value, bool) and field is not None and not accepts_bool(field.annotation):
            raise ValueError(f"expected {kind_of(field.annotation)}, not {str(value).lower()}")
        return value


def accepts_bool(annotation: Any) -> bool:
    """Whether a field or argument annotated so takes `true`/`false`."""
    if annotation in (bool, Any, object) or annotation is None:
        return annotation is not None
    if typing.get_origin(annotation) is Literal:
        return any(isinstance(a, bool) for a in typing.get_args(annotation))
    return any(accepts_bool(a) for a in typing.get_args(annotation))


def accepts_str(annotation: Any) -> bool:
    """Whether a field or argument annotated so takes a string (a path, a name, a choice)."""
    if annotation in (str, Any, object) or annotation is None:
        return annotation is not None
    if isinstance(annotation, type) and issubclass(annotation, str | Path):
        return True
    if typing.get_origin(annotation) is Literal:
        return any(isinstance(a, str) for a in typing.get_args(annotation))
    return any(accepts_str(a) for a in typing.get_args(annotation))


def kind_of(annotation: Any) -> str:
    """What an annotation takes, in words: an integer, a number, a value of its type."""
    found = {a for a in (annotation, *typing.get_args(annotation)) if a in (int, float)}
    return "an integer" if found == {int} else "a number" if found else "a value of its type"


class JobSection(Section):
    name: RunName = "run"
    """Names the run (`runs/<name>`): letters, digits, `.`, `_` and `-`, not only dots."""
    seed: int = Field(0, ge=0, lt=2**32)
    """Seeds weights, data order and dropout (with the step and rank): 0 to 2**32 - 1."""
    run_dir: str = ""
    """Where config, metrics, tracking store and checkpoints go; "" means `runs/<name>`."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    threads_per_rank: int = Field(0, ge=0, le=4096)
    """torch intra-op threads per rank; 0 shares this machine's cores evenly between local ranks."""


class ModelSection(Section):
    name: str
    """A built-in model (`mlp`, `cnn`, `gpt`) or a user builder as `package.module:function`."""
    args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the builder, checked against its signature before launch."""
    init: Literal["auto", "meta", "full"] = "auto"
    """`meta`: build without memory and initialise only this rank's shard, module by module, the
    same values under every layout (the model must define `init_weights(module)` or rely on its
    modules' `reset_parameters()`); `full`: every rank builds the whole model as the builder
    initialises it, then keeps its shard; `auto`: `meta` when the model defines `init_weights`."""
    init_from: str = ""
    """A `.safetensors` file of the model's weights (what `shardwise export` writes) to start
    from, after initialisation: the weights only, with a fresh optimizer, schedule and data
    position. safetensors holds tensors and nothing else, so this is how to start from weights
    someone else trained without trusting their checkpoint directory."""


class DataSection(Section):
    name: str
    """A built-in dataset (`digits`, `text`) or a user builder as `package.module:function`."""
    args: dict[str, Any] = Field(default_factory=dict)
    num_workers: int = Field(0, ge=0)
    """DataLoader worker processes per rank; 0 loads in the training process."""


class TrainSection(Section):
    steps: int = Field(gt=0)
    global_batch: int = Field(gt=0)
    """Samples per optimizer step, summed over all data-parallel ranks and micro-batches."""
    micro_batch: int | None = Field(None, gt=0)
    """Samples per forward pass on one rank; default: global_batch / data-parallel ranks."""
    lr: float = Field(1e-3, gt=0)
    optimizer: Literal["adamw", "sgd"] = "adamw"
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[Beta, Beta] = (0.9, 0.999)
    """AdamW's decay rates of the gradient's mean and square, each in [0, 1)."""
    momentum: float = Field(0.9, ge=0)
    warmup_steps: int = Field(0, ge=0)
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"
    """Scale `lr` by global_batch / lr_base_batch (linear) or its square root (sqrt)."""
    lr_base_batch: int = Field(256, gt=0)
    grad_clip: float = Field(1.0, ge=0)
    """Clip the global gradient norm to this value; 0 turns clipping off."""
    precision: Literal["fp32", "bf16", "fp16", "auto"] = "fp32"
    """Autocast's precision for forward and backward (parameters and optimizer state stay
    fp32): `auto` is bf16 on a GPU that supports it, and on a CPU where bf16 matrix multiplies
    run at least as fast as fp32's (measured at start); the choice is printed and saved."""
    compile: bool = False
    """torch.compile each block's forward (parallel/compile.py); composes with every layout.
    The first step compiles (its time is reported as compile/seconds, apart from step times)."""
    loss: str = "cross_entropy"
    """A built-in loss (`cross_entropy`, `mse`) or `package.module:function`."""
    sync: Literal["every_step", "local_sgd", "diloco", "async"] = "every_step"
    """How data-parallel ranks agree: average gradients every step (`every_step`), train alone
    and average parameters every `sync_every` steps (`local_sgd`), the same with an outer
    Nesterov optimizer over the averaged change (`diloco`), or push gradients to a parameter
    server on rank 0 without waiting for each other (`async`)."""
    sync_every: int = Field(16, gt=0)
    """local_sgd, diloco: the steps each rank takes alone between synchronisations (H)."""
    outer_lr: float = Field(0.7, gt=0)
    """diloco: the outer optimizer's learning rate (the paper's 0.7)."""
    outer_momentum: float = Field(0.9, ge=0, lt=1)
    """diloco: the outer optimizer's Nesterov momentum (the paper's 0.9)."""
    outer_compression: Literal["none", "bf16", "int8"] = "none"
    """diloco: the precision the outer all-reduce sends the parameter change in."""
    max_staleness: int = Field(4, ge=0)
    """async: how many updates older than the one it is applied to a gradient may be computed
    on; a worker further ahead waits (0 is synchronous training)."""
    async_replay: str = ""
    """async: a run's `async_order.jsonl` (which version each pull got): this run serves every
    pull the same version and so repeats that run bit for bit."""


class EvalSection(Section):
    every_steps: int = Field(0, ge=0)
    """Evaluate on the held-out split every k steps; 0 evaluates only at the end."""
    batch: int | None = Field(None, gt=0)
    """Samples per evaluation forward pass on one rank; default: train.micro_batch."""
    max_samples: int | None = Field(None, gt=0)
    """Evaluate on at most this many held-out samples (the first ones); default: all."""


class ParallelSection(Section):
    pp: int = 1
    """Pipeline-parallel degree: ranks that each hold a different part of the model's blocks."""
    dp_replicate: int = -1
    """Data-parallel replicas (DDP, or the replicate axis of HSDP)."""
    dp_shard: int = 1
    """Data-parallel ranks that shard parameters, gradients and optimizer state (FSDP2)."""
    tp: int = 1
    """Tensor-parallel degree: ranks that split each layer's matrices."""
    reshard_after_forward: bool = True
    """FSDP: free the gathered parameters after forward and gather again in backward (ZeRO-3);
    false keeps them until backward (ZeRO-2: more memory, one all-gather fewer)."""
    tp_plan: str = ""
    """A user model's tensor-parallel plan, `package.module:function`; "" uses the model's own
    `tp_plan()` method (the built-in GPT has one)."""
    sequence_parallel: bool = False
    """With tp > 1: norms and dropout work on a slice of the sequence instead of a replica."""
    activation_checkpoint: Literal["none", "full", "selective"] = "none"
    """Recompute activations in backward instead of keeping them: all of each block's (`full`),
    or all but the matrix-multiply outputs (`selective`)."""
    pipeline_schedule: Schedule = "1F1B"
    stages_per_rank: int | None = Field(None, gt=0)
    """Pipeline stages per rank; default 1, or 2 for the interleaved, looped and V schedules."""
    num_microbatches: int | None = Field(None, gt=0)
    """Pipeline micro-batches per step on each rank; default global_batch / (data-parallel
    ranks × train.micro_batch). Setting it sets train.micro_batch."""
    pipeline_split: list[str] = Field(default_factory=list)
    """Explicit stage boundaries: the first block of every stage after the first (e.g.
    ["layers.2"]); empty splits automatically by `pipeline_balance`."""
    pipeline_balance: Literal["params", "cost"] = "params"
    """Automatic split: equal parameter counts, or equal measured forward + backward time."""
    grad_compression: Literal["none", "bf16", "fp16", "powersgd", "int8"] = "none"
    """What the gradient all-reduce sends: fp32 (`none`), half precision, PowerSGD's low-rank
    factors, or 8-bit integers with a scale per chunk. Under FSDP (dp_shard > 1) and FSDP2's
    replicate (with tp or pp) only `bf16` and `fp16` apply: the reduce-scatter's precision."""
    powersgd_rank: int = Field(2, gt=0)
    """PowerSGD: the rank of each matrix's approximation (bytes ∝ rank × (rows + columns))."""
    powersgd_start_step: int = Field(10, ge=0)
    """PowerSGD: the steps reduced uncompressed before compression starts."""
    error_feedback: bool = True
    """Compression: add what a step's compression lost to the next step's gradient."""
    hierarchical: Literal["auto"] | bool = "auto"
    """Reduce gradients inside each node first, then across nodes among one rank per node,
    then share the result inside the node; `auto`: on when the job spans more than one node."""

    def degrees(self, world_size: int) -> dict[str, int]:
        """Resolve `-1` to the ranks left over and check the degrees multiply to the world size."""
        raw = {axis: getattr(self, axis) for axis in MESH_AXES}
        for axis, degree in raw.items():
            if degree == 0 or degree < -1:
                raise ConfigError(
                    f"parallel.{axis} = {degree}: a degree is a positive integer or -1"
                )
        for axis in ("pp", "tp"):
            if raw[axis] == -1:
                raise ConfigError(
                    f"parallel.{axis} = -1: only data-parallel axes (dp_replicate, dp_shard) "
                    f"may take the ranks left over; give {axis} a number"
                )
        if raw["dp_replicate"] == -1 and raw["dp_shard"] == -1:
            raise ConfigError(
                "parallel.dp_replicate and parallel.dp_shard are both -1: at most one axis "
                "takes the ranks left over; set the other to a number"
            )
        fixed = math.prod(d for d in raw.values() if d != -1)
        if -1 in raw.values():
            if world_size % fixed:
                raise ConfigError(
                    f"the fixed parallel degrees multiply to {fixed}, which does not divide the "
                    f"world size {world_size}; use a world size that is a multiple of {fixed}"
                )
            raw = {a: (world_size // fixed if d == -1 else d) for a, d in raw.items()}
        if math.prod(raw.values()) != world_size:
            product = " × ".join(f"{a}={d}" for a, d in raw.items())
            raise ConfigError(
                f"parallel degrees {product} = {math.prod(raw.values())} but the world size is "
                f"{world_size}; make them multiply to {world_size} or set one data-parallel "
                "axis to -1"
            )
        return raw


class CheckpointSection(Section):
    dir: str = ""
    """Checkpoint directory or fsspec URL (`s3://bucket/prefix`, `gs://…`); "" means
    `<run_dir>/checkpoints`. Object-store credentials and endpoint come from the usual
    environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL for MinIO and other
    S3-compatible servers)."""
    every_steps: int = Field(0, ge=0)
    """Save every k steps; 0 saves only at the end. The last step always saves."""
    keep_last: int = Field(2, gt=0)
    async_save: Literal["auto"] | bool = Field("auto", alias="async")
    """`checkpoint.async = true`: copy the state to memory and write it in the background, so
    training waits only for the copy; rank 0 commits the checkpoint as soon as every rank's part
    is written, and the next save (or the end of the run) reports a failed write. `auto` (the
    default): on GPUs, unless the host lacks the memory for a copy of each rank's state (then
    synchronous, said at start); synchronous on CPUs, where the copy competes with training."""
    fail_on_save_error: bool = False
    """A save that fails (a full disk, a lost mount) ends the run; by default it is reported and
    training continues, the previous checkpoint still good."""


class TrackingSection(Section):
    mlflow: bool = True
    uri: str = ""
    """MLflow tracking URI; "" means an embedded SQLite store `<run_dir>/mlflow.db`."""
    experiment: str = ""
    """MLflow experiment name; "" means the job name."""
    log_every: int = Field(10, gt=0)
    """Reduce, print and record training metrics every k steps."""
    system_metrics_s: float = Field(10.0, ge=0)
    """Sample rank 0's machine (CPU, memory; GPU where NVIDIA's library sees one) into MLflow
    as `system/…` metrics every this many seconds; 0 turns it off."""
    profile_step: int = Field(10, ge=0)
    """Record a torch.profiler window from this step (0: none) for the report's split of step
    time into compute, communication and data, with each step's operators, kernels, waits for
    the device and shardwise's own phases; then count the host's reads of tensor values over
    as many steps again (profile/rank<r>.json, trainer/profile.py). Those steps are left out of
    the throughput."""
    profile_steps: int = Field(2, gt=0)
    report: bool = True
    """Write the run report (report/report.html and PNGs) at the end of the run, and log it to
    MLflow; `shardwise report RUN_DIR` writes it at any time."""


class FaultSection(Section):
    timeout_s: float = Field(600.0, gt=0, le=86_400)
    """A rank that makes no progress for this long (a hung collective, a stalled rank): every
    rank writes where it is, and the run ends naming the stuck ranks (or restarts, with
    max_restarts)."""
    max_restarts: int = Field(0, ge=0)
    """When a worker dies (any signal or exception), restart the whole worker group up to this
    many times; every rank resumes from the newest complete checkpoint."""
    check_interval_s: float = Field(2.0, ge=0)
    """How often (in seconds of training, rounded to whole steps) the ranks compare notes: a
    SIGTERM received, per-rank step times for straggler detection."""
    straggler_factor: float = Field(1.5, ge=0)
    """Flag a rank whose own work per step (batch fetch + forward) exceeds this multiple of the
    median rank's; 0 turns the check off."""
    straggler_windows: int = Field(3, gt=0)
    """Checks (see check_interval_s) in a row in which a rank must be slow to be flagged."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """A step whose loss or gradient norm is NaN or infinite: `stop` saves the last good state
    and ends the run naming the step; `skip` drops the update and counts it."""


class JobConfig(Section):
    """A whole job file. The Python API takes the same object the TOML produces."""

    job: JobSection = JobSection()
    model: ModelSection
    data: DataSection
    train: TrainSection
    eval: EvalSection = EvalSection()
    parallel: ParallelSection = ParallelSection()
    checkpoint: CheckpointSection = CheckpointSection()
    tracking: TrackingSection = TrackingSection()
    fault: FaultSection = FaultSection()

    @property
    def run_dir(self) -> Path:
        return Path(self.job.run_dir or f"runs/{self.job.name}")

    @property
    def checkpoint_dir(self) -> str:
        """A local directory or an fsspec URL (s3://bucket/prefix)."""
        return self.checkpoint.dir or str(self.run_dir / "checkpoints")

    @property
    def tracking_uri(self) -> str:
        return self.tracking.uri or f"sqlite:///{(self.run_dir / 'mlflow.db').resolve()}"


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


def resolved(config: JobConfig, derived: Derived) -> JobConfig:
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


Schema = TypeVar("Schema", bound=BaseModel)


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> JobConfig:
    """Read a TOML training job file, apply `a.b=value` overrides, and validate it."""
    return load_job_file(path, overrides, JobConfig)


def load_job_file(
    path: str | Path, overrides: list[str] | tuple[str, ...], schema: type[Schema]
) -> Schema:
    """Read any shardwise job file (training, many-models) into its schema, with overrides."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"job file {path} does not exist; check the path") from None
    except IsADirectoryError:
        raise ConfigError(f"{path} is a directory; pass the job's .toml file") from None
    except OSError as e:
        raise ConfigError(f"cannot read job file {path}: {e.strerror or e}") from None
    raw = read_toml(data, str(path))
    for item in overrides:
        apply_override(raw, item)
    return validate_as(schema, raw, source=str(path))


def read_toml(data: bytes, source: str) -> dict[str, Any]:
    """A job file's TOML as a dict, or one line saying what is wrong."""
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise ConfigError(f"{source} is UTF-16 text; TOML files are UTF-8: save it as UTF-8")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ConfigError(
            f"{source} is not UTF-8 text (byte {data[e.start]:#04x} on line {line}); TOML files "
            "are UTF-8: save it as UTF-8"
        ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source} is not valid TOML: {e}") from None
    except RecursionError:
        raise ConfigError(f"{source} nests arrays or tables too deeply to read") from None
    except ValueError as e:  # a number Python will not read (over 4300 digits)
        raise ConfigError(f"{source}: {str(e).split(';')[0]}") from None


def validate(raw: dict[str, Any], *, source: str = "config") -> JobConfig:
    """Validate a nested dict (a parsed job file) into a `JobConfig`, one line per mistake."""
    return validate_as(JobConfig, raw, source=source)


def validate_as(schema: type[Schema], raw: dict[str, Any], *, source: str = "config") -> Schema:
    """Validate a nested dict into `schema`; every mistake becomes part of one `ConfigError`."""
    try:
        return schema.model_validate(raw)
    except ValidationError as e:
        problems = [_describe(err, schema) for err in e.errors()]
        raise ConfigError(f"{source}: " + "; ".join(problems)) from None


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply one `--set section.key=value` to a parsed job file; the value is read as TOML."""
    key, sep, text = item.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts):
        raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. train.lr=3e-4")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text  # a bare word such as `gpt` or a path: keep it as a string
    except RecursionError:
        raise ConfigError(f"--set {key.strip()}=…: the value nests too deeply to read") from None
    except ValueError as e:  # a number Python will not read (over 4300 digits)
        raise ConfigError(f"--set {key.strip()}=…: {str(e).split(';')[0]}") from None
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {item!r}: {part} is a value, not a section")
        node = child
    node[parts[-1]] = value


def flatten(config: BaseModel) -> dict[str, str]:
    """The resolved config as dotted keys and string values (for tracking params), credentials
    redacted."""
    out: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            out[prefix] = str(value)

    walk("", shown(config))
    return out


def shown(config: BaseModel, *, exclude_none: bool = False) -> dict[str, Any]:
    """The config as plain data to show or store (files, logs, metadata): credentials in URIs
    redacted (redact.py). Only the config in memory holds them."""
    return redacted(config.model_dump(mode="json", exclude_none=exclude_none))


def _describe(err: Any, schema: type[BaseModel]) -> str:
    loc = ".".join(str(p) for p in err["loc"])
    kind = err["type"]
    if kind == "extra_forbidden":
        return f"unknown key '{loc}'{_did_you_mean(err['loc'], schema)}"
    if kind == "missing":
        return f"missing key '{loc}'"
    got = err.get("input")
    message = err["msg"].lower().removeprefix("value error, ")
    if isinstance(got, bool | float | int | str) and len(repr(got)) > 60:
        got = f"{repr(got)[:40]}…"  # one line, not a page of digits
    return f"{loc}: {message} (got {got!r})"


def _did_you_mean(loc: tuple[Any, ...], schema: type[BaseModel]) -> str:
    model = schema
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        annotation = field.annotation if field else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return ""
        model = annotation
    close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1, cutoff=0.6)
    prefix = ".".join(str(p) for p in loc[:-1])
    if close:
        return f"; did you mean '{prefix + '.' if prefix else ''}{close[0]}'?"
    return f"; valid keys here: {', '.join(model.model_fields)}"
