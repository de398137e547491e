"""What a launch ended in, whichever launcher ran its ranks (this machine's agent, Ray's actors,
Spark's tasks): the summary rank 0 returned, or the failure to report, read together with what
the ranks left in the run directory. A rank that stopped on SIGTERM after saving wrote a
preempted `summary.json`: the run was preempted, not failed. Ranks the watchdog found stalled
wrote `hangs/rank<r>.txt`: the failure is said as the hang (who waits for whom, and where each
rank is), not as the broken collective that ended them.

`outcome` starts nothing and changes nothing: it decides from its arguments and those files.
"""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass
from pathlib import Path

from shardwise.training.fault.watchdog import describe as describe_hang
from shardwise.training.trainer.train_summary import TrainSummary

PREEMPTED_EXIT = 128 + signal.SIGTERM
"""The exit code of a rank that saved a checkpoint and stopped on SIGTERM."""


@dataclass
class WorkerFailed(RuntimeError):
    """A worker process ended with an error; `rank` is the first rank that failed."""

    rank: int
    exitcode: int
    message: str
    traceback: str

    def __str__(self) -> str:
        return f"rank {self.rank} failed (exit code {self.exitcode}): {self.message}"


class Interrupted(Exception):
    """The launcher received a termination signal (Ctrl-C, `kill`); the workers were stopped."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def outcome(
    run_dir: Path,
    since: float,
    *,
    summary: TrainSummary | None = None,
    failure: WorkerFailed | Interrupted | None = None,
) -> TrainSummary | None:
    """The result of a launch that began at `since` (a `time.time()`) in `run_dir`: `summary`
    where its ranks returned; after `failure`, the preempted summary where the ranks saved and
    stopped on SIGTERM (sent to the launcher or to the ranks); else `failure` is raised, said as
    the hang where the ranks reported one during this launch."""
    if failure is None:
        return summary
    sigterm = isinstance(failure, Interrupted) and failure.signum == signal.SIGTERM
    if sigterm or (isinstance(failure, WorkerFailed) and failure.exitcode == PREEMPTED_EXIT):
        preempted = preempted_summary(run_dir, since=since)
        if preempted is not None:
            return preempted
    if isinstance(failure, WorkerFailed):
        hang = describe_hang(run_dir / "hangs", since=since)
        if hang is not None:
            raise WorkerFailed(failure.rank, failure.exitcode, hang, traceback="") from None
    raise failure


def preempted_summary(run_dir: Path, *, since: float) -> TrainSummary | None:
    """The summary rank 0 wrote when it stopped on SIGTERM after `since`, if it did."""
    path = run_dir / "summary.json"
    if not path.exists() or path.stat().st_mtime < since:
        return None
    data = json.loads(path.read_text())
    return TrainSummary(**data) if data.get("preempted") else None
