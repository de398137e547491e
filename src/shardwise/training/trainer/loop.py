"""The training loop every rank runs: build the run, restore it, step, evaluate, checkpoint, report.

`train` reads top to bottom; `step.train_step` is the one place with forward and backward. This
module expects the process group to exist already (launch/ starts it) and must not read launcher
environment variables.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from shardwise.common.console import warn
from shardwise.common.errors import ConfigError
from shardwise.common.job_files import shown
from shardwise.training import builders
from shardwise.training.checkpoint import safe
from shardwise.training.checkpoint.export import load_weights
from shardwise.training.checkpoint.layout import name_of, read_manifest
from shardwise.training.checkpoint.manager import (
    CheckpointManager,
    WriteFailed,
    asynchronous_by_default,
)
from shardwise.training.comm import choose as comm
from shardwise.training.config.derive import Derived, derive, resolved
from shardwise.training.config.schema import JobConfig
from shardwise.training.data.sampling import GlobalBatchSampler, StepLoader, eval_loader
from shardwise.training.fault.health import RankHealth
from shardwise.training.fault.inject import FaultPlan
from shardwise.training.fault.watchdog import Watchdog
from shardwise.training.parallel import compile
from shardwise.training.parallel.apply import Layout, parallelize, unwrap
from shardwise.training.parallel.init import initializer, materialize, supports_meta_init
from shardwise.training.parallel.mesh import build_mesh, dp_group, dp_position, pp_group
from shardwise.training.parallel.pipeline import example_batch, measure_block_costs
from shardwise.training.trainer import display, flops, precision
from shardwise.training.trainer import state as train_state
from shardwise.training.trainer.memory import current_bytes, state_bytes
from shardwise.training.trainer.nonfinite import NonFiniteGuard
from shardwise.training.trainer.optim import build_optimizer, build_scheduler
from shardwise.training.trainer.precision import DTYPES, grad_scaler
from shardwise.training.trainer.profile import StepProfiler, data_range, phase
from shardwise.training.trainer.step import Run, evaluate, mean_loss, train_step


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
    preempted: bool = False
    """The run stopped early on SIGTERM, after saving a checkpoint."""
    memory: list[dict[str, Any]] = field(default_factory=list)
    """Per rank: parameter, gradient and optimizer-state bytes, peak memory, pipeline bubble."""


def train(
    config: JobConfig,
    *,
    device: torch.device,
    resume: str | None,
    restarts: int = 0,
    node: int = 0,
) -> TrainSummary:
    """Train to `train.steps`, resuming from the checkpoint at `resume` if given; `restarts`
    counts the times the launcher restarted the workers after a failure (reported); `node` is
    the index of the machine this rank runs on. Returns this rank's summary (rank 0's is the
    run's: the one it writes). The loop calls `train_step` itself, so the path from the
    launcher to `loss.backward()` stays short."""
    with _session(config, device, resume, restarts=restarts, node=node) as session:
        run, progress, reporter = session.run, session.progress, session.reporter
        _begin(run, reporter, progress)
        profiler = StepProfiler(
            config.run_dir,
            run.rank,
            first=config.tracking.profile_step,
            count=config.tracking.profile_steps,
            count_reads=not config.train.compile,
        )
        preempted_at = None
        try:
            for step in range(progress.start + 1, config.train.steps + 1):
                session.watchdog.started(step)
                began = time.perf_counter()
                reporting = _reporting(config, step) or step <= progress.start + 2
                with profiler.step(step, reporting=reporting):
                    batch, fetched = _next_batch(run, step)
                    stepped = train_step(run, batch, step=step)
                    _account(
                        run, step, progress, reporter, session.health, (began, fetched), stepped
                    )
                    if profiler.wants(step):  # profiled: not in the throughput
                        progress.untime(time.perf_counter() - began)
                    stop = _after_step(run, step, progress, reporter, session)
                if stop:
                    preempted_at = step
                    break
        finally:
            profiler.close()  # a window the run ended (or failed) inside of
        session.watchdog.beat()  # the end: the saves in flight may take a while
        summary = session.summary = _end(run, progress, reporter, preempted_at)
    return summary


@dataclass
class _Session:
    """What one rank's run holds while it trains, opened and closed by `_session`."""

    run: Run
    reporter: display.Reporter
    progress: Progress
    health: RankHealth
    watchdog: Watchdog
    summary: TrainSummary | None = None


@contextmanager
def _session(
    config: JobConfig, device: torch.device, resume: str | None, *, restarts: int, node: int
) -> Iterator[_Session]:
    """Build and restore the run, start its reporting and guards; afterwards write the summary
    and the run report (rank 0), and close everything whether the run finished or failed."""
    baseline = current_bytes(device)
    run = build_run(config, device, node=node, resume=resume)
    run.baseline_bytes = baseline
    run.faults = FaultPlan.from_env(rank=run.rank, attempt=restarts)
    start = restore(run, resume) if resume else 0
    reporter = display.start(run, start, resumed=resume is not None)
    if restarts:
        display.restarted(reporter, restarts, start)
    watchdog = Watchdog(config.run_dir / "hangs", rank=run.rank, timeout_s=config.fault.timeout_s)
    health = RankHealth(
        straggler_factor=config.fault.straggler_factor,
        straggler_windows=config.fault.straggler_windows,
        every=config.tracking.log_every,
        interval_s=config.fault.check_interval_s,
        adaptive=run.sync.meets_every_step,
        on_signal=watchdog.hurry,
    )
    progress = Progress(start=start, checkpoint=resume, window_start=start)
    progress.compiled.start()
    session = _Session(run, reporter, progress, health, watchdog)
    status = "FAILED"
    try:
        yield session
        summary = session.summary
        assert summary is not None, "train() sets the summary before the session closes"
        status = "KILLED" if summary.preempted else "FINISHED"
        summary.resumed_from = start if resume else None
        if run.rank == 0 and config.tracking.report:
            # the report reads the run's files, summary.json among them; it is written again
            # below once MLflow (closed with the report logged) has said its run id
            (config.run_dir / "summary.json").write_text(_json(asdict(summary)))
            display.run_report(reporter, config.run_dir)
    finally:
        watchdog.close()
        health.close()
        reporter.close(status)
    if session.summary is not None and run.rank == 0:
        session.summary.mlflow_run_id = reporter.mlflow_run_id()
        (config.run_dir / "summary.json").write_text(_json(asdict(session.summary)))


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
        tokens_per_sample=_tokens_per_sample(train_set[0]),
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
        per_param = 2 if config.train.optimizer == "adamw" else int(config.train.momentum > 0)
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


@dataclass
class Progress:
    """What the loop keeps between steps: the reporting window (losses since the last report
    and the clock it started at), the numbers the summary returns, and counters."""

    start: int
    checkpoint: str | None
    metrics: dict[str, float] = field(default_factory=dict)
    losses: list[torch.Tensor] = field(default_factory=list)
    skipped_flags: list[torch.Tensor] = field(default_factory=list)
    """Whether each of the window's steps was skipped, 1.0 or 0.0 on the device (empty when
    unchecked)."""
    clock: float = field(default_factory=time.perf_counter)
    window_start: int = 0
    rates: list[float] = field(default_factory=list)
    memory: list[dict[str, Any]] = field(default_factory=list)
    skipped: int = 0
    """Steps skipped for a non-finite gradient norm, as of the last reporting step."""
    failed_saves: int = 0
    grad_norm: torch.Tensor | None = None
    """The last step's gradient norm (reported at the end of the window)."""
    first_step_s: float = 0.0
    compiled: compile.CompileWatch = field(default_factory=compile.CompileWatch)
    """What torch.compile compiled in this run (train.compile)."""
    mfu_flagged: bool = False
    untimed: int = 0
    """Steps of the window left out of its throughput (compiling, profiled)."""

    def exclude(self, began: float) -> None:
        """Move the time since `began` (a checkpoint, an evaluation) out of the throughput."""
        self.clock += time.perf_counter() - began

    def untime(self, seconds: float) -> None:
        """Leave one step that took `seconds` out of the window's throughput."""
        self.clock += seconds
        self.untimed += 1


def _begin(run: Run, reporter: display.Reporter, progress: Progress) -> None:
    if progress.start >= run.config.train.steps:
        _nothing_left(run, reporter, progress)
    for part in run.parts:
        part.train()
    run.nonfinite.begin(progress.start)


def _nothing_left(run: Run, reporter: display.Reporter, progress: Progress) -> None:
    reporter.say(
        f"the checkpoint is at step {progress.start} of {run.config.train.steps}: nothing left "
        "to train (raise train.steps to train further)"
    )
    if run.eval_data is not None:
        progress.metrics.update(evaluate(run))


def _next_batch(run: Run, step: int) -> tuple[Any, float]:
    """The step's batch (after any injected fault) and the seconds it took to fetch."""
    began = time.perf_counter()
    run.faults.before_step(step)
    with data_range():
        batch = run.loader.next_step()
    run.forward_seconds = 0.0
    return batch, time.perf_counter() - began


def _account(
    run: Run,
    step: int,
    progress: Progress,
    reporter: display.Reporter,
    health: RankHealth,
    timing: tuple[float, float],
    stepped: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None],
) -> None:
    """After `train_step`: the step's time for the straggler check and the pipeline bubble (an
    injected delay counts as this rank's own work, as a slow rank's would), the schedule, and
    what the reporting window keeps."""
    began, fetched = timing
    loss, grad_norm, skipped = stepped
    with phase("accounting"):
        health.add(fetched + run.forward_seconds, time.perf_counter() - began)
        for scheduler in run.schedulers:
            scheduler.step()
        progress.losses.append(loss)
        if skipped is not None:
            progress.skipped_flags.append(skipped)
            run.nonfinite.remember(step, _position(run))
        progress.grad_norm = grad_norm
    took = time.perf_counter() - began
    if step == progress.start + 1:  # warm-up: shape inference, allocations; not in the bubble
        if run.layout.pipeline is not None:
            run.layout.pipeline.reset_timers()
        progress.first_step_s = took
        if run.config.train.compile:  # it compiled: not in the throughput either
            progress.untime(took)
    else:
        run.step_seconds += took
    if step == progress.start + 2 and run.config.train.compile:
        progress.compiled.warmed_up()
        _compiled(reporter, step, progress, took)
    if step == min(progress.start + 2, run.config.train.steps):  # optimizer state in place
        progress.memory = display.memory(run, reporter, step)


def _after_step(
    run: Run, step: int, progress: Progress, reporter: display.Reporter, session: _Session
) -> bool:
    """Health, logging, checkpoint (then evaluation: a failing evaluation loses nothing that was
    trained); whether the run stops here (SIGTERM: saved, --resume auto continues)."""
    with phase("health"):
        stop = _health(run, step, reporter, session.health)
    if stop or _reporting(run.config, step):
        _skipped(run, step, progress, reporter)
    with phase("log"):
        _log(run, step, progress, reporter)
    steps = run.config.train.steps
    if _due(step, run.config.checkpoint.every_steps, steps) or stop:
        _checkpoint(run, step, progress, reporter, session.watchdog)
    if _due(step, run.config.eval.every_steps, steps) and run.eval_data is not None:
        _evaluate(run, step, progress, reporter, session.watchdog)
    session.watchdog.finished(step)
    run.faults.after_step(step)
    if stop:
        reporter.say(
            f"SIGTERM: saved {progress.checkpoint} at step {step} and stopping; "
            "--resume auto continues exactly"
        )
    return stop


def _end(
    run: Run, progress: Progress, reporter: display.Reporter, preempted_at: int | None
) -> TrainSummary:
    run.sync.close()
    _wait_for_saves(run)
    _recompiled(run, progress, reporter)
    if run.config.train.steps > progress.start and preempted_at is None:
        progress.memory = display.memory(run, reporter, run.config.train.steps, final=True)
    return _summary(run, progress, preempted_at)


def _compiled(reporter: display.Reporter, step: int, progress: Progress, second: float) -> None:
    """The compile time (what the first step, which compiled, took beyond the second), the graphs
    and any graph breaks."""
    first, watch = progress.first_step_s, progress.compiled
    seconds = max(first - second, 0.0)
    reporter.record(
        {
            "compile/seconds": seconds,
            "compile/graphs": float(watch.graphs),
            "compile/graph_breaks": float(watch.breaks),
        },
        step,
    )
    breaks = ""
    if watch.breaks:
        reasons = watch.break_reasons()
        breaks = (
            f", {_plural(watch.breaks, 'graph break')} (first: {reasons[0] if reasons else '?'})"
        )
    reporter.say(
        f"torch.compile: {seconds:.1f} s (the first step took {first:.2f} s, the second "
        f"{second:.3f} s), {_plural(watch.graphs, 'graph')}{breaks}; throughput is measured "
        "from the second step"
    )


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _recompiled(run: Run, progress: Progress, reporter: display.Reporter) -> None:
    """At the end: graphs torch.compile compiled after the second step, said once."""
    if not run.config.train.compile or run.config.train.steps < progress.start + 2:
        return
    again = progress.compiled.recompiled()
    reporter.record({"compile/recompiles": float(again)}, run.config.train.steps)
    if again:
        reporter.say(
            f"torch.compile compiled {_plural(again, 'graph')} more after step "
            f"{progress.start + 2}: "
            "something the graphs depend on changed (a shape, a flag); TORCH_LOGS=recompiles "
            "says what"
        )


def _health(run: Run, step: int, reporter: display.Reporter, health: RankHealth) -> bool:
    """Where due, the ranks compare notes (SIGTERM, stragglers); whether to stop after `step`."""
    if not health.due(step):
        return False
    checked = health.check()
    if checked.metrics:
        reporter.record(checked.metrics, step)
    for message in checked.messages:
        reporter.say(message)
    return checked.stop and step < run.config.train.steps


def _log(run: Run, step: int, progress: Progress, reporter: display.Reporter) -> None:
    """At the end of a reporting window: its throughput, loss and the sync's metrics."""
    if step % run.config.tracking.log_every != 0 and step != run.config.train.steps:
        return
    elapsed = time.perf_counter() - progress.clock
    stats = _train_stats(run, progress, elapsed, step - progress.window_start - progress.untimed)
    if "samples/s" in stats:
        progress.rates.append(stats["samples/s"])
    if stats.get("mfu", 0.0) > 100:
        _impossible_mfu(run, step, progress, reporter, stats)
    progress.metrics.update(stats)
    progress.losses, progress.skipped_flags, progress.untimed = [], [], 0
    progress.clock, progress.window_start = time.perf_counter(), step
    reporter.progress(stats, step)


def _impossible_mfu(
    run: Run, step: int, progress: Progress, reporter: display.Reporter, stats: dict[str, float]
) -> None:
    """An MFU above 100% is not reported: the peak it is measured against is wrong. Said once."""
    achieved = stats["tflops"]
    for key in ("mfu", "mfu_datasheet"):
        stats.pop(key, None)
    if progress.mfu_flagged:
        return
    progress.mfu_flagged = True
    peak = run.utilisation.peak if isinstance(run.utilisation, flops.Utilisation) else None
    than = f" ({peak.describe()})" if peak is not None else ""
    reporter.say(
        f"step {step}: {achieved:.3g} TFLOP/s per device is more than the peak{than}, so the "
        "peak is wrong (measured while the device was busy, or a path the model does not "
        "take): MFU is not reported. `shardwise plan --calibrate` measures this device's peak "
        "for every later run"
    )


def _checkpoint(
    run: Run, step: int, progress: Progress, reporter: display.Reporter, watchdog: Watchdog
) -> None:
    """Save the step; a failed save stops the run only under checkpoint.fail_on_save_error."""
    watchdog.beat()
    began = time.perf_counter()
    try:
        progress.checkpoint = save(run, step, final=step == run.config.train.steps)
        saved = {"checkpoint/save_s": time.perf_counter() - began}
    except SaveFailed as failure:
        if run.config.checkpoint.fail_on_save_error:
            raise
        progress.failed_saves += 1
        saved = {"checkpoint/failed_saves": float(progress.failed_saves)}
        reporter.say(
            f"{failure}; training continues, the newest checkpoint is still "
            f"{progress.checkpoint} (checkpoint.fail_on_save_error = true makes this fatal)"
        )
    progress.exclude(began)
    reporter.record(saved, step)


def _evaluate(
    run: Run, step: int, progress: Progress, reporter: display.Reporter, watchdog: Watchdog
) -> None:
    watchdog.beat()
    began = time.perf_counter()
    evaluation = evaluate(run)
    progress.exclude(began)
    progress.metrics.update(evaluation)
    reporter.evaluation(evaluation, step)


def _wait_for_saves(run: Run) -> None:
    try:
        run.checkpoints.wait()  # an asynchronous save still in flight is committed here
    except WriteFailed as e:
        raise SaveFailed(f"saving the checkpoint of step {e.step} failed: {e}") from e


def _summary(run: Run, progress: Progress, preempted_at: int | None) -> TrainSummary:
    return TrainSummary(
        step=preempted_at or run.config.train.steps,
        preempted=preempted_at is not None,
        metrics=progress.metrics,
        checkpoint=str(progress.checkpoint) if progress.checkpoint else None,
        run_dir=str(run.config.run_dir),
        mlflow_run_id=None,
        samples_per_second=_median(progress.rates[1:] or progress.rates),
        memory=progress.memory,
    )


class NonFiniteStep(RuntimeError):
    """A step's gradient norm was NaN or infinite under `fault.on_nonfinite = "stop"`."""


def _reporting(config: JobConfig, step: int) -> bool:
    """A step where the ranks meet anyway (a log, checkpoint or evaluation step; for the
    profile also the first two steps of a process, which gather the memory table)."""
    every = (config.tracking.log_every, config.checkpoint.every_steps, config.eval.every_steps)
    return any(_due(step, n, config.train.steps) for n in every)


def _skipped(run: Run, step: int, progress: Progress, reporter: display.Reporter) -> None:
    """At a reporting step, the updates skipped since the last one for a NaN or infinite
    gradient norm (trainer/nonfinite.py): counted under `skip`; under `stop`, the state before
    the first of them (no later update was applied either) is saved and the run ends."""
    seen = run.nonfinite.read()
    if not seen.first_bad:
        return
    bad = seen.first_bad
    what = f"step {bad}: the gradient norm is {seen.norm} (loss {seen.loss})"
    if run.config.fault.on_nonfinite == "skip":
        more = seen.skipped - progress.skipped - 1
        progress.skipped = seen.skipped
        reporter.record({"fault/skipped_steps": float(seen.skipped)}, step)
        also = f", and {more} more up to step {step}" if more > 0 else ""
        reporter.say(f"{what}; the update was skipped{also} (fault.on_nonfinite = 'skip')")
        return
    _rewind(run, run.nonfinite.position(bad))
    path = save(run, bad)
    run.checkpoints.wait()
    seen_at = f" (found at step {step}; no update after it was applied)" if bad < step else ""
    raise NonFiniteStep(
        f"{what}; stopped without applying it{seen_at} and saved the state before it as "
        f"{name_of(path)}. Lower train.lr, check the data, or set fault.on_nonfinite = 'skip'"
    )


def _position(run: Run) -> tuple[dict[str, int], list[dict[str, Any]]]:
    """Where the run is between steps, apart from the model and optimizers: the data position
    and the schedule (host-side numbers; nothing waits for the device)."""
    return run.loader.state_dict(), [s.state_dict() for s in run.schedulers]


def _rewind(run: Run, position: tuple[dict[str, int], list[dict[str, Any]]]) -> None:
    """Put the data position and the schedule (with the learning rate it set) back to `position`."""
    loader, schedules = position
    run.loader.load_state_dict(loader)
    for scheduler, state in zip(run.schedulers, schedules, strict=True):
        scheduler.load_state_dict(state)
        for group, lr in zip(
            scheduler.optimizer.param_groups, scheduler.get_last_lr(), strict=True
        ):
            group["lr"] = lr


class SaveFailed(RuntimeError):
    """Writing a checkpoint failed on every rank (what was written of it is removed)."""


def save(run: Run, step: int, *, final: bool = False) -> str:
    """Checkpoint the run at `step`; a failed write raises `SaveFailed` after cleaning up. The
    `final` checkpoint is committed before this returns, even an asynchronous one, so that
    nothing after it (the last evaluation) can lose the trained model."""
    state = capture(run, step)
    try:
        run.faults.before_save(step)
        buffers = train_state.own_buffers(state, run.parts)
        path = run.checkpoints.save(step, state, _manifest(run), first_holder=buffers)
        if final:
            run.checkpoints.wait()
        return path
    except WriteFailed as e:  # the previous, asynchronous save
        raise SaveFailed(f"saving the checkpoint of step {e.step} failed: {e}") from e
    except (OSError, RuntimeError, CheckpointException) as e:
        run.checkpoints.discard_partial(step)
        raise SaveFailed(f"saving the checkpoint of step {step} failed: {e}") from e


def capture(run: Run, step: int) -> dict[str, Any]:
    """The run's state as a checkpoint holds it (trainer/state.py), taken after `step`; what a
    save writes and a restore fills."""
    return train_state.capture(
        parts=run.parts,
        optimizers=run.optimizers,
        scheduler=run.schedulers[0],
        scaler=run.scaler,
        loader=run.loader,
        step=step,
        rank=run.rank,
        sync=run.sync,
    )


def restore(run: Run, path: str) -> int:
    """Load the checkpoint at `path` into the run; returns the step to continue after.

    Model, optimizer, schedule and data position load under any layout (DCP reshards). Random
    states come back only when the layout is the same (and the checkpoint holds them as
    tensors); otherwise each rank reseeds from (seed, step, data-parallel rank).
    """
    manifest = read_manifest(path)
    state = capture(run, 0)
    same_layout, saved_rng = manifest.get("degrees") == run.derived.degrees, False
    if same_layout:
        state, saved_rng = train_state.with_saved_rng(state, safe.keys(path))
        state, _ = train_state.with_saved_sync(state, safe.keys(path))
        if not saved_rng and run.rank == 0:
            warn(
                f"{name_of(path)} holds no random-number states shardwise can load (an older "
                "version pickled them, and a pickle could run code): each rank reseeds from "
                "(seed, step, rank), so the resumed run is exact but not bitwise",
                stacklevel=2,
            )
    else:
        state = train_state.without_rng(state)
    run.checkpoints.load(path, state)
    step = train_state.apply(
        state,
        parts=run.parts,
        optimizers=run.optimizers,
        schedulers=run.schedulers,
        scaler=run.scaler,
        loader=run.loader,
        sync=run.sync,
        rank=run.rank,
    )
    if not saved_rng:
        train_state.reseed(run.config.job.seed, step, dp_position(run.mesh)[0])
    return step


def dry_run(config: JobConfig, device: torch.device) -> None:
    """Build the layout on the meta device, without allocating or training, and print on rank 0
    the mesh, which blocks each rank holds and each rank's parameter, gradient and optimizer
    bytes."""
    derived = derive(config, dist.get_world_size())
    config = resolved(config, derived)
    mesh = build_mesh(derived.degrees, device.type)
    train_set, _ = builders.build_datasets(config)
    layout = build_layout(
        config, derived, mesh, device, sample=train_set[0], materialize_weights=False
    )
    per_param = 2 if config.train.optimizer == "adamw" else int(config.train.momentum > 0)
    mine: dict[str, Any] = {
        "rank": dist.get_rank(),
        "coordinates": " ".join(
            f"{a}={mesh.get_local_rank(a)}" for a in mesh.mesh_dim_names or () if mesh[a].size() > 1
        ),
        "holds": display.holds(layout),
        **state_bytes(layout.parts, optimizer_states_per_param=per_param),
    }
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if dist.get_rank() == 0:
        display.dry_run_table(ranks, derived, layout, _tokens_per_sample(train_set[0]))


def _train_stats(run: Run, progress: Progress, elapsed: float, steps: int) -> dict[str, float]:
    """The window's metrics: the loss over its applied steps (a skipped step's loss may not be
    finite; none when every step was skipped), its throughput over its timed `steps` (none
    when the only step compiled)."""
    stats = {"lr": float(run.schedulers[0].get_last_lr()[0])}
    loss = mean_loss(run, progress.losses, progress.skipped_flags)
    if not math.isnan(loss):
        stats["loss"] = loss
    if steps > 0:
        stats["samples/s"] = run.derived.global_batch * steps / elapsed
        if run.tokens_per_sample > 1:
            stats["tokens/s"] = stats["samples/s"] * run.tokens_per_sample
        if isinstance(run.utilisation, flops.Utilisation):
            stats.update(run.utilisation.window(steps, elapsed, run.derived.world_size))
    if progress.grad_norm is not None:
        stats["grad_norm"] = float(progress.grad_norm)
    stats.update(run.sync.metrics())
    return stats


def _manifest(run: Run) -> dict[str, Any]:
    config_json = _json(shown(run.config))  # no hash of a password either
    return {
        "world_size": run.derived.world_size,
        "degrees": run.derived.degrees,
        "global_batch": run.derived.global_batch,
        "precision": run.config.train.precision,
        "model": shown(run.config.model),
        "config_sha256": hashlib.sha256(config_json.encode()).hexdigest(),
    }


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


def _median(values: list[float]) -> float:
    return float(torch.tensor(values).median()) if values else 0.0


def _json(value: Any) -> str:
    return json.dumps(value, indent=2, default=str)
