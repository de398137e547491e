"""`launch.outcome.outcome`: what a launch ended in, from what its ranks returned or raised and
the files they left in the run directory, without starting a process. Every launcher (this
machine's agent, Ray's actors, Spark's tasks) reports through it."""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from shardwise.training.launch.outcome import (
    PREEMPTED_EXIT,
    Interrupted,
    WorkerFailed,
    outcome,
)
from shardwise.training.trainer.train_summary import TrainSummary


def _summary(run_dir: Path, *, preempted: bool) -> TrainSummary:
    return TrainSummary(
        step=6,
        metrics={"loss": 1.5},
        checkpoint=str(run_dir / "checkpoints" / "step_00000006"),
        run_dir=str(run_dir),
        mlflow_run_id=None,
        samples_per_second=10.0,
        preempted=preempted,
    )


def _write_summary(run_dir: Path, *, preempted: bool, at: float | None = None) -> TrainSummary:
    summary = _summary(run_dir, preempted=preempted)
    path = run_dir / "summary.json"
    path.write_text(json.dumps(asdict(summary)))
    if at is not None:
        os.utime(path, (at, at))
    return summary


def _write_hang(run_dir: Path, rank: int, started: int, finished: int, *, at: float | None = None):
    hangs = run_dir / "hangs"
    hangs.mkdir(exist_ok=True)
    status = {"rank": rank, "last_started": started, "last_finished": finished, "idle_s": 8.0}
    stack = 'Thread 0x1 (most recent call first):\n  File "/x/loop.py", line 3 in train\n'
    path = hangs / f"rank{rank}.txt"
    path.write_text(json.dumps(status) + "\n" + stack)
    if at is not None:
        os.utime(path, (at, at))


FAILED = WorkerFailed(rank=1, exitcode=1, message="gloo: connection closed by peer", traceback="")


def test_a_run_that_returned_is_its_summary(tmp_path):
    summary = _summary(tmp_path, preempted=False)
    assert outcome(tmp_path, time.time(), summary=summary) is summary
    assert outcome(tmp_path, time.time(), summary=None) is None  # a rank other than 0


def test_a_failure_with_hang_reports_is_said_as_the_hang(tmp_path):
    started = time.time() - 5
    _write_hang(tmp_path, 0, started=5, finished=4)
    _write_hang(tmp_path, 1, started=4, finished=4)
    with pytest.raises(WorkerFailed) as info:
        outcome(tmp_path, started, failure=FAILED)
    message = str(info.value)
    assert "rank 0 waits inside step 5, which rank 1 never started" in message
    assert info.value.rank == 1 and info.value.exitcode == 1


def test_hang_reports_of_an_earlier_launch_are_not_this_ones(tmp_path):
    started = time.time()
    _write_hang(tmp_path, 0, started=5, finished=4, at=started - 3600)
    with pytest.raises(WorkerFailed) as info:
        outcome(tmp_path, started, failure=FAILED)
    assert info.value is FAILED


def test_sigterm_with_a_preempted_summary_is_that_summary(tmp_path):
    started = time.time() - 5
    summary = _write_summary(tmp_path, preempted=True)
    assert outcome(tmp_path, started, failure=Interrupted(signal.SIGTERM)) == summary
    ranks_stopped = WorkerFailed(rank=0, exitcode=PREEMPTED_EXIT, message="", traceback="")
    assert outcome(tmp_path, started, failure=ranks_stopped) == summary  # SIGTERM to the ranks


@pytest.mark.parametrize(
    ("failure", "preempted", "age_s"),
    [
        (Interrupted(signal.SIGINT), True, 0),  # Ctrl-C: stopped, not preempted
        (Interrupted(signal.SIGTERM), False, 0),  # the summary of a finished run
        (Interrupted(signal.SIGTERM), True, 3600),  # an earlier launch's summary
        (WorkerFailed(rank=0, exitcode=PREEMPTED_EXIT, message="", traceback=""), False, 0),
    ],
)
def test_a_stop_without_this_launchs_preempted_summary_is_raised(
    tmp_path, failure, preempted, age_s
):
    started = time.time() - 5
    _write_summary(tmp_path, preempted=preempted, at=time.time() - age_s if age_s else None)
    with pytest.raises(type(failure)) as info:
        outcome(tmp_path, started, failure=failure)
    assert info.value is failure


def test_an_interrupt_is_never_replaced_by_a_hang(tmp_path):
    started = time.time() - 5
    _write_hang(tmp_path, 0, started=5, finished=4)
    stop = Interrupted(signal.SIGINT)
    with pytest.raises(Interrupted) as info:
        outcome(tmp_path, started, failure=stop)
    assert info.value is stop
