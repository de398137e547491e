"""What rank 0 shows and records about a run: the resolved config and derived numbers at start,
progress and metrics (through the trackers), the per-rank memory and bubble table, and the dry
run's table. Nothing here changes training; everything here runs on rank 0 except the gathers.
"""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import tomli_w
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from shardwise.common.console import human_bytes
from shardwise.common.job_files import flatten, redacted_dump
from shardwise.common.mlflow import MlflowTracker
from shardwise.training.config.derive import Derived
from shardwise.training.config.schema import JobConfig
from shardwise.training.parallel.apply import Layout, span
from shardwise.training.tracking.metrics import JsonlTracker, Tracker, Trackers
from shardwise.training.tracking.progress import ProgressDisplay
from shardwise.training.trainer.flops import Utilisation
from shardwise.training.trainer.memory import peak_bytes, state_bytes
from shardwise.training.trainer.step import Run


def memory(
    run: Run,
    reporter: Reporter,
    step: int,
    *,
    baseline: int,
    step_seconds: float,
    final: bool = False,
) -> list[dict[str, Any]]:
    """Gather every rank's state bytes, peak memory (and the `baseline` the process held before
    the run was built) and, under pipeline parallelism at the end, the measured bubble (the
    stages' busy time over `step_seconds`, the steps' time after the first) to rank 0; print
    them once after the first step and at the end."""
    mine: dict[str, Any] = {"rank": run.rank, **state_bytes(run.parts, run.optimizers)}
    mine["peak"] = peak_bytes(run.device)
    mine["baseline"] = baseline
    pipe = run.layout.pipeline
    if pipe is not None and final and step_seconds > 0:
        mine["bubble"] = max(0.0, 1.0 - pipe.busy_seconds() / step_seconds)
        mine["bubble_theory"] = pipe.theoretical_bubble()
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if run.rank != 0:
        return []
    reporter.table(memory_table(ranks, title=f"per rank after step {step}"))
    advice = bubble_advice(ranks, fix=_balance_fix(run))
    if advice:
        reporter.say(advice)
    flat = {
        f"memory/rank{r['rank']}/{k}": float(v) for r in ranks for k, v in r.items() if k != "rank"
    }
    reporter.record(flat, step)
    return ranks


def bubble_advice(ranks: list[dict[str, Any]], *, fix: str | None) -> str | None:
    """A line for a pipeline whose ranks idled far longer than its schedule needs them to (the
    stages' work is uneven), saying how to even it out (`fix`); None otherwise."""
    measured = [r["bubble"] for r in ranks if "bubble" in r]
    if not measured or fix is None:
        return None
    worst, theory = max(measured), float(ranks[0]["bubble_theory"])
    if worst < max(1.5 * theory, theory + 0.15):
        return None
    return (
        f"pipeline: ranks idled up to {worst:.0%} of each step where the schedule needs "
        f"{theory:.0%}: the stages' work is uneven; {fix}"
    )


def _balance_fix(run: Run) -> str | None:
    """How this run's pipeline split could be evened out, if it can."""
    parallel, pipe = run.config.parallel, run.layout.pipeline
    if pipe is None or parallel.pipeline_balance == "cost":
        return None
    if parallel.pipeline_split:
        return "move the stage boundaries in parallel.pipeline_split"
    if pipe.split_by != "blocks":
        how = "traced" if pipe.split_by == "traced" else "cut as transformers declares"
        return f"name where stages begin with parallel.pipeline_split (this model is {how})"
    return (
        "parallel.pipeline_balance = 'cost' splits the blocks by their measured time instead "
        "of their parameter count"
    )


def restarted(reporter: Reporter, restarts: int, step: int) -> None:
    """After the launcher restarted the workers: say so, and record the count."""
    where = f"from step {step}" if step else "from the start (no checkpoint yet)"
    reporter.say(f"restart {restarts} after a worker failure: continuing {where}")
    reporter.record({"fault/restarts": float(restarts)}, step)


def memory_table(ranks: list[dict[str, Any]], *, title: str) -> Table:
    table = Table(title=title, title_justify="left")
    keys = [k for k in ranks[0] if k != "rank"]
    table.add_column("rank", justify="right")
    for key in keys:
        table.add_column(key, justify="right")
    for r in ranks:
        table.add_row(str(r["rank"]), *(_format_value(k, r.get(k)) for k in keys))
    return table


def _format_value(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if key.startswith("bubble"):
        return f"{value:.1%}"
    if isinstance(value, int | float):
        return human_bytes(float(value))
    return str(value)


class Reporter:
    """Everything the loop reports goes through one of these. On rank 0 it writes the trackers
    (metrics.jsonl, MLflow) and the progress display; on every other rank it does nothing, so
    the loop never asks which rank it is on."""

    def __init__(
        self, tracker: Tracker | None = None, display: ProgressDisplay | None = None
    ) -> None:
        self.tracker, self.display = tracker, display

    def progress(self, stats: dict[str, float], step: int) -> None:
        """A reporting window's metrics: recorded, and shown in the progress line."""
        self.record(stats, step)
        if self.display is not None:
            self.display.update(step, stats)

    def record(self, metrics: dict[str, float], step: int) -> None:
        """Metrics recorded, not shown."""
        if self.tracker is not None:
            self.tracker.log_metrics(metrics, step)

    def evaluation(self, metrics: dict[str, float], step: int) -> None:
        """An evaluation's metrics: recorded and printed on a line of their own."""
        self.record(metrics, step)
        if self.display is not None:
            self.display.report(step, metrics)

    def artifact(self, path: Path) -> None:
        """A file or directory for the trackers that keep files (MLflow)."""
        if self.tracker is not None:
            self.tracker.log_artifact(path)

    def say(self, text: str) -> None:
        if self.display is not None:
            self.display.print(text)

    def table(self, table: Table) -> None:
        if self.display is not None:
            self.display.print_table(table)

    def mlflow_run_id(self) -> str | None:
        if isinstance(self.tracker, Trackers):
            for t in self.tracker.trackers:
                if isinstance(t, MlflowTracker):
                    return t.run_id
        return None

    def close(self, status: str) -> None:
        """`status` is `FINISHED`, `KILLED` or `FAILED`."""
        if self.display is not None:
            self.display.close()
        if self.tracker is not None:
            self.tracker.close(status)


def start(
    run: Run, start: int, *, resumed: bool, reporting: bool | None = None, announce: bool = True
) -> Reporter:
    """On rank 0 (or where `reporting`: a live replica that reports): print the resolved config
    and derived numbers (unless not `announce`: a replica taking the reporting over), save
    them, open the trackers. Elsewhere: a reporter that does nothing."""
    if not (run.rank == 0 if reporting is None else reporting):
        return Reporter()
    cfg, derived = run.config, run.derived
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    config_toml = tomli_w.dumps(redacted_dump(cfg, exclude_none=True))
    (cfg.run_dir / "config.toml").write_text(config_toml)
    console = terminal()
    if not announce:
        return _open_trackers(run, start, config_toml, console, resumed=resumed)
    console.print(f"resolved config (saved to {cfg.run_dir / 'config.toml'}):", highlight=False)
    console.print(config_toml, highlight=False, markup=False, soft_wrap=True)
    derived_text = derived_line(derived, run.tokens_per_sample, live=run.live is not None)
    console.print(derived_text, highlight=False, soft_wrap=True)
    for line in run.layout.applied:
        console.print(f"layout: {line}", highlight=False, soft_wrap=True)
    for note in run.notes:
        console.print(note, highlight=False, soft_wrap=True)
    console.print(utilisation_line(run.utilisation), highlight=False, soft_wrap=True)
    pipe = run.layout.pipeline
    if pipe is not None:
        stages = ", ".join(
            f"stage {s} on pp rank {pipe.owner[s]}: {span(names)}"
            for s, names in sorted(pipe.block_names.items())
        )
        console.print(f"pipeline {pipe.schedule_name}: {stages}", highlight=False, soft_wrap=True)
    if resumed:
        console.print(f"resuming after step {start}", highlight=False)
    return _open_trackers(run, start, config_toml, console, resumed=resumed)


def _open_trackers(
    run: Run, start: int, config_toml: str, console: Any, *, resumed: bool
) -> Reporter:
    cfg, derived = run.config, run.derived
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
    for dataset in run.inputs:
        tracker.log_input(dataset)
    display = ProgressDisplay(total_steps=cfg.train.steps, start_step=start, console=console)
    return Reporter(tracker, display)


def utilisation_line(utilisation: Utilisation | str | None) -> str:
    if isinstance(utilisation, Utilisation):
        return f"utilisation: {utilisation.describe()}; MFU = model FLOPs / time / peak"
    return f"utilisation: MFU is not reported: {utilisation or 'not measured'}"


def run_report(reporter: Reporter, run_dir: Path) -> None:
    """Write the run report (tracking/run_report.py) and log its directory to MLflow; a report
    that cannot be written is said, and the run still succeeds."""
    from shardwise.training.tracking.run_report import write_report

    try:
        page = write_report(run_dir)
    except (OSError, ValueError, RuntimeError) as e:
        reporter.say(f"the run report could not be written ({e}); `shardwise report` retries")
        return
    reporter.artifact(page.parent)
    reporter.say(f"report: {page}")


def holds(layout: Layout) -> str:
    pipe = layout.pipeline
    if pipe is None:
        return "the whole model"
    return "; ".join(f"stage {s}: {span(pipe.block_names[s])}" for s in sorted(pipe.modules))


def terminal() -> Console:
    """Rich output; wide when not a terminal (logs and pipes have no width to fit)."""
    return Console() if sys.stdout.isatty() else Console(width=120)


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
        system_metrics_s=cfg.tracking.system_metrics_s,
    )


def derived_line(derived: Derived, tokens_per_sample: int, *, live: bool = False) -> str:
    """What follows from the config and the world size, in one line. `live`: the world is one
    replica's (fault.mode = "live"), and how much of each step a replica runs follows how many
    replicas are alive: said so, not as one replica's accumulation of the whole batch."""
    pipelined = derived.degrees["pp"] > 1
    shared = " shared among the replicas alive" if live else ""
    if live and pipelined:
        shared += f", in whole micro-batches ({derived.grad_accum} a step)"
    parts = [
        f"{'each live replica: ' if live else ''}world size {derived.world_size}",
        "mesh " + " × ".join(f"{a}={d}" for a, d in derived.degrees.items()),
        f"global batch {derived.global_batch}{shared}",
        f"micro batch {derived.micro_batch}",
    ]
    if pipelined:
        if not live:
            parts.append(f"pipeline micro-batches {derived.grad_accum}")
        parts.append(f"stages per rank {derived.stages_per_rank}")
    elif not live:
        parts.append(f"gradient accumulation {derived.grad_accum}")
    parts += [f"samples/step {derived.global_batch}", f"lr {derived.lr:.3g}"]
    if tokens_per_sample > 1:
        parts.append(f"tokens/step {derived.global_batch * tokens_per_sample:,}")
    return "derived: " + ", ".join(parts)


def dry_run_table(
    ranks: list[dict[str, Any]], derived: Derived, layout: Layout, tokens: int
) -> None:
    """Print what each rank of a dry run holds."""
    console = terminal()
    console.print(derived_line(derived, tokens), highlight=False)
    console.print(f"data-parallel wrapper: {layout.wrapper}", highlight=False)
    for line in layout.applied:
        console.print(f"layout: {line}", highlight=False, soft_wrap=True)
    table = Table(title="dry run: what each rank holds (nothing was allocated)")
    for column in ("rank", "mesh", "blocks", "params", "grads", "optimizer"):
        left = column in ("mesh", "blocks")
        table.add_column(column, justify="left" if left else "right", no_wrap=True)
    for r in ranks:
        table.add_row(
            str(r["rank"]),
            r["coordinates"],
            r["holds"],
            *(human_bytes(r[k]) for k in ("params", "grads", "optimizer")),
        )
    console.print(table)
    total = {k: sum(r[k] for r in ranks) for k in ("params", "grads", "optimizer")}
    console.print(
        "all ranks: " + ", ".join(f"{k} {human_bytes(v)}" for k, v in total.items()),
        highlight=False,
    )
