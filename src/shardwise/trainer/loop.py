"""The training loop every rank runs: build the run, restore it, step, evaluate, checkpoint, report.

`train` reads top to bottom; `train_step` is the one place with forward and backward. This
module expects the process group to exist already (launch/ starts it) and must not read launcher
environment variables.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import tomli_w
import torch
import torch.distributed as dist
from rich.console import Console
from torch import nn
from torch.utils.data import DataLoader

from shardwise import builders
from shardwise.checkpoint.layout import read_manifest
from shardwise.checkpoint.manager import CheckpointManager
from shardwise.config import ConfigError, Derived, JobConfig, derive, flatten, resolved
from shardwise.parallel.apply import gradient_sync, parallelize
from shardwise.parallel.mesh import build_mesh, dp_group, dp_position
from shardwise.tracking.metrics import JsonlTracker, Tracker, Trackers
from shardwise.tracking.mlflow import MlflowTracker
from shardwise.tracking.progress import ProgressDisplay
from shardwise.trainer import state as train_state
from shardwise.trainer.data import GlobalBatchSampler, StepLoader, eval_loader
from shardwise.trainer.optim import build_optimizer, build_scheduler
from shardwise.trainer.precision import autocast, grad_scaler


@dataclass
class TrainSummary:
    """What `shardwise.train` returns (from rank 0)."""

    step: int
    metrics: dict[str, float]
    checkpoint: str | None
    run_dir: str
    mlflow_run_id: str | None
    samples_per_second: float
    resumed_from: int | None = None


@dataclass
class Run:
    """The parts of a training run, built once by `build_run`."""

    config: JobConfig
    derived: Derived
    device: torch.device
    model: nn.Module
    loss_fn: builders.LossFn
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler
    loader: StepLoader
    eval_data: DataLoader | None
    checkpoints: CheckpointManager
    dp_group: dist.ProcessGroup
    tokens_per_sample: int
    rank: int = field(default_factory=dist.get_rank)


def train(config: JobConfig, *, device: torch.device, resume: str | None) -> TrainSummary | None:
    """Train to `train.steps`, resuming from the checkpoint at `resume` if given."""
    run = build_run(config, device)
    start = restore(run, Path(resume)) if resume else 0
    tracker, display = start_reporting(run, start, resumed=resume is not None)
    status, summary = "FAILED", None
    try:
        summary = loop(run, start, tracker, display, resumed_from=Path(resume) if resume else None)
        status = "FINISHED"
    finally:
        if display is not None:
            display.close()
        if tracker is not None:
            tracker.close(status)
    if summary is not None and run.rank == 0:
        summary.mlflow_run_id = _mlflow_run_id(tracker)
        summary.resumed_from = start if resume else None
        (config.run_dir / "summary.json").write_text(_json(asdict(summary)))
    return summary if run.rank == 0 else None


def build_run(config: JobConfig, device: torch.device) -> Run:
    derived = derive(config, dist.get_world_size())
    config = resolved(config, derived)
    mesh = build_mesh(derived.degrees, device.type)
    dp_rank, dp_size = dp_position(mesh)
    torch.manual_seed(config.job.seed)  # identical initial weights on every rank
    model = parallelize(builders.build_model(config), mesh, derived.degrees, device=device)
    train_set, held_out = builders.build_datasets(config)
    train_state.reseed(config.job.seed, 0, dp_rank)  # each rank its own dropout stream
    sampler = GlobalBatchSampler(
        _num_samples(train_set),
        global_batch=derived.global_batch,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=config.job.seed,
    )
    optimizer = build_optimizer(model, config.train, lr=derived.lr)
    return Run(
        config=config,
        derived=derived,
        device=device,
        model=model,
        loss_fn=builders.build_loss(config),
        optimizer=optimizer,
        scheduler=build_scheduler(optimizer, config.train),
        scaler=grad_scaler(config.train.precision, device),
        loader=StepLoader(
            train_set, sampler, micro_batch=derived.micro_batch, num_workers=config.data.num_workers
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
        checkpoints=CheckpointManager(config.checkpoint_dir, keep_last=config.checkpoint.keep_last),
        dp_group=dp_group(mesh),
        tokens_per_sample=_tokens_per_sample(train_set[0]),
    )


def loop(
    run: Run,
    start: int,
    tracker: Tracker | None,
    display: ProgressDisplay | None,
    *,
    resumed_from: Path | None,
) -> TrainSummary:
    cfg = run.config
    steps, log_every = cfg.train.steps, cfg.tracking.log_every
    metrics: dict[str, float] = {}
    losses: list[torch.Tensor] = []
    clock, rates, checkpoint = time.perf_counter(), [], resumed_from
    if start >= steps and display is not None:
        display.print(
            f"the checkpoint is at step {start} of {steps}: nothing left to train "
            "(raise train.steps to train further)"
        )
    if start >= steps and run.eval_data is not None:
        metrics.update(evaluate(run))
    run.model.train()
    for step in range(start + 1, steps + 1):
        loss, grad_norm = train_step(run, run.loader.next_step())
        run.scheduler.step()
        losses.append(loss)
        if step % log_every == 0 or step == steps:
            elapsed = time.perf_counter() - clock
            stats = _train_stats(run, losses, grad_norm, elapsed)
            rates.append(stats["samples/s"])
            metrics.update(stats)
            losses, clock = [], time.perf_counter()
            _report(tracker, display, stats, step)
        # Evaluation and checkpoint time is moved out of the throughput window (clock += ...).
        if _due(step, cfg.eval.every_steps, steps) and run.eval_data is not None:
            began = time.perf_counter()
            evaluation = evaluate(run)
            clock += time.perf_counter() - began
            metrics.update(evaluation)
            _report(tracker, None, evaluation, step)
            if display is not None:
                display.report(step, evaluation)
        if _due(step, cfg.checkpoint.every_steps, steps):
            began = time.perf_counter()
            checkpoint = save(run, step)
            clock += time.perf_counter() - began
            _report(tracker, None, {"checkpoint/save_s": time.perf_counter() - began}, step)
    return TrainSummary(
        step=steps,
        metrics=metrics,
        checkpoint=str(checkpoint) if checkpoint else None,
        run_dir=str(cfg.run_dir),
        mlflow_run_id=None,
        samples_per_second=_median(rates[1:] or rates),
    )


def train_step(run: Run, micro_batches: list[Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One optimizer step over this rank's micro-batches; returns (this rank's mean loss, the
    global gradient norm before clipping, or None when clipping is off)."""
    precision = run.config.train.precision
    total = torch.zeros((), device=run.device)
    for i, (inputs, target) in enumerate(micro_batches):
        inputs, target = _to(inputs, run.device), _to(target, run.device)
        with gradient_sync(run.model, enabled=i == len(micro_batches) - 1):
            with autocast(precision, run.device):
                loss = run.loss_fn(run.model(inputs), target) / len(micro_batches)
            run.scaler.scale(loss).backward()
        total += loss.detach()
    run.scaler.unscale_(run.optimizer)
    grad_norm = None
    if run.config.train.grad_clip > 0:
        grad_norm = torch.nn.utils.clip_grad_norm_(
            run.model.parameters(), run.config.train.grad_clip
        )
    run.scaler.step(run.optimizer)
    run.scaler.update()
    run.optimizer.zero_grad(set_to_none=True)
    return total, grad_norm


@torch.no_grad()
def evaluate(run: Run) -> dict[str, float]:
    """Held-out loss (and accuracy for classification), exact over the whole split: each rank sums
    loss × targets, correct predictions and counts; the sums are added across ranks."""
    assert run.eval_data is not None
    run.model.eval()
    # [loss sum, correct, target count, targets where accuracy applies]
    sums = torch.zeros(4, dtype=torch.float64, device=run.device)
    for inputs, target in run.eval_data:
        inputs, target = _to(inputs, run.device), _to(target, run.device)
        with autocast(run.config.train.precision, run.device):
            outputs = run.model(inputs)
        count = target.numel()
        sums[0] += run.loss_fn(outputs, target).double() * count
        sums[2] += count
        if outputs.dim() == target.dim() + 1 and not target.is_floating_point():
            sums[1] += (outputs.argmax(-1) == target).sum()
            sums[3] += count
    dist.all_reduce(sums, group=run.dp_group)
    run.model.train()
    result = {"eval/loss": (sums[0] / sums[2].clamp(min=1)).item()}
    if sums[3] > 0:
        result["eval/accuracy"] = (sums[1] / sums[3]).item()
    return result


def save(run: Run, step: int) -> Path:
    state = train_state.capture(
        model=run.model,
        optimizer=run.optimizer,
        scheduler=run.scheduler,
        scaler=run.scaler,
        loader=run.loader,
        step=step,
        rank=run.rank,
    )
    return run.checkpoints.save(step, state, _manifest(run))


def restore(run: Run, path: Path) -> int:
    """Load the checkpoint at `path` into the run; returns the step to continue after."""
    manifest_world = int(read_manifest(path)["world_size"])
    state = train_state.capture(
        model=run.model,
        optimizer=run.optimizer,
        scheduler=run.scheduler,
        scaler=run.scaler,
        loader=run.loader,
        step=0,
        rank=run.rank,
    )
    same_world = manifest_world == run.derived.world_size
    if not same_world:
        state = train_state.without_rng(state)
    run.checkpoints.load(path, state)
    step = train_state.apply(
        state,
        model=run.model,
        optimizer=run.optimizer,
        scheduler=run.scheduler,
        scaler=run.scaler,
        loader=run.loader,
    )
    if not same_world:
        train_state.reseed(run.config.job.seed, step, run.rank)
    return step


def start_reporting(
    run: Run, start: int, *, resumed: bool
) -> tuple[Tracker | None, ProgressDisplay | None]:
    """On rank 0: print the resolved config and derived numbers, save them, open the trackers."""
    if run.rank != 0:
        return None, None
    cfg, derived = run.config, run.derived
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    config_toml = tomli_w.dumps(cfg.model_dump(mode="json", exclude_none=True))
    (cfg.run_dir / "config.toml").write_text(config_toml)
    console = Console()
    console.print(f"resolved config (saved to {cfg.run_dir / 'config.toml'}):", highlight=False)
    console.print(config_toml, highlight=False, markup=False, soft_wrap=True)
    console.print(_derived_line(derived, run.tokens_per_sample), highlight=False, soft_wrap=True)
    if resumed:
        console.print(f"resuming after step {start}", highlight=False)
    trackers: list[Tracker] = [
        JsonlTracker(cfg.run_dir / "metrics.jsonl", resumed_from=start if resumed else None)
    ]
    if cfg.tracking.mlflow:
        trackers.append(_open_mlflow(cfg, resumed))
    tracker = Trackers(trackers)
    tracker.log_params(
        {**flatten(cfg), **{f"derived.{k}": str(v) for k, v in asdict(derived).items()}}
    )
    tracker.log_artifact(cfg.run_dir / "config.toml")
    display = ProgressDisplay(total_steps=cfg.train.steps, start_step=start, console=console)
    return tracker, display


def _open_mlflow(cfg: JobConfig, resumed: bool) -> MlflowTracker:
    id_file = cfg.run_dir / "mlflow_run_id"
    previous = id_file.read_text().strip() if resumed and id_file.exists() else None
    return MlflowTracker(
        uri=cfg.tracking_uri,
        experiment=cfg.tracking.experiment,
        run_name=cfg.job.name,
        artifact_dir=None if cfg.tracking.uri else cfg.run_dir / "artifacts",
        run_id=previous,
        id_file=id_file,
    )


def _mlflow_run_id(tracker: Tracker | None) -> str | None:
    if isinstance(tracker, Trackers):
        for t in tracker.trackers:
            if isinstance(t, MlflowTracker):
                return t.run_id
    return None


def _train_stats(
    run: Run, losses: list[torch.Tensor], grad_norm: torch.Tensor | None, elapsed: float
) -> dict[str, float]:
    loss = torch.stack(losses).mean()
    dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=run.dp_group)
    samples = run.derived.global_batch * len(losses) / elapsed
    stats = {"loss": loss.item(), "lr": float(run.scheduler.get_last_lr()[0]), "samples/s": samples}
    if run.tokens_per_sample > 1:
        stats["tokens/s"] = samples * run.tokens_per_sample
    if grad_norm is not None:
        stats["grad_norm"] = float(grad_norm)
    return stats


def _report(
    tracker: Tracker | None, display: ProgressDisplay | None, stats: dict[str, float], step: int
) -> None:
    if tracker is not None:
        tracker.log_metrics(stats, step)
    if display is not None:
        display.update(step, stats)


def _manifest(run: Run) -> dict[str, Any]:
    config_json = _json(run.config.model_dump(mode="json"))
    return {
        "world_size": run.derived.world_size,
        "degrees": run.derived.degrees,
        "global_batch": run.derived.global_batch,
        "config_sha256": hashlib.sha256(config_json.encode()).hexdigest(),
    }


def _derived_line(derived: Derived, tokens_per_sample: int) -> str:
    parts = [
        f"world size {derived.world_size}",
        "mesh " + " × ".join(f"{a}={d}" for a, d in derived.degrees.items()),
        f"global batch {derived.global_batch}",
        f"micro batch {derived.micro_batch}",
        f"gradient accumulation {derived.grad_accum}",
        f"samples/step {derived.global_batch}",
        f"lr {derived.lr:.3g}",
    ]
    if tokens_per_sample > 1:
        parts.append(f"tokens/step {derived.global_batch * tokens_per_sample:,}")
    return "derived: " + ", ".join(parts)


def _num_samples(dataset: Any) -> int:
    if not hasattr(dataset, "__len__"):
        raise ConfigError(
            f"the training dataset ({type(dataset).__name__}) has no length; the data builder "
            "must return map-style datasets (with __len__ and __getitem__)"
        )
    return len(dataset)


def _tokens_per_sample(item: Any) -> int:
    target = item[1] if isinstance(item, tuple | list) and len(item) == 2 else None
    return int(target.numel()) if isinstance(target, torch.Tensor) else 1


def _due(step: int, every: int, last: int) -> bool:
    return step == last or (every > 0 and step % every == 0)


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, tuple | list):
        return type(value)(_to(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return value


def _median(values: list[float]) -> float:
    return float(torch.tensor(values).median()) if values else 0.0


def _json(value: Any) -> str:
    return json.dumps(value, indent=2, default=str)
