"""Building a run on this rank: the model and its layout (on the meta device where it can be),
the data, optimizers, schedules, communication, checkpoints and precision; everything `train_step`
works on, assembled once into a `Run`."""

from __future__ import annotations

import copy
import socket
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwise.common.errors import ConfigError
from shardwise.training import builders
from shardwise.training.checkpoint.export import load_weights
from shardwise.training.checkpoint.layout import name_of, read_manifest
from shardwise.training.checkpoint.manager import (
    CheckpointManager,
    asynchronous_by_default,
)
from shardwise.training.comm import choose as comm
from shardwise.training.config.derive import Derived, derive, resolved
from shardwise.training.config.schema import JobConfig
from shardwise.training.data.sampling import GlobalBatchSampler, StepLoader, eval_loader
from shardwise.training.parallel import compile
from shardwise.training.parallel.apply import Layout, parallelize, unwrap
from shardwise.training.parallel.init import initializer, materialize, supports_meta_init
from shardwise.training.parallel.mesh import build_mesh, dp_group, dp_position, pp_group
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
    chosen = _precision(config.train.precision, device, resume)
    config = with_precision(resolved(config, derived), chosen.name)
    mesh = build_mesh(derived.degrees, device.type)
    dp_rank, dp_size = dp_position(mesh)
    train_set, held_out = builders.build_datasets(config)
    loss_fn = builders.build_loss(config)
    layout = build_layout(config, derived, mesh, device, sample=train_set[0])
    builtin = config.train.loss in builders.LOSSES
    if layout.compiled:
        one_graph = layout.wrapper == "none"
        layout.applied.append(
            compile.describe_loss(
                config.train.loss, compiled=layout.compiled, one_graph=one_graph, builtin=builtin
            )
        )
    utilisation = _utilisation(config, derived, layout, loss_fn, train_set, device)
    config, saving = _checkpoint_mode(config, layout, device)
    if layout.pipeline is not None:
        stage_loss = compile.compiled_loss(loss_fn, builtin=builtin and bool(layout.compiled))
        layout.pipeline.start(stage_loss, device)
    # Each data-parallel rank its own dropout stream; tensor-parallel and pipeline peers share it.
    train_state.reseed(config.job.seed, 0, dp_rank)
    sampler = GlobalBatchSampler(
        _num_samples(train_set),
        global_batch=derived.global_batch,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=config.job.seed,
    )
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
        forward_loss=compile.forward_loss(
            layout.parts[0], loss_fn, compiled=layout.compiled, builtin=builtin
        ),
        optimizers=optimizers,
        schedulers=schedulers,
        scaler=grad_scaler(config.train.precision, device),
        loader=StepLoader(
            train_set,
            sampler,
            micro_batch=derived.micro_batch,
            num_workers=config.data.num_workers,
            pin_memory=device.type == "cuda",
        ),
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
        notes=chosen.notes + saving,
    )


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
    loss_fn: builders.LossFn,
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
        lambda: builders.build_model(config),
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
) -> Layout:
    """Build the model (on the meta device when it supports it) and apply the layout; with
    `materialize_weights` false (a dry run) the parameters stay on meta."""
    with torch.device("meta"):
        model = builders.build_model(config)
    use_meta = config.model.init == "meta" or (
        config.model.init == "auto" and initializer(model) is not None
    )
    if use_meta and not supports_meta_init(model):
        raise ConfigError(
            "model.init = 'meta' but some module has no reset_parameters() and the model no "
            "init_weights(module); set model.init = 'full'"
        )
    template = copy.deepcopy(model)
    if not use_meta and materialize_weights:
        torch.manual_seed(config.job.seed)  # identical initial weights on every rank
        model = builders.build_model(config)

    def init(parts: list[nn.Module]) -> None:
        if use_meta:
            materialize(parts, template, seed=config.job.seed, device=device)
        else:
            for part in parts:
                part.to(device)
        if config.model.init_from:
            load_weights(parts, config.model.init_from)

    costs = None
    if derived.degrees["pp"] > 1 and config.parallel.pipeline_balance == "cost":
        costs = measure_block_costs(
            template, config.job.seed, sample, micro_batch=derived.micro_batch
        )
    tp_plan = (
        builders.resolve(config.parallel.tp_plan, {}, "parallel.tp_plan")
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
        compile=config.train.compile,
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
