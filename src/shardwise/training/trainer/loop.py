"""The training loop every rank runs: build the run (build.py), restore it (persist.py), step,
evaluate, checkpoint, report.

`train` reads top to bottom; `step.train_step` is the one place with forward and backward. This
module expects the process group to exist already (launch/ starts it) and must not read launcher
environment variables.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from shardwise.common.errors import ConfigError
from shardwise.training.checkpoint.disk_layout import name_of
from shardwise.training.config.schema import JobConfig
from shardwise.training.data.sampling import StepLoader
from shardwise.training.fault.health import RankHealth
from shardwise.training.fault.inject import FaultPlan
from shardwise.training.fault.live import LiveGroup
from shardwise.training.fault.live_replica import LiveReplica, Parts, StepAgain, StepTaken
from shardwise.training.fault.watchdog import Watchdog
from shardwise.training.parallel import compilation
from shardwise.training.parallel.mesh import dp_position
from shardwise.training.tracking.metrics import last_logged_step
from shardwise.training.trainer import display, flops
from shardwise.training.trainer import state as train_state
from shardwise.training.trainer.build import build_run
from shardwise.training.trainer.memory import current_bytes
from shardwise.training.trainer.persist import (
    SaveFailed,
    restore,
    rewind,
    run_position,
    save,
    to_json,
    wait_for_saves,
)
from shardwise.training.trainer.profile import StepProfiler, data_range, phase
from shardwise.training.trainer.step import Run, Stepped, evaluate, mean_loss, train_step
from shardwise.training.trainer.train_summary import TrainSummary


def train(
    config: JobConfig,
    *,
    device: torch.device,
    resume: str | None,
    restarts: int = 0,
    node: int = 0,
    live: LiveGroup | None = None,
) -> TrainSummary:
    """Train to `train.steps`, resuming from the checkpoint at `resume` if given; `restarts`
    counts the times the launcher restarted the workers after a failure (reported); `node` is
    the index of the machine this rank runs on; `live`: this process is a replica of live
    recovery (fault/live_replica.py), in that group. Returns this rank's summary (rank 0's is
    the run's: the one it writes). The loop calls `train_step` itself, so the path from the
    launcher to `loss.backward()` stays short."""
    with _session(config, device, resume, restarts=restarts, node=node, live=live) as loop:
        _begin(loop)
        profiler = StepProfiler(
            config.run_dir,
            loop.run.rank,
            first=config.tracking.profile_step,
            count=config.tracking.profile_steps,
            count_reads=not config.train.compile,
        )
        preempted_at = None
        try:
            for step in range(loop.start + 1, config.train.steps + 1):
                loop.watchdog.started(step)
                began = time.perf_counter()
                reporting = _reporting(config, step) or step <= loop.start + 2
                with profiler.step(step, reporting=reporting):
                    batch, fetched = _next_batch(loop.run, step)
                    try:
                        stepped = train_step(loop.run, batch, step=step)
                    except (StepAgain, StepTaken) as changed:  # live: a replica died inside it
                        stepped, fetched = _step_again(loop.run, step, changed, fetched)
                    _account(loop, step, (began, fetched), stepped)
                    if profiler.wants(step):  # profiled: not in the throughput
                        loop.untime(time.perf_counter() - began)
                    stop = _after_step(loop, step)
                if stop:
                    preempted_at = step
                    break
        finally:
            profiler.close()  # a window the run ended (or failed) inside of
        loop.watchdog.beat()  # the end: the saves in flight may take a while
        summary = loop.summary = _end(loop, preempted_at)
    return summary


@dataclass
class Loop:
    """Everything one rank's training loop holds, in one place: the run `build_run` built (its
    parts do not change between steps), the reporter and the guards around it, and what the loop
    counts: the reporting window (losses since the last report and the clock it started at), the
    numbers the summary returns, and the timings. Opened and closed by `_session`."""

    run: Run
    reporter: display.Reporter
    health: RankHealth
    watchdog: Watchdog
    start: int
    """The step the run continues after (0, or the checkpoint's)."""
    checkpoint: str | None
    """The newest checkpoint (the one resumed from, until this run saves)."""
    baseline_bytes: int = 0
    """Memory the process held before the run was built (CPU: the interpreter, torch, the
    process group), so `peak - baseline` is what training itself took."""
    metrics: dict[str, float] = field(default_factory=dict)
    losses: list[torch.Tensor] = field(default_factory=list)
    skipped_flags: list[torch.Tensor] = field(default_factory=list)
    """Whether each of the window's steps was skipped, 1.0 or 0.0 on the device (empty when
    unchecked)."""
    clock: float = field(default_factory=time.perf_counter)
    window_start: int = 0
    untimed: int = 0
    """Steps of the window left out of its throughput (compiling, profiled)."""
    rates: list[float] = field(default_factory=list)
    memory: list[dict[str, Any]] = field(default_factory=list)
    skipped: int = 0
    """Steps skipped for a non-finite gradient norm, as of the last reporting step."""
    failed_saves: int = 0
    grad_norm: torch.Tensor | None = None
    """The last step's gradient norm (reported at the end of the window)."""
    first_step_s: float = 0.0
    step_seconds: float = 0.0
    """Time spent in training steps after the first (for the measured pipeline bubble)."""
    compiled: compilation.CompileWatch = field(default_factory=compilation.CompileWatch)
    """What torch.compile compiled in this run (train.compile)."""
    mfu_flagged: bool = False
    last_progress: tuple[int, dict[str, float]] | None = None
    """The step and metrics of the last window's end (a live replica that takes the reporting
    over logs it where the replica that reported died before it could)."""
    summary: TrainSummary | None = None
    reporting: bool = True
    """Whether this process reports the run (rank 0; in live recovery, the replica chosen)."""

    @property
    def config(self) -> JobConfig:
        return self.run.config

    def exclude(self, began: float) -> None:
        """Move the time since `began` (a checkpoint, an evaluation) out of the throughput."""
        self.clock += time.perf_counter() - began

    def untime(self, seconds: float) -> None:
        """Leave one step that took `seconds` out of the window's throughput."""
        self.clock += seconds
        self.untimed += 1


@contextmanager
def _session(
    config: JobConfig,
    device: torch.device,
    resume: str | None,
    *,
    restarts: int,
    node: int,
    live: LiveGroup | None,
) -> Iterator[Loop]:
    """Build and restore the run (a live replacement: heal it from a replica), start its
    reporting and guards; afterwards write the summary and the run report (rank 0), and close
    everything whether the run finished or failed."""
    baseline = current_bytes(device)
    run = build_run(config, device, node=node, resume=resume)
    if live is not None:  # its faults fire in incarnation 0, by slot (and process under HSDP)
        run.rank, restarts = live.slot * live.width + live.local, live.incarnation
    run.faults = FaultPlan.from_env(rank=run.rank, attempt=restarts)
    if live is not None:
        run.live = replica(run, live)
    healed = live is not None and live.incarnation > 0
    if run.live is not None and healed:
        start = run.live.join()
    else:
        start = restore(run, resume) if resume else 0
    reporting = run.rank == 0 if run.live is None else run.live.reports
    reporter = display.start(run, start, resumed=resume is not None or healed, reporting=reporting)
    if restarts:
        display.restarted(reporter, restarts, start)
    # A live replica's collectives time out on a hung peer after fault.timeout_s, and it goes
    # on without it: its own watchdog waits longer (a replica hung itself is still caught).
    patience = config.fault.timeout_s * (1 if live is None else 2) + (0 if live is None else 10)
    watchdog = Watchdog(config.run_dir / "hangs", rank=run.rank, timeout_s=patience)
    health = RankHealth(
        straggler_factor=config.fault.straggler_factor,
        straggler_windows=config.fault.straggler_windows,
        every=config.tracking.log_every,
        interval_s=config.fault.check_interval_s,
        adaptive=run.sync.meets_every_step,
        on_signal=watchdog.hurry,
        replicas=live.work if live is not None else None,
    )
    loop = Loop(
        run,
        reporter,
        health,
        watchdog,
        start=start,
        checkpoint=resume,
        window_start=start,
        baseline_bytes=baseline,
        reporting=reporting,
    )
    loop.compiled.start()
    status = "FAILED"
    try:
        yield loop
        summary = loop.summary
        assert summary is not None, "train() sets the summary before the session closes"
        status = "KILLED" if summary.preempted else "FINISHED"
        summary.resumed_from = start if resume else None
        if loop.reporting and config.tracking.report:
            # the report reads the run's files, summary.json among them; it is written again
            # below once MLflow (closed with the report logged) has said its run id
            (config.run_dir / "summary.json").write_text(to_json(asdict(summary)))
            display.run_report(loop.reporter, config.run_dir)
    except BaseException as error:
        watchdog.peer_gone(error)  # after SIGTERM: ends the rank, saying why
        raise
    finally:
        watchdog.close()
        health.close()
        run.loader.close()
        loop.reporter.close(status)  # a live replica may have taken the reporting over
    if loop.summary is not None and loop.reporting:
        loop.summary.mlflow_run_id = loop.reporter.mlflow_run_id()
        (config.run_dir / "summary.json").write_text(to_json(asdict(loop.summary)))


def _begin(loop: Loop) -> None:
    run = loop.run
    if loop.start >= run.config.train.steps:
        _nothing_left(loop)
    for part in run.parts:
        part.train()
    run.nonfinite.begin(loop.start)


def _nothing_left(loop: Loop) -> None:
    loop.reporter.say(
        f"the checkpoint is at step {loop.start} of {loop.config.train.steps}: nothing left "
        "to train (raise train.steps to train further)"
    )
    if loop.run.eval_data is not None:
        loop.metrics.update(evaluate(loop.run))


def replica(run: Run, group: LiveGroup) -> LiveReplica:
    """This process's replica of live recovery, over the run's parts."""
    if not isinstance(run.loader, StepLoader):
        raise ConfigError(
            "fault.mode = 'live' re-splits each step's samples over the replicas, which a "
            "streamed table or an IterableDataset does not allow yet; set fault.mode = 'restart'"
        )
    pipe = run.layout.pipeline
    parts = Parts(
        modules=run.parts,
        optimizers=run.optimizers,
        schedulers=run.schedulers,
        scaler=run.scaler,
        loader=run.loader,
        parameters=run.parameters,
        traffic=run.sync.traffic,
        position=dp_position(run.mesh),
        stages=run.config.parallel.pp,
        unit=run.derived.micro_batch if pipe is not None else 1,
        reschedule=pipe.reschedule if pipe is not None else None,
        reseed=lambda step, rank: train_state.reseed(run.config.job.seed, step, rank),
    )
    return LiveReplica(
        group,
        parts,
        min_replicas=run.config.fault.min_replicas,
        faults=run.faults,
        check_every=run.config.checkpoint.every_steps,
    )


def _step_again(
    run: Run, step: int, changed: StepAgain | StepTaken, fetched: float
) -> tuple[Stepped, float]:
    """The step done again from its start, as many times as a live replica's membership
    changes inside it (fault/live_replica.py), or taken from the replica's peers where they
    committed it: what it returned, and its batch's fetch time."""
    while not isinstance(changed, StepTaken):
        for optimizer in run.optimizers:
            optimizer.zero_grad(set_to_none=True)
        batch, fetched = _next_batch(run, step)
        try:
            return train_step(run, batch, step=step), fetched
        except (StepAgain, StepTaken) as again:
            changed = again
    assert changed.step == step, (changed.step, step)
    for optimizer in run.optimizers:
        optimizer.zero_grad(set_to_none=True)
    return Stepped(torch.tensor(changed.loss), None, None, 0.0, taken=True), fetched


def _next_batch(run: Run, step: int) -> tuple[Any, float]:
    """The step's batch (after any injected fault) and the seconds it took to fetch; in live
    recovery, where the step starts (its data position, what a replacement starts from)."""
    if run.live is not None:
        run.live.begin(step)
    began = time.perf_counter()
    run.faults.before_step(step)
    with data_range():
        batch = run.loader.next_step()
    return batch, time.perf_counter() - began


def _account(loop: Loop, step: int, timing: tuple[float, float], stepped: Stepped) -> None:
    """After `train_step`: the step's time for the straggler check and the pipeline bubble (an
    injected delay counts as this rank's own work, as a slow rank's would), the schedule, and
    what the reporting window keeps."""
    run, config = loop.run, loop.config
    began, fetched = timing
    with phase("accounting"):
        loop.health.add(fetched + stepped.forward_seconds, time.perf_counter() - began)
        if not stepped.taken:  # taken from live peers: its schedule moved with it
            for scheduler in run.schedulers:
                scheduler.step()
        loop.losses.append(stepped.loss)
        if stepped.skipped is not None:
            loop.skipped_flags.append(stepped.skipped)
            run.nonfinite.remember(step, run_position(run))
        loop.grad_norm = stepped.grad_norm
    took = time.perf_counter() - began
    if step == loop.start + 1:  # warm-up: shape inference, allocations; not in the bubble
        if run.layout.pipeline is not None:
            run.layout.pipeline.reset_timers()
        loop.first_step_s = took
        if config.train.compile:  # it compiled: not in the throughput either
            loop.untime(took)
    else:
        loop.step_seconds += took
    if step == loop.start + 2 and config.train.compile:
        loop.compiled.warmed_up()
        _compiled(loop, step, took)
    if step == min(loop.start + 2, config.train.steps):  # optimizer state in place
        loop.memory = _memory(loop, step)


def _memory(loop: Loop, step: int, *, final: bool = False) -> list[dict[str, Any]]:
    return display.memory(
        loop.run,
        loop.reporter,
        step,
        baseline=loop.baseline_bytes,
        step_seconds=loop.step_seconds,
        final=final,
    )


def _after_step(loop: Loop, step: int) -> bool:
    """Health, logging, checkpoint (then evaluation: a failing evaluation loses nothing that was
    trained); whether the run stops here (SIGTERM: saved, --resume auto continues). Live
    replicas first follow their membership, together, before any of them saves or evaluates."""
    run = loop.run
    if run.live is not None:
        run.live.boundary(step)
        _live_events(loop, step)
    with phase("health"):
        stop = _health(loop, step)
    if stop or _reporting(run.config, step):
        _skipped(loop, step)
    with phase("log"):
        _log(loop, step)
    steps = run.config.train.steps
    if _due(step, run.config.checkpoint.every_steps, steps) or stop:
        _checkpoint(loop, step)
    evaluates = run.live is None or run.live.saves  # live: the reporting replica evaluates
    if _due(step, run.config.eval.every_steps, steps) and run.eval_data is not None and evaluates:
        _evaluate(loop, step)
    loop.watchdog.finished(step)
    run.faults.after_step(step)
    if run.faults.faults:
        run.faults.corrupt_parameters(step, run.parameters())
    if stop:
        loop.reporter.say(
            f"SIGTERM: saved {loop.checkpoint} at step {step} and stopping; "
            "--resume auto continues exactly"
        )
    return stop


def _live_events(loop: Loop, step: int) -> None:
    """What live recovery did since the last step: said, and recorded at the step each change
    applies from."""
    live = loop.run.live
    assert live is not None
    if live.reports and not loop.reporting:  # the replica that reported is gone: this one does
        loop.reporter = display.start(loop.run, step, resumed=True, reporting=True, announce=False)
        loop.reporting = True
        loop.reporter.say(f"replica {live.group.slot} reports the run from step {step} on")
        logged = last_logged_step(loop.config.run_dir / "metrics.jsonl")
        if loop.last_progress is not None and (logged or 0) < loop.last_progress[0]:
            loop.reporter.progress(loop.last_progress[1], loop.last_progress[0])  # died first
    for at, line, metrics in live.drain():  # a change at this boundary: at the next step
        if line:
            loop.reporter.say(line)
        loop.reporter.record(metrics, at)


def _end(loop: Loop, preempted_at: int | None) -> TrainSummary:
    loop.run.sync.close()
    wait_for_saves(loop.run)
    _recompiled(loop)
    steps = loop.config.train.steps
    if steps > loop.start and preempted_at is None:
        loop.memory = _memory(loop, steps, final=True)
    return _summary(loop, preempted_at)


def _compiled(loop: Loop, step: int, second: float) -> None:
    """The compile time (what the first step, which compiled, took beyond the second), the graphs
    and any graph breaks."""
    first, watch = loop.first_step_s, loop.compiled
    seconds = max(first - second, 0.0)
    loop.reporter.record(
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
    loop.reporter.say(
        f"torch.compile: {seconds:.1f} s (the first step took {first:.2f} s, the second "
        f"{second:.3f} s), {_plural(watch.graphs, 'graph')}{breaks}; throughput is measured "
        "from the second step"
    )


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _recompiled(loop: Loop) -> None:
    """At the end: graphs torch.compile compiled after the second step, said once."""
    config = loop.config
    if not config.train.compile or config.train.steps < loop.start + 2:
        return
    again = loop.compiled.recompiled()
    loop.reporter.record({"compile/recompiles": float(again)}, config.train.steps)
    if again:
        loop.reporter.say(
            f"torch.compile compiled {_plural(again, 'graph')} more after step "
            f"{loop.start + 2}: "
            "something the graphs depend on changed (a shape, a flag); TORCH_LOGS=recompiles "
            "says what"
        )


def _health(loop: Loop, step: int) -> bool:
    """Where due, the ranks compare notes (SIGTERM, stragglers); whether to stop after `step`."""
    if not loop.health.due(step):
        return False
    checked = loop.health.check()
    if checked.metrics:
        loop.reporter.record(checked.metrics, step)
    for message in checked.messages:
        loop.reporter.say(message)
    return checked.stop and step < loop.config.train.steps


def _log(loop: Loop, step: int) -> None:
    """At the end of a reporting window: its throughput, loss and the sync's metrics."""
    if step % loop.config.tracking.log_every != 0 and step != loop.config.train.steps:
        return
    elapsed = time.perf_counter() - loop.clock
    stats = _train_stats(loop, elapsed, step - loop.window_start - loop.untimed)
    if "samples/s" in stats:
        loop.rates.append(stats["samples/s"])
    if stats.get("mfu", 0.0) > 100:
        _impossible_mfu(loop, step, stats)
    loop.metrics.update(stats)
    loop.losses, loop.skipped_flags, loop.untimed = [], [], 0
    loop.clock, loop.window_start = time.perf_counter(), step
    loop.last_progress = (step, stats)
    loop.reporter.progress(stats, step)


def _impossible_mfu(loop: Loop, step: int, stats: dict[str, float]) -> None:
    """An MFU above 100% is not reported: the peak it is measured against is wrong. Said once."""
    achieved = stats["tflops"]
    for key in ("mfu", "mfu_datasheet"):
        stats.pop(key, None)
    if loop.mfu_flagged:
        return
    loop.mfu_flagged = True
    utilisation = loop.run.utilisation
    peak = utilisation.peak if isinstance(utilisation, flops.Utilisation) else None
    than = f" ({peak.describe()})" if peak is not None else ""
    loop.reporter.say(
        f"step {step}: {achieved:.3g} TFLOP/s per device is more than the peak{than}, so the "
        "peak is wrong (measured while the device was busy, or a path the model does not "
        "take): MFU is not reported. `shardwise plan --calibrate` measures this device's peak "
        "for every later run"
    )


def _checkpoint(loop: Loop, step: int) -> None:
    """Save the step; a failed save stops the run only under checkpoint.fail_on_save_error."""
    run = loop.run
    if run.live is not None and not run.live.saves:  # the reporting replica saves
        return
    loop.watchdog.beat()
    began = time.perf_counter()
    writing = run.live.group.saving() if run.live is not None else contextlib.nullcontext()
    try:
        with writing:  # a live job ending meanwhile lets the write finish
            loop.checkpoint = save(run, step, final=step == run.config.train.steps)
        saved = {"checkpoint/save_s": time.perf_counter() - began}
    except SaveFailed as failure:
        if run.config.checkpoint.fail_on_save_error:
            raise
        loop.failed_saves += 1
        saved = {"checkpoint/failed_saves": float(loop.failed_saves)}
        loop.reporter.say(
            f"{failure}; training continues, the newest checkpoint is still "
            f"{loop.checkpoint} (checkpoint.fail_on_save_error = true makes this fatal)"
        )
    loop.exclude(began)
    loop.reporter.record(saved, step)


def _evaluate(loop: Loop, step: int) -> None:
    loop.watchdog.beat()
    began = time.perf_counter()
    evaluation = evaluate(loop.run)
    loop.exclude(began)
    loop.metrics.update(evaluation)
    loop.reporter.evaluation(evaluation, step)


def _summary(loop: Loop, preempted_at: int | None) -> TrainSummary:
    return TrainSummary(
        step=preempted_at or loop.config.train.steps,
        preempted=preempted_at is not None,
        metrics=loop.metrics,
        checkpoint=str(loop.checkpoint) if loop.checkpoint else None,
        run_dir=str(loop.config.run_dir),
        mlflow_run_id=None,
        samples_per_second=_median(loop.rates[1:] or loop.rates),
        memory=loop.memory,
    )


class NonFiniteStep(RuntimeError):
    """A step's gradient norm was NaN or infinite under `fault.on_nonfinite = "stop"`."""


def _reporting(config: JobConfig, step: int) -> bool:
    """A step where the ranks meet anyway (a log, checkpoint or evaluation step; for the
    profile also the first two steps of a process, which gather the memory table)."""
    every = (config.tracking.log_every, config.checkpoint.every_steps, config.eval.every_steps)
    return any(_due(step, n, config.train.steps) for n in every)


def _skipped(loop: Loop, step: int) -> None:
    """At a reporting step, the updates skipped since the last one for a NaN or infinite
    gradient norm (trainer/nonfinite.py): counted under `skip`; under `stop`, the state before
    the first of them (no later update was applied either) is saved and the run ends."""
    run = loop.run
    seen = run.nonfinite.read()
    if not seen.first_bad:
        return
    bad = seen.first_bad
    what = f"step {bad}: the gradient norm is {seen.norm} (loss {seen.loss})"
    if run.config.fault.on_nonfinite == "skip":
        more = seen.skipped - loop.skipped - 1
        loop.skipped = seen.skipped
        loop.reporter.record({"fault/skipped_steps": float(seen.skipped)}, step)
        also = f", and {more} more up to step {step}" if more > 0 else ""
        loop.reporter.say(f"{what}; the update was skipped{also} (fault.on_nonfinite = 'skip')")
        return
    rewind(run, run.nonfinite.position(bad))
    path = save(run, bad)
    run.checkpoints.wait()
    seen_at = f" (found at step {step}; no update after it was applied)" if bad < step else ""
    raise NonFiniteStep(
        f"{what}; stopped without applying it{seen_at} and saved the state before it as "
        f"{name_of(path)}. Lower train.lr, check the data, or set fault.on_nonfinite = 'skip'"
    )


def _train_stats(loop: Loop, elapsed: float, steps: int) -> dict[str, float]:
    """The window's metrics: the loss over its applied steps (a skipped step's loss may not be
    finite; none when every step was skipped), its throughput over its timed `steps` (none
    when the only step compiled)."""
    run = loop.run
    stats = {"lr": float(run.schedulers[0].get_last_lr()[0])}
    loss = mean_loss(run, loop.losses, loop.skipped_flags)
    if not math.isnan(loss):
        stats["loss"] = loss
    if steps > 0:
        stats["samples/s"] = run.derived.global_batch * steps / elapsed
        if run.tokens_per_sample > 1:
            stats["tokens/s"] = stats["samples/s"] * run.tokens_per_sample
        if isinstance(run.utilisation, flops.Utilisation):
            stats.update(run.utilisation.window(steps, elapsed, run.derived.world_size))
    if loop.grad_norm is not None:
        stats["grad_norm"] = float(loop.grad_norm)
    stats.update(run.sync.metrics())
    return stats


def _due(step: int, every: int, last: int) -> bool:
    return step == last or (every > 0 and step % every == 0)


def _median(values: list[float]) -> float:
    return float(torch.tensor(values).median()) if values else 0.0
