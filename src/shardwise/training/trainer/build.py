"""Building a run on this rank: the model and its layout (on the meta device where it can be),
the data, optimizers, schedules, communication, checkpoints and precision; everything `train_step`
works on, assembled once into a `Run`."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset, IterableDataset

from shardwise.common.errors import ConfigError
from shardwise.training import job_names
from shardwise.training.checkpoint.disk_layout import name_of, read_manifest
from shardwise.training.checkpoint.export import load_weights
from shardwise.training.checkpoint.manager import (
    CheckpointManager,
    asynchronous_by_default,
)
from shardwise.training.comm import choose as comm
from shardwise.training.config.derive import Derived, config_as_saved, derive
from shardwise.training.config.schema import JobConfig
from shardwise.training.data import iterable
from shardwise.training.data.iterable import IterableLoader
from shardwise.training.data.sampling import GlobalBatchSampler, Loader, StepLoader, eval_loader
from shardwise.training.data.stream.loader import StreamLoader
from shardwise.training.data.stream.source import (
    READ_ERRORS,
    Snapshot,
    data_problem,
)
from shardwise.training.data.stream.table import Stream, TableSource
from shardwise.training.parallel import compilation, float8
from shardwise.training.parallel.apply import Layout, parallelize, unwrap
from shardwise.training.parallel.mesh import build_mesh, dp_group, dp_position, pp_group
from shardwise.training.parallel.meta_init import initializer, materialize, supports_meta_init
from shardwise.training.parallel.pipeline import example_batch, measure_block_costs
from shardwise.training.trainer import flops, precision
from shardwise.training.trainer import state as train_state
from shardwise.training.trainer.memory import state_bytes
from shardwise.training.trainer.nonfinite import NonFiniteGuard
from shardwise.training.trainer.optim import build_optimizer, build_scheduler, states_per_param
from shardwise.training.trainer.precision import DTYPES, grad_scaler
from shardwise.training.trainer.step import Run


def build_run(
    config: JobConfig, device: torch.device, *, node: int = 0, resume: str | None = None
) -> Run:
    """Every part of the run, built on this rank (`resume`: the checkpoint it will continue
    from, whose precision `train.precision = "auto"` keeps)."""
    derived = derive(config, dist.get_world_size())
    if config.train.float8 != "off":
        float8.check_device(device, emulate=config.train.float8_emulate)
    chosen = _precision(config.train.precision, device, resume)
    config = with_precision(config_as_saved(config, derived), chosen.name)
    mesh = build_mesh(derived.degrees, device.type)
    dp_rank, dp_size = dp_position(mesh)
    data = open_data(config, derived, dp_rank, dp_size)
    config, train_set, held_out = data.config, data.samples, data.held_out
    loss_fn = job_names.build_loss(config)
    layout = build_layout(
        config, derived, mesh, device, sample=train_set[0], loading=resume is not None
    )
    if config.train.float8_all_gather and device.type == "cpu":
        float8.check_gloo_units(layout.parts)
    builtin = config.train.loss in job_names.LOSSES
    if layout.compiled:
        one_graph = layout.wrapper == "none"
        layout.applied.append(
            compilation.describe_loss(
                config.train.loss, compiled=layout.compiled, one_graph=one_graph, builtin=builtin
            )
        )
    utilisation = _utilisation(config, derived, layout, loss_fn, train_set, device)
    config, saving = _checkpoint_mode(config, layout, device)
    if layout.pipeline is not None:
        stage_loss = compilation.compiled_loss(
            loss_fn, builtin=builtin and bool(layout.compiled), backend=layout.backend
        )
        layout.pipeline.start(stage_loss, device)
    # Each data-parallel rank its own dropout stream; tensor-parallel and pipeline peers share it.
    train_state.reseed(config.job.seed, 0, dp_rank)
    optimizers = [build_optimizer(part, config.train, lr=derived.lr) for part in layout.parts]
    schedulers = [build_scheduler(o, config.train) for o in optimizers]
    config.run_dir.mkdir(parents=True, exist_ok=True)
    sync = comm.build(
        config,
        layout.parts,
        optimizers,
        schedulers,
        dp_group(mesh),
        wrapper=layout.wrapper,
        node=node,
    )
    return Run(
        config=config,
        derived=derived,
        device=device,
        layout=layout,
        loss_fn=loss_fn,
        forward_loss=compilation.forward_loss(
            layout.parts[0],
            loss_fn,
            compiled=layout.compiled,
            builtin=builtin,
            backend=layout.backend,
        ),
        optimizers=optimizers,
        schedulers=schedulers,
        scaler=grad_scaler(config.train.precision, device),
        loader=data.loader(derived, dp_rank, dp_size, pin_memory=device.type == "cuda"),
        eval_data=None
        if held_out is None
        else eval_loader(
            held_out,
            dp_rank=dp_rank,
            dp_size=dp_size,
            batch=derived.eval_batch,
            max_samples=config.eval.max_samples,
        ),
        checkpoints=CheckpointManager(
            config.checkpoint_dir,
            keep_last=config.checkpoint.keep_last,
            asynchronous=config.checkpoint.async_save is True,
        ),
        dp_group=dp_group(mesh),
        pp_group=pp_group(mesh),
        tokens_per_sample=tokens_per_sample_of(train_set[0]),
        mesh=mesh,
        sync=sync,
        nonfinite=NonFiniteGuard(device, stop=config.fault.on_nonfinite == "stop"),
        utilisation=utilisation,
        notes=chosen.notes + saving + data.notes,
        inputs=data.inputs,
    )


@dataclass
class RunData:
    """The run's training data (map-style, or a streamed table), its held-out split, and items
    to shape the model by."""

    config: JobConfig
    """The config, a streamed table's version pinned in `data.args`."""
    train: Any
    held_out: Dataset | None
    samples: Any
    """Indexable items `(inputs, target)`: the training set, or a streamed table's first rows."""
    stream: Stream | None = None
    notes: list[str] = field(default_factory=list)
    inputs: list[dict[str, Any]] = field(default_factory=list)
    """What MLflow records of each streamed table (`Tracker.log_input`)."""

    def loader(self, derived: Derived, dp_rank: int, dp_size: int, *, pin_memory: bool) -> Loader:
        config = self.config
        if isinstance(self.train, IterableDataset):
            return IterableLoader(
                self.train,
                micro_batch=derived.micro_batch,
                per_rank=derived.global_batch // dp_size,
                num_workers=config.data.num_workers,
                dp_rank=dp_rank,
                pin_memory=pin_memory,
            )
        if self.stream is not None:
            return StreamLoader(
                self.stream,
                global_batch=derived.global_batch,
                micro_batch=derived.micro_batch,
                dp_rank=dp_rank,
                dp_size=dp_size,
                seed=config.job.seed,
                pin_memory=pin_memory,
                allow_changed=config.data.allow_changed,
            )
        sampler = GlobalBatchSampler(
            _num_samples(self.train),
            global_batch=derived.global_batch,
            dp_rank=dp_rank,
            dp_size=dp_size,
            seed=config.job.seed,
        )
        return StepLoader(
            self.train,
            sampler,
            micro_batch=derived.micro_batch,
            num_workers=config.data.num_workers,
            pin_memory=pin_memory,
        )


def open_data(
    config: JobConfig,
    derived: Derived,
    dp_rank: int = 0,
    dp_size: int = 1,
    *,
    held_out_too: bool = True,
) -> RunData:
    """The job's datasets; a streamed table listed and pinned by rank 0 for every rank (so all
    read one version, even while someone writes the table), its held-out split read into
    memory (unless not `held_out_too`: a dry run shapes the model only); a user's
    IterableDataset given this rank's data-parallel position (data/iterable.py)."""
    train, held_out = job_names.build_datasets(config, dp_rank=dp_rank, dp_size=dp_size)
    if isinstance(train, IterableDataset):
        notes = []
        if not job_names.takes_position(config):
            notes.append(
                "data: the IterableDataset's builder takes no dp_rank/dp_size, so every "
                "data-parallel rank reads the same samples"
            )
        if not iterable.stateful(train):
            notes.append(
                "data: the IterableDataset has no state_dict/load_state_dict: a resumed run "
                "restarts it from its beginning"
            )
        samples = iterable.head(train, derived.micro_batch)
        return RunData(config, train, held_out, samples=samples, notes=notes)
    if not isinstance(train, TableSource):
        return RunData(config, train, held_out, samples=train)
    snapshot = _shared_snapshot(train)
    stream = train.open(snapshot)
    args = {**config.data.args, **train.pin(snapshot)}
    pinned = {k: v for k, v in args.items() if v is not None}
    config = config.model_copy(update={"data": config.data.model_copy(update={"args": pinned})})
    held = None
    inputs = [_input(config, stream, "training")]
    if isinstance(held_out, TableSource) and held_out_too:
        opened = held_out.open(_shared_snapshot(held_out))
        held = opened.materialize(config.eval.max_samples)
        inputs.append(_input(config, opened, "evaluation"))
    head = stream.head(derived.micro_batch)
    dropped = snapshot.rows % derived.global_batch
    note = (
        f"data: {snapshot.describe()}; an epoch is {snapshot.rows // derived.global_batch:,} "
        f"steps of {derived.global_batch}, leaving out {dropped:,} rows (a different few each "
        "epoch)"
    )
    return RunData(config, None, held, samples=head, stream=stream, notes=[note], inputs=inputs)


def _input(config: JobConfig, stream: Stream, context: str) -> dict[str, Any]:
    snapshot = stream.snapshot
    return {
        "name": f"{config.job.name}-{context}",
        "kind": snapshot.kind,
        "where": snapshot.where,
        "version": snapshot.version,
        "columns": stream.source.columns.read,
        "rows": snapshot.rows,
        "files": len(snapshot.files),
        "context": context,
    }


def _shared_snapshot(source: TableSource) -> Snapshot:
    """The snapshot rank 0 resolves, sent to every rank (an error, too, as one line)."""
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = source.listed()
        except READ_ERRORS as e:
            box[0] = data_problem(e)
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], str):
        raise ConfigError(box[0])
    snapshot: Snapshot = box[0]
    return snapshot


def _precision(asked: str, device: torch.device, resume: str | None) -> precision.Chosen:
    """What the run trains in: `auto` resolved on this device, or, resuming, as the checkpoint
    was trained (a resumed run continues exactly, whatever a probe says today)."""
    saved = read_manifest(resume).get("precision") if asked == "auto" and resume else None
    if saved in ("fp32", "bf16", "fp16"):
        note = f"train.precision = 'auto': {saved}, as {name_of(resume or '')} was trained"
        return precision.Chosen(saved, [note])
    return precision.choose(asked, device)


def with_precision(config: JobConfig, name: str) -> JobConfig:
    """The config with `train.precision` as this device resolved it (`auto`), as it is saved."""
    return config.model_copy(update={"train": config.train.model_copy(update={"precision": name})})


def _checkpoint_mode(
    config: JobConfig, layout: Layout, device: torch.device
) -> tuple[JobConfig, list[str]]:
    """The config with `checkpoint.async` resolved (`auto`: checkpoint/manager.py), the same on
    every rank, and what to say about it."""
    asked = config.checkpoint.async_save
    hosts: list[Any] = []
    if asked == "auto" and device.type == "cuda":
        per_param = states_per_param(config.train)
        held = state_bytes(layout.parts, optimizer_states_per_param=per_param)
        mine = (socket.gethostname(), held["params"] + held["optimizer"], _free_memory())
        hosts = [None] * dist.get_world_size()
        dist.all_gather_object(hosts, mine)
    asynchronous, note = asynchronous_by_default(asked, cuda=device.type == "cuda", hosts=hosts)
    update = {"checkpoint": config.checkpoint.model_copy(update={"async_save": asynchronous})}
    return config.model_copy(update=update), [note] if note else []


def _free_memory() -> int:
    import psutil

    return int(psutil.virtual_memory().available)


def _utilisation(
    config: JobConfig,
    derived: Derived,
    layout: Layout,
    loss_fn: job_names.LossFn,
    train_set: Any,
    device: torch.device,
) -> flops.Utilisation | str:
    """FLOPs per step (on the meta device, or on one real micro-batch through this rank's model
    where the model cannot run there and the layout splits no layer nor stage) and the peak."""

    def real() -> float | str:
        if layout.pipeline is not None or derived.degrees["tp"] > 1:
            return "a real micro-batch is counted without tensor or pipeline parallelism only"
        return flops.count_real(
            unwrap(layout.parts[0]),
            loss_fn,
            train_set,
            micro_batch=derived.micro_batch,
            device=device,
            precision=config.train.precision,
        )

    dtype = DTYPES.get(config.train.precision, torch.float32)
    return flops.for_run(
        lambda: job_names.build_model(config),
        loss_fn,
        train_set[0],
        micro_batch=derived.micro_batch,
        global_batch=derived.global_batch,
        peak=lambda: flops.measure_peak(device, dtype),
        real=real,
    )


def build_layout(
    config: JobConfig,
    derived: Derived,
    mesh: Any,
    device: torch.device,
    *,
    sample: Any,
    materialize_weights: bool = True,
    loading: bool = False,
) -> Layout:
    """Build the model (on the meta device when it supports it) and apply the layout; with
    `materialize_weights` false (a dry run) the parameters stay on meta; `loading`: the run's
    weights are loaded from a checkpoint next (a resumed run)."""
    with torch.device("meta"):
        model = job_names.build_model(config)
    use_meta = config.model.init == "meta" or (
        config.model.init == "auto" and initializer(model) is not None
    )
    if use_meta and not supports_meta_init(model):
        raise ConfigError(
            "model.init = 'meta' but some module has no reset_parameters() and the model no "
            "init_weights(module); set model.init = 'full'"
        )
    by_cost = derived.degrees["pp"] > 1 and config.parallel.pipeline_balance == "cost"
    # where the initial values come from: its parameters' initialisers, its buffers' values
    template = job_names.build_with_meta_parameters(config) if use_meta or by_cost else None
    if not use_meta and materialize_weights:
        torch.manual_seed(config.job.seed)  # identical initial weights on every rank
        model = job_names.build_model(config)

    def init(parts: list[nn.Module]) -> None:
        if template is not None and use_meta:  # strict unless weights are loaded next
            strict = not (loading or config.model.init_from)
            materialize(parts, template, seed=config.job.seed, device=device, strict=strict)
        else:
            for part in parts:
                part.to(device)
        if config.model.init_from:
            load_weights(parts, config.model.init_from)

    costs = None
    if template is not None and by_cost:
        costs = measure_block_costs(
            template, config.job.seed, sample, micro_batch=derived.micro_batch
        )
    tp_plan = (
        job_names.resolve(config.parallel.tp_plan, {}, "parallel.tp_plan")
        if config.parallel.tp_plan
        else None
    )
    example = None
    if derived.degrees["pp"] > 1:  # what a pipeline traces a model that is not a sequence with
        where = next(model.parameters(), torch.empty(0, device="meta")).device
        example = example_batch(sample, derived.micro_batch, where)
    return parallelize(
        model,
        mesh,
        derived,
        config.parallel,
        device=device,
        init=init if materialize_weights else None,
        tp_plan=tp_plan,
        param_dtype=DTYPES.get(config.train.precision),
        block_costs=costs,
        example=example,
        every_step=config.train.sync == "every_step",
        compile=config.train.compile_backend if config.train.compile else None,
        float8=float8.Float8.of(config.train),
    )


def _num_samples(dataset: Any) -> int:
    if not hasattr(dataset, "__len__"):
        raise ConfigError(
            f"the training dataset ({type(dataset).__name__}) has no length; the data builder "
            "must return map-style datasets (with __len__ and __getitem__)"
        )
    return len(dataset)


def tokens_per_sample_of(item: Any) -> int:
    target = item[1] if isinstance(item, tuple | list) and len(item) == 2 else None
    return int(target.numel()) if isinstance(target, torch.Tensor) else 1
