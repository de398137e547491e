"""The training job file's schema: one pydantic model per TOML section, each key with its
default, bounds and a docstring (docs/configuration.md is generated from them). Checks that need
only one section live on it; checks that need the world size are in derive.py.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field

from shardwise.common.errors import ConfigError
from shardwise.common.job_files import RunName, Section

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


Beta = Annotated[float, Field(ge=0, lt=1)]


class JobSection(Section):
    """The run as a whole: its name and directory, the random seed, and the device and CPU
    threads each rank computes with."""

    name: RunName = "run"
    """Names the run (`runs/<name>`): letters, digits, `.`, `_` and `-`, not only dots."""
    seed: int = Field(0, ge=0, lt=2**32)
    """Seeds weights, data order and dropout (with the step and rank): 0 to 2**32 - 1."""
    run_dir: str = ""
    """Where config, metrics, tracking store and checkpoints go; "" means `runs/<name>`."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where each rank computes: `cuda`, one GPU per rank (refused before launch when a node
    shows fewer GPUs than it runs ranks, or none); `cpu`, the CPU (with gloo) whatever the
    machine has; `auto`: `cuda` where CUDA sees a GPU, else `cpu`."""
    threads_per_rank: int = Field(0, ge=0, le=4096)
    """torch intra-op threads per rank; 0 shares this machine's cores evenly between local ranks."""


class ModelSection(Section):
    """The model to train: a built-in one or your own builder, its arguments, how its weights
    are initialised, and trained weights to start from."""

    name: str
    """A built-in model (`mlp`, `cnn`, `gpt`, `resnet`) or a user builder as
    `package.module:function`."""
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
    """The training and held-out data: a built-in data set or your own builder, its arguments,
    and the loader's worker processes."""

    name: str
    """A built-in dataset (`digits`, `text`) or a user builder as `package.module:function`."""
    args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the builder, checked against its signature before launch."""
    num_workers: int = Field(0, ge=0)
    """DataLoader worker processes per rank; 0 loads in the training process. (A streamed table
    reads with `data.args.read_threads` threads per rank instead.)"""
    allow_changed: bool = False
    """Resume a streamed run although its data changed since the checkpoint (another Delta
    version, Iceberg snapshot or set of files): by default that resume is refused, since it
    would not read the samples the run would have read."""


class TrainSection(Section):
    """How to train: steps and batch sizes, the optimizer and its learning-rate schedule,
    precision, compilation, the loss, and how data-parallel ranks keep in step."""

    steps: int = Field(gt=0)
    """Optimizer steps to train, counted from the run's start: a resumed run goes on to this
    step, and the learning-rate schedule ends here."""
    global_batch: int = Field(gt=0)
    """Samples per optimizer step, summed over all data-parallel ranks and micro-batches."""
    micro_batch: int | None = Field(None, gt=0)
    """Samples per forward pass on one rank; default: global_batch / data-parallel ranks."""
    lr: float = Field(1e-3, gt=0)
    """Base learning rate: the peak the schedule warms up to and decays from (times
    `lr_scaling`'s factor, when that is set)."""
    optimizer: Literal["adamw", "sgd"] = "adamw"
    """`adamw` (torch's AdamW, with `betas`) or `sgd` (with `momentum`)."""
    weight_decay: float = Field(0.0, ge=0)
    """Weight decay, on matrices and embeddings only (parameters of two or more dimensions), not
    on biases and norm scales: AdamW's decoupled decay, SGD's L2 term; 0 turns it off."""
    betas: tuple[Beta, Beta] = (0.9, 0.999)
    """AdamW's decay rates of the gradient's mean and square, each in [0, 1)."""
    momentum: float = Field(0.9, ge=0)
    """`sgd` only: the momentum factor; 0 is plain SGD. AdamW uses `betas` instead."""
    warmup_steps: int = Field(0, ge=0)
    """Steps over which the learning rate rises linearly, from lr / warmup_steps at the first
    step to lr; 0: no warmup, lr from the first step."""
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    """The learning rate after warmup: down to min_lr_ratio × lr at the last step along a half
    cosine (`cosine`) or a straight line (`linear`), or held at lr (`constant`)."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """`cosine` and `linear` decay: the last step's learning rate as a fraction of lr; 0 decays
    to zero."""
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"
    """Scale `lr` by global_batch / lr_base_batch (linear) or its square root (sqrt)."""
    lr_base_batch: int = Field(256, gt=0)
    """`lr_scaling`: the global batch at which `lr` applies as written."""
    grad_clip: float = Field(1.0, ge=0)
    """Clip the global gradient norm to this value; 0 turns clipping off."""
    precision: Literal["fp32", "bf16", "fp16", "auto"] = "fp32"
    """Autocast's precision for forward and backward (parameters and optimizer state stay
    fp32): `auto` is bf16 on a GPU that supports it, and on a CPU where bf16 matrix multiplies
    run at least as fast as fp32's (measured at start); the choice is printed and saved."""
    compile: bool = False
    """torch.compile each block's forward (parallel/compilation.py); composes with every layout.
    The first step compiles (its time is reported as compile/seconds, apart from step times)."""
    compile_backend: str = Field("inductor", min_length=1)
    """`train.compile`'s backend, by torch.compile's name for it: `inductor` generates fused
    kernels; `aot_eager` captures the same graphs (forward and backward) and runs them with
    torch's own kernels, which is torch's first step when a compiled run fails or differs, and
    checks graph breaks and recompilation without inductor's code generation."""
    float8: Literal["off", "tensorwise", "rowwise", "rowwise_with_gw_hp"] = "off"
    """Float8 matrix multiplies in the linear layers (torchao, parallel/float8.py), weights kept
    in their precision: `tensorwise` (one scale per tensor: the fastest), `rowwise` (a scale per
    row: robust to outliers), `rowwise_with_gw_hp` (rowwise, the weight gradient in high
    precision: the most accurate). Pays on large matrix multiplies, compiled, on GPUs of compute
    capability 8.9 or above (H100, H200, L4, RTX 4090); `off` by default."""
    float8_layers: Literal["auto"] | list[str] = "auto"
    """`train.float8`'s layers: `auto`, the linears large enough to gain under the recipe
    (torchao's H100 thresholds), or a list of globs on the layers' qualified names
    (`["*.mlp.up", "*.mlp.down"]`). A layer whose dimensions do not divide by 16 is never
    converted; the start line lists those that are."""
    float8_all_gather: bool = False
    """`train.float8 = "tensorwise"` under FSDP: all-gather the weights in float8 (half of
    bf16's bytes), their scales computed in one all-reduce after each optimizer step."""
    float8_emulate: bool = False
    """Compute float8's matrix multiplies in fp32 from the float8 values (torchao's emulation):
    the same numerics on any device, without the speed; for CPUs and older GPUs."""
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
    """Evaluation on the held-out data set (the second one the data builder returns; none when
    that is None): how often, in what batches, and on how many samples."""

    every_steps: int = Field(0, ge=0)
    """Evaluate on the held-out split every k steps; 0 evaluates only at the end."""
    batch: int | None = Field(None, gt=0)
    """Samples per evaluation forward pass on one rank; default: train.micro_batch."""
    max_samples: int | None = Field(None, gt=0)
    """Evaluate on at most this many held-out samples (the first ones); default: all."""


class ParallelSection(Section):
    """How the model and its training are laid out over the ranks: the device mesh's degrees
    (pipeline, data and tensor parallel), each kind's options, and how gradients are reduced."""

    pp: int = 1
    """Pipeline-parallel degree: ranks that each hold a different part of the model's blocks."""
    dp_replicate: int = -1
    """Data-parallel replicas (DDP, or the replicate axis of HSDP); -1, the default, takes the
    ranks the other degrees leave over."""
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
    """With pp > 1, torch's pipeline schedule: `GPipe` and `1F1B` run one stage per rank;
    `Interleaved1F1B`, `LoopedBFS` and `InterleavedZeroBubble` run `stages_per_rank` stages per
    rank, round-robin; `ZBVZeroBubble` and `DualPipeV` run two per rank, in a V."""
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
    """Checkpoints, which `--resume` and restarts continue from: where and how often they are
    saved, how many are kept, whether in the background, and what a failed save does."""

    dir: str = ""
    """Checkpoint directory or fsspec URL (`s3://bucket/prefix`, `gs://…`); "" means
    `<run_dir>/checkpoints`. Object-store credentials and endpoint come from the usual
    environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL for MinIO and other
    S3-compatible servers)."""
    every_steps: int = Field(0, ge=0)
    """Save every k steps; 0 saves only at the end. The last step always saves."""
    keep_last: int = Field(2, gt=0)
    """Checkpoints kept: a save deletes every one older than the newest `keep_last` that verify
    against their manifest (a damaged one newer than those is neither counted nor deleted)."""
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
    """What the run records: metrics (always in `<run_dir>/metrics.jsonl`, and in MLflow), rank
    0's machine's system metrics, a profiled window of steps on every rank, and the run report."""

    mlflow: bool = True
    """Also record the run in MLflow: params, metrics, system metrics, and the config and report
    as artifacts; false: the metrics go to `<run_dir>/metrics.jsonl` only."""
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
    the throughput. On a GPU the steps after the window ran slower than without one
    (docs/benchmarks.md); set 0 there for speed."""
    profile_steps: int = Field(2, gt=0)
    """Steps the profiler window records, from profile_step on; as many steps again then count
    the host's reads of tensor values (not under `train.compile`)."""
    log_model: bool = False
    """At the end of the run, log the final model to MLflow as a pyfunc (weights, job file,
    signature and input example from the data; docs/serving.md), from any layout; needs
    `mlflow = true`."""
    registered_model: str = ""
    """Register the logged model under this name in MLflow's Model Registry, as a new version
    tagged with the run's final metrics; needs `log_model = true`."""
    report: bool = True
    """Write the run report (report/report.html and PNGs) at the end of the run, and log it to
    MLflow; `shardwise report RUN_DIR` writes it at any time."""


class FaultSection(Section):
    """What happens when something goes wrong: a hung rank, a dead worker, a straggler, a loss
    or gradient that is NaN or infinite."""

    timeout_s: float = Field(600.0, gt=0, le=86_400)
    """A rank that makes no progress for this long (a hung collective, a stalled rank): every
    rank writes where it is, and the run ends naming the stuck ranks (or restarts, with
    max_restarts)."""
    mode: Literal["restart", "live"] = "restart"
    """What a dead worker costs. `restart`: the whole worker group restarts (up to
    max_restarts times) and resumes from the newest complete checkpoint. `live` (data-parallel
    replicas of one process, an FSDP and tensor-parallel group, or a pipeline each; on one
    machine or several): the other replicas never stop; they do the step again without it, a
    replacement is started and heals from a live replica's memory, and joins
    (docs/fault-tolerance.md, "Live recovery")."""
    max_restarts: int = Field(0, ge=0)
    """When a worker dies (any signal or exception), restart the whole worker group up to this
    many times; every rank resumes from the newest complete checkpoint. In `mode = "live"`: the
    replacements started, in all."""
    min_replicas: int = Field(2, ge=2)
    """In `mode = "live"`: the fewest replicas that commit a step. Below it the replicas left
    wait (up to timeout_s) for replacements before they go on; where none can come (no restart
    left) the run fails, its checkpoints intact. Never one: a lone replica commits nothing."""
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
