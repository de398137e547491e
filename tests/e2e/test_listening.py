"""A training run on one machine listens on loopback only: the rendezvous store, rank 0's store
and gloo, measured from /proc while the job runs (what `ss -ltnp` shows). The same is checked
during the runs of other tests: many-models' local Ray and Spark in
tests/e2e/test_cli_many_models.py (`test_us_employment_with_spark_features`), `launch spark`'s
local cluster in tests/e2e/test_launch_spark.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import listening_sockets, not_on_loopback

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]


def sockets_while_running(command: list[str], ready: str, expect: int) -> list:
    """Start `command`, wait for a line containing `ready` and then for at least `expect`
    listening sockets, and return them; the job is stopped."""
    proc = subprocess.Popen(
        command,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if ready in line:
                break
        deadline = time.monotonic() + 30
        found = listening_sockets(proc.pid)
        while len(found) < expect and time.monotonic() < deadline:
            time.sleep(0.5)
            found = listening_sockets(proc.pid)
        return found
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _digits(run_dir: Path, *more: str) -> list[str]:
    """`shardwise train examples/digits.toml` on 2 processes, long enough to be looked at."""
    sets = [f"job.run_dir={run_dir}", "train.steps=1000000", "tracking.log_every=10"]
    sets += ["tracking.mlflow=false", *more]
    command = [str(BIN / "shardwise"), "train", "examples/digits.toml", "--nproc", "2"]
    return command + [part for pair in sets for part in ("--set", pair)]


def test_a_training_run_listens_on_loopback_only(tmp_path):
    found = sockets_while_running(
        _digits(tmp_path),
        ready="step ",
        expect=3,  # at least the rendezvous store, rank 0's store and gloo
    )
    assert len(found) >= 3, found
    assert not_on_loopback((a, p) for a, p, _ in found) == [], found


def test_live_replicas_listen_on_loopback_only(tmp_path):
    """fault.mode = "live": the supervisor's store and each generation's gloo groups."""
    found = sockets_while_running(
        _digits(tmp_path, "fault.mode=live"),
        ready="step ",
        expect=2,  # at least the supervisor's store and a gloo group's
    )
    assert len(found) >= 2, found
    assert not_on_loopback((a, p) for a, p, _ in found) == [], found
