"""One optimizer step and one evaluation, for every layout: the only place with forward and
backward. A run's model is a list of parts (one, or one per local pipeline stage), each with its
own optimizer; everything else is the same whatever the layout.

This module must not build anything: `build.build_run` assembles the `Run` it works on.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from shardwise.training import job_names
from shardwise.training.checkpoint.manager import CheckpointManager
from shardwise.training.comm.base import Sync
from shardwise.training.config.derive import Derived
from shardwise.training.config.schema import JobConfig
from shardwise.training.data.sampling import Loader
from shardwise.training.fault.inject import FaultPlan
from shardwise.training.fault.live_replica import LiveReplica
from shardwise.training.parallel import float8
from shardwise.training.parallel.apply import Layout
from shardwise.training.parallel.compilation import ForwardLoss, eager
from shardwise.training.parallel.pipeline import pipeline_forward
from shardwise.training.trainer.flops import Utilisation
from shardwise.training.trainer.nonfinite import NonFiniteGuard
from shardwise.training.trainer.precision import autocast
from shardwise.training.trainer.profile import phase


@dataclass
class Run:
    """The parts of a training run, built once by `build.build_run`."""

    config: JobConfig
    derived: Derived
    device: torch.device
    layout: Layout
    loss_fn: job_names.LossFn
    forward_loss: ForwardLoss
    """One micro-batch's forward and loss (compiled under train.compile: compilation.py)."""
    optimizers: list[torch.optim.Optimizer]
    schedulers: list[torch.optim.lr_scheduler.LambdaLR]
    scaler: torch.amp.GradScaler
    loader: Loader
    eval_data: DataLoader | None
    checkpoints: CheckpointManager
    dp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup | None
    tokens_per_sample: int
    mesh: DeviceMesh
    sync: Sync
    """How the data-parallel ranks agree (comm/): every step, compressed, every H steps, …"""
    rank: int = field(default_factory=dist.get_rank)
    nonfinite: NonFiniteGuard = field(
        default_factory=lambda: NonFiniteGuard(torch.device("cpu"), stop=True)
    )
    """The device-side record of steps not applied for a NaN or infinite gradient norm."""
    faults: FaultPlan = field(default_factory=lambda: FaultPlan([], rank=0, attempt=0))
    """Faults to inject (`SHARDWISE_FAULT`, for tests and drills); none by default."""
    utilisation: Utilisation | str | None = None
    """FLOPs per step and the measured peak, for MFU (trainer/flops.py); or why there is none."""
    notes: list[str] = field(default_factory=list)
    """Lines for the start of the run (what `train.precision = "auto"` chose, and why)."""
    inputs: list[dict[str, Any]] = field(default_factory=list)
    """The streamed tables the run reads, as recorded in MLflow (`Tracker.log_input`)."""
    live: LiveReplica | None = None
    """In live recovery (`fault.mode = "live"`), this process's replica: it sums the replicas'
    gradients (fault/live_replica.py); None otherwise."""
    _params: list[nn.Parameter] | None = field(default=None, init=False, repr=False)
    _norm_plan: NormPlan | None = field(default=None, init=False, repr=False)

    @property
    def parts(self) -> list[nn.Module]:
        return self.layout.parts

    def parameters(self) -> list[nn.Parameter]:
        """Every parameter of the run's parts, listed once: a layout never replaces them (a
        checkpoint loads into them), and walking the modules each step costs the host more than
        some of a small model's kernels."""
        if self._params is None:
            self._params = [p for part in self.parts for p in part.parameters()]
        return self._params

    def norm_plan(self) -> NormPlan:
        """How the gradient norm is taken over this run's parameters (computed once)."""
        if self._norm_plan is None:
            pipe = self.layout.pipeline
            copies = pipe.ties.not_in_norm() if pipe is not None else set()
            self._norm_plan = NormPlan.of(self.parameters(), copies)
        return self._norm_plan


class Stepped(NamedTuple):
    """What one optimizer step returns, without waiting for the device."""

    loss: torch.Tensor
    """This rank's mean loss (zero on pipeline ranks without the last stage)."""
    grad_norm: torch.Tensor | None
    """The global gradient norm before clipping (None when neither clipping nor the non-finite
    check needs it)."""
    skipped: torch.Tensor | None
    """Whether the update was skipped, 1.0 or 0.0 on the device (trainer/nonfinite.py): it is
    when the gradient norm is NaN or infinite (the same verdict on every rank, as the norm is
    global). With fp16 the gradient scaler makes that call itself, and this is None."""
    forward_seconds: float
    """Time in forward passes outside a pipeline (this rank's own work, for stragglers)."""
    taken: bool = False
    """Live recovery: the step's outcome was received from the replica's peers, its schedules
    already moved (fault/live_replica.StepTaken)."""


def train_step(run: Run, micro_batches: list[Any], *, step: int = 0) -> Stepped:
    """One optimizer step over this rank's micro-batches, with no wait for the device."""
    pipe = run.layout.pipeline
    forward_seconds = 0.0
    with phase("forward_backward"):
        if pipe is not None:
            loss = _pipeline_forward_backward(run, micro_batches)
            pipe.ties.sum_gradients()  # copies of one parameter on several stages
        else:  # forward and backward, one micro-batch at a time
            (model,) = run.parts
            count, losses = len(micro_batches), []
            sizes = [len(mb[1]) for mb in micro_batches]
            shares = (run.live.shares(sizes) if run.live is not None else None) or _shares(sizes)
            for i, (inputs, target) in enumerate(micro_batches):
                with run.sync.micro_batch(model, last=i == count - 1, step=step):
                    loss, seconds = _loss(run, inputs, target, shares[i] if shares else count)
                    forward_seconds += seconds
                    run.scaler.scale(loss).backward()
                losses.append(loss.detach())
            loss = losses[0] if count == 1 else torch.stack(losses).sum()
    if run.live is not None:  # the replicas' gradients summed (StepAgain: a replica died)
        with phase("live_reduce"):
            loss = run.live.reduce(loss)
    if run.faults.faults:
        run.faults.corrupt_gradients(step, run.parameters())
    if run.scaler.is_enabled():
        for optimizer in run.optimizers:
            run.scaler.unscale_(optimizer)
    grad_norm, skip = None, None
    check = run.config.train.precision != "fp16"
    if run.config.train.grad_clip > 0 or check:
        limit = run.config.train.grad_clip or math.inf
        with phase("grad_norm"):
            grad_norm = clip_grad_norm(run.norm_plan(), limit, run.pp_group)
    if check and grad_norm is not None:
        with phase("nonfinite"):
            skip = run.nonfinite.verdict(grad_norm, loss, step)
    with phase("optimizer"):
        _update(run, step, skip)
    return Stepped(loss, grad_norm, skip, forward_seconds)


def _update(run: Run, step: int, skip: torch.Tensor | None) -> None:
    """The optimizer step (unless `skip` says so, on the device), and what follows it."""
    run.sync.apply(run.optimizers, run.scaler, step, skip=skip)
    for optimizer in run.optimizers:
        optimizer.zero_grad(set_to_none=True)
    if run.config.train.float8_all_gather:  # the float8 weights' scales, in one all-reduce
        float8.after_optimizer_step(run.parts)


def _loss(run: Run, inputs: Any, target: Any, count: int | float) -> tuple[torch.Tensor, float]:
    """One micro-batch's forward and loss, its share of the rank's mean (1/`count` of it for
    one of `count` equal micro-batches; a float `count`: the micro-batch's share of the rank's
    samples), and the seconds the forward took (the straggler check counts them)."""
    inputs, target = to_device(inputs, run.device), to_device(target, run.device)
    began = time.perf_counter()
    with autocast(run.config.train.precision, run.device):
        loss = run.forward_loss(inputs, target)
        if isinstance(count, float):
            loss = loss * count
        elif count > 1:  # the mean over the rank's batch: each micro-batch's share
            loss = loss / count
    return loss, time.perf_counter() - began


def _shares(sizes: list[int]) -> list[float] | None:
    """Each micro-batch's share of the rank's samples where they differ in size (the last
    may be smaller); None where they are equal (each 1/count)."""
    if len(set(sizes)) <= 1:
        return None
    return [size / sum(sizes) for size in sizes]


def _pipeline_forward_backward(run: Run, micro_batches: list[Any]) -> torch.Tensor:
    """The schedule splits the rank's batch back into the same micro-batches, runs them through
    the stages and accumulates their gradients (divided by their number: `scale_grads`)."""
    pipe = run.layout.pipeline
    assert pipe is not None
    assert pipe.schedule is not None
    inputs = to_device(torch.cat([mb[0] for mb in micro_batches]), run.device)
    target = to_device(torch.cat([mb[1] for mb in micro_batches]), run.device)
    losses: list[torch.Tensor] = []
    args = (inputs,) if pipe.has_first else ()
    kwargs: dict[str, Any] = {"target": target, "losses": losses} if pipe.has_last else {}
    with autocast(run.config.train.precision, run.device):
        pipe.schedule.step(*args, **kwargs)
    if not losses:
        return torch.zeros((), device=run.device)
    return torch.stack(losses).mean().detach()


@dataclass(frozen=True)
class NormPlan:
    """The parameters in groups whose gradients' norms are taken together: plain tensors, and
    DTensors by mesh and placement (each group's norm reduced over its mesh); `counted` leaves
    out a tied weight's copies on other pipeline stages (clipped but not counted)."""

    groups: list[list[nn.Parameter]]
    counted: list[list[nn.Parameter]]

    @staticmethod
    def of(params: list[nn.Parameter], copies: set[int] | frozenset[int]) -> NormPlan:
        groups: dict[Any, list[nn.Parameter]] = defaultdict(list)
        counted: dict[Any, list[nn.Parameter]] = defaultdict(list)
        for p in params:
            key = (p.device_mesh, p.placements) if isinstance(p, DTensor) else None
            groups[key].append(p)
            if id(p) not in copies:
                counted[key].append(p)
        return NormPlan(list(groups.values()), [g for g in counted.values() if g])


def clip_grad_norm(
    plan: NormPlan, max_norm: float, pp_group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Clip the gradient norm of the whole model, whatever holds it: sharded gradients (DTensors,
    each group's norm reduced over its mesh), plain ones, and the other pipeline stages' (their
    squared norms summed over the `pp` axis). With plain gradients on one stage this launches
    what torch.nn.utils.clip_grad_norm_ does."""
    norms = []
    for params in plan.counted:
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            norm = torch.nn.utils.get_total_norm(grads)
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if len(norms) == 1:
        total = norms[0]
    else:  # several groups, or none (a stage whose only parameters are others' copies)
        total = torch.stack(norms).norm() if norms else torch.zeros((), device=_device(plan))
    if pp_group is not None:
        squared = total.square()
        dist.all_reduce(squared, group=pp_group)
        total = squared.sqrt()
    if math.isinf(max_norm):  # the norm was wanted, not clipping
        return total
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    grads = [p.grad for group in plan.groups for p in group if p.grad is not None]
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    with torch.no_grad():
        torch._foreach_mul_(local, coef)
    return total


def _device(plan: NormPlan) -> torch.device:
    first = next((p for params in plan.groups for p in params), None)
    return first.device if first is not None else torch.device("cpu")


@torch.no_grad()
def evaluate(run: Run) -> dict[str, float]:
    """Held-out loss (and accuracy for classification), exact over the whole split: each rank sums
    loss × targets, correct predictions and counts; the sums are added across ranks. Under
    train.compile it runs eagerly: compiling it would compile the model again in eval mode."""
    assert run.eval_data is not None
    with eager() if run.layout.compiled else contextlib.nullcontext():
        return _evaluate(run)


def _evaluate(run: Run) -> dict[str, float]:
    assert run.eval_data is not None
    first_replicas_buffers(run)
    for part in run.parts:
        part.eval()
    # [loss sum, correct, target count, targets where accuracy applies]
    sums = torch.zeros(4, dtype=torch.float64, device=run.device)
    for inputs, target in run.eval_data:
        inputs, target = to_device(inputs, run.device), to_device(target, run.device)
        with autocast(run.config.train.precision, run.device):
            outputs = _forward(run, inputs)
        if outputs is not None:  # else a pipeline rank without the last stage
            sums += batch_sums(run.loss_fn, outputs, target)
    if run.pp_group is not None:
        dist.all_reduce(sums, group=run.pp_group)  # only the last stage's ranks counted
    dist.all_reduce(sums, group=run.dp_group)
    for part in run.parts:
        part.train()
    result = {"eval/loss": (sums[0] / sums[2].clamp(min=1)).item()}
    if sums[3] > 0:
        result["eval/accuracy"] = (sums[1] / sums[3]).item()
    return result


def first_replicas_buffers(run: Run) -> None:
    """Give every data-parallel replica the first replica's buffers (a batch norm's running
    statistics), as DDP does before every forward: FSDP, its replicate mode and the replicas of
    a `train.sync` other than every step leave each replica its own, updated by its own
    samples, while a checkpoint and its export hold the first replica's. Evaluated with them,
    the run gives the loss its export gives. Training normalises with each batch's own
    statistics, so it is not changed."""
    if run.layout.wrapper == "ddp" or run.derived.dp == 1:
        return
    first = dist.get_global_rank(run.dp_group, 0)
    for part in run.parts:
        for buffer in part.buffers():
            local = buffer.to_local() if isinstance(buffer, DTensor) else buffer
            dist.broadcast(local, src=first, group=run.dp_group)


IGNORE_INDEX = -100
"""A class target that counts for nothing: torch's cross-entropy default, and what transformers
puts at the positions a masked or padded language model does not predict."""


def batch_sums(loss_fn: job_names.LossFn, outputs: Any, target: torch.Tensor) -> torch.Tensor:
    """One evaluation batch's [loss × targets, correct, targets, targets where accuracy
    applies], without waiting for the device. A class target (integers, one class dimension
    fewer than the outputs) of -100 is no target: the loss
    (a mean over the others) is weighted by the others' count and accuracy is taken over them
    (a batch with none adds nothing)."""
    sums = torch.zeros(4, dtype=torch.float64, device=target.device)
    logits = job_names.model_output(outputs)
    classes = not target.is_floating_point() and logits.dim() == target.dim() + 1
    counted = target != IGNORE_INDEX if classes else None
    count = target.numel() if counted is None else counted.sum()
    loss = loss_fn(outputs, target).double()
    sums[0] = torch.where(torch.as_tensor(count > 0), loss * count, 0.0)
    sums[2] = count
    if counted is not None:
        sums[1] = ((logits.argmax(-1) == target) & counted).sum()
        sums[3] = count
    return sums


def _forward(run: Run, inputs: Any) -> Any:
    if run.layout.pipeline is not None:
        return pipeline_forward(run.layout.pipeline, inputs)
    (model,) = run.parts
    return model(inputs)


def mean_loss(run: Run, losses: list[torch.Tensor], skipped: list[torch.Tensor]) -> float:
    """The mean training loss over these steps and over data-parallel ranks (from the last
    pipeline stage, the only one that computes it). Where the steps were checked (`skipped`,
    one verdict per step), over the applied ones only, as a skipped step's loss may not be
    finite: NaN when none was applied. A live replica's is the whole batch's already (every
    stage of every replica holds it: fault/live_replica.py)."""
    loss = torch.stack(losses)
    if skipped:
        loss = torch.where(torch.stack(skipped) == 0, loss, torch.nan).nanmean()
    loss = loss.mean()
    if run.live is not None:  # every process of every replica holds the whole batch's already
        return float(loss.item())
    if run.pp_group is not None:
        dist.all_reduce(loss, group=run.pp_group)
    if run.derived.dp > 1:
        dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=run.dp_group)
    return float(loss.item())


def to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, tuple | list):
        return type(value)(to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    return value
