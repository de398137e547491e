"""`shardwise launch ray` on a real Ray cluster of two nodes, started by the test on loopback (a
head and a worker node, one CPU each, as `ray start` makes them): the job's two ranks are actors
spread over the two nodes. Rank 1's actor dies mid-run (it SIGKILLs itself after step 10); the
driver restarts the group, which resumes from the newest checkpoint and ends bitwise like the
same job run without a failure."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import shardwise
from helpers import assert_bitwise_same_run, free_port, gpt_job, kill_session, launch_on_two_nodes

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
STEPS = 16
SECTIONS = {
    "job": {"threads_per_rank": 1},  # as in the one-machine reference
    "train": {"steps": STEPS},
    "checkpoint": {"every_steps": 4, "keep_last": 3},
    "fault": {"max_restarts": 2},
}


@contextlib.contextmanager
def ray_cluster(env: dict[str, str]):
    """A head and one worker node on loopback, one CPU each; stopped (every process of their
    sessions) at the end."""
    port = free_port()
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: unix socket paths are limited
    common = ["--block", "--node-ip-address=127.0.0.1", "--num-cpus=1", "--disable-usage-stats"]
    head = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", f"--port={port}", "--include-dashboard=false",
         f"--temp-dir={temp}", *common],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
        start_new_session=True, env=env,
    )  # fmt: skip
    nodes = [head]
    try:
        _wait_for_port(port)  # the worker node joins through the head's GCS
        worker = subprocess.Popen(
            [str(BIN / "ray"), "start", f"--address=127.0.0.1:{port}", *common],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
            start_new_session=True, env=env,
        )  # fmt: skip
        nodes.append(worker)
        alive = (
            "import ray, time; ray.init(address='127.0.0.1:{port}', logging_level='ERROR')\n"
            "deadline = time.monotonic() + 60\n"
            "while sum(n['Alive'] for n in ray.nodes()) < 2 and time.monotonic() < deadline:\n"
            "    time.sleep(0.2)\n"
            "print(sum(n['Alive'] for n in ray.nodes()))"
        )
        joined = subprocess.run(
            [sys.executable, "-c", alive.format(port=port)],
            capture_output=True, text=True, timeout=120, env=env,
        )  # fmt: skip
        assert joined.stdout.strip() == "2", joined.stderr
        yield f"127.0.0.1:{port}"
    finally:
        for node in reversed(nodes):
            node.terminate()
            node.wait(timeout=60)
            kill_session(node.pid)
        shutil.rmtree(temp, ignore_errors=True)


def _wait_for_port(port: int) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            assert time.monotonic() < deadline, "the Ray head did not start"
            time.sleep(0.2)


def test_a_dead_actor_restarts_the_group_and_the_run_ends_bitwise(tmp_path):
    reference = shardwise.train(gpt_job(tmp_path / "reference", **SECTIONS), nproc=2)
    assert reference is not None
    # the model is logged once the ranks are done, by the launching process, as `train` does
    logged = {"mlflow": True, "log_model": True, "registered_model": "gpt-on-ray"}
    config = gpt_job(tmp_path / "run", **SECTIONS, tracking=logged)
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    with ray_cluster(env) as address:
        done = launch_on_two_nodes(
            "ray", config, tmp_path / "job.toml", "--ray-address", address, "--placement",
            "spread", env={**env, "SHARDWISE_FAULT": "kill:rank=1:step=10"},
        )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "rank 1: " in done.stdout and "restarting the group (1 of 2)" in done.stdout
    assert f"done: step {STEPS}" in done.stdout
    assert "mlflow model: models:/gpt-on-ray/1" in done.stdout
    assert_bitwise_same_run(tmp_path / "run", tmp_path / "reference", STEPS)


def test_a_group_out_of_restarts_fails_in_one_line(tmp_path):
    """The last attempt's failure is what the command says, in one line (exit code 1), not a
    Python traceback; the checkpoints written before it are kept."""
    sections = {**SECTIONS, "train": {"steps": 8}, "fault": {"max_restarts": 0}}
    config = gpt_job(tmp_path / "run", **sections)
    fault = {"RAY_AUTH_MODE": "disabled", "SHARDWISE_FAULT": "kill:rank=1:step=5"}
    done = launch_on_two_nodes("ray", config, tmp_path / "job.toml", env={**os.environ, **fault})
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("shardwise: rank 1 failed"), done.stderr
    assert (tmp_path / "run" / "checkpoints" / "step_00000004").is_dir()


def test_a_stalled_rank_on_ray_is_reported_as_the_hang(tmp_path):
    """As on this machine (test_faults.py): a rank that stops making progress is said as the
    watchdog's reports say it (no progress for fault.timeout_s, and where the ranks are), not
    as the actor's death that ended it."""
    sections = {**SECTIONS, "train": {"steps": 8}, "fault": {"max_restarts": 0, "timeout_s": 8}}
    config = gpt_job(tmp_path / "run", **sections)
    fault = {"RAY_AUTH_MODE": "disabled", "SHARDWISE_FAULT": "stall:rank=1:step=4"}
    done = launch_on_two_nodes("ray", config, tmp_path / "job.toml", env={**os.environ, **fault})
    assert done.returncode == 1, done.stdout + done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert "no progress for" in last and "(fault.timeout_s)" in last, done.stderr
    assert "after step 4 is at" in last and str(tmp_path / "run" / "hangs") in last
