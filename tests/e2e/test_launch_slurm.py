"""`shardwise launch slurm` against a real Slurm started on this machine (tests/slurm.py): jobs
of two Slurm nodes, each running one shardwise agent with one rank. Every node is this machine,
so the run's directory is shared in fact, though on a local disk: hence --shared-storage.

A job submitted with --submit trains to the end; a job that `scontrol requeue` stops mid-run
saves at a step boundary, is requeued by Slurm, resumes with --resume auto and ends bitwise equal
to the uninterrupted job: same losses at every step, same parameters. The slowed steps
(SHARDWISE_FAULT) are slow on a job's first attempt only, as every injected fault.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tomli_w
import torch

import slurm
from helpers import free_port, gpt_job, load_params, losses

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(slurm.missing() is not None, reason=slurm.missing() or ""),
]
SHARDWISE = str(Path(sys.executable).with_name("shardwise"))
STEPS = 40
SECTIONS = {
    "train": {"steps": STEPS},
    "checkpoint": {"every_steps": 4, "keep_last": 3},
    "fault": {"check_interval_s": 0},  # the ranks look for SIGTERM at every step
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Four Slurm nodes: two jobs of two nodes each run at once."""
    with slurm.cluster(tmp_path_factory.mktemp("slurm"), nodes=4) as running:
        yield running


def submit(cluster: slurm.Slurm, run_dir: Path, *extra: str, step_s: float = 0.15) -> str:
    job = run_dir.with_suffix(".toml")
    config = gpt_job(run_dir, **SECTIONS)
    job.write_text(tomli_w.dumps(config.model_dump(mode="json", exclude_none=True)))
    env = {**cluster.env, "SHARDWISE_FAULT": f"slow:step=1:seconds={step_s}"}  # every rank alike
    done = subprocess.run(
        [SHARDWISE, "launch", "slurm", str(job), "--nodes", "2", "--nproc-per-node", "1",
         "--shared-storage", "--port", str(free_port()), "--submit", *extra],
        env=env, cwd=run_dir.parent, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.strip()
    assert job_id.isdigit() and f"submitted Slurm job {job_id}" in done.stderr
    return job_id


def output(run_dir: Path, job_id: str) -> str:
    return (run_dir / "launch" / f"slurm-{job_id}.out").read_text()


def test_a_requeued_job_resumes_and_ends_bitwise_like_an_uninterrupted_one(cluster, tmp_path):
    """The uninterrupted job runs beside the one that is requeued, on the other two nodes."""
    straight = tmp_path / "straight"
    straight_id = submit(cluster, straight)
    requeued = tmp_path / "requeued"
    job_id = submit(cluster, requeued)
    checkpoints = requeued / "checkpoints"
    deadline = time.monotonic() + 180
    while not (checkpoints / "step_00000012").exists():
        assert time.monotonic() < deadline, output(requeued, job_id)
        time.sleep(0.2)
    cluster.run("scontrol", "requeue", job_id)
    cluster.wait(job_id, {"PENDING"}, timeout=120)
    # Slurm holds a requeued job back until its credential expires (10 s in the test cluster)
    job = cluster.wait(job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, timeout=300)
    log = output(requeued, job_id)
    assert job["JobState"] == "COMPLETED" and job["Restarts"] == "1", log
    done = cluster.wait(straight_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, timeout=300)
    assert done["JobState"] == "COMPLETED", output(straight, straight_id)
    assert done["NumNodes"] == "2" and job["NumNodes"] == "2"
    assert "attempt 1," in log and "attempt 2," in log
    # the batch script ran to its end once the ranks had saved, not until Slurm's SIGKILL
    # (KillWait) cut it short
    assert f"requeueing job {job_id}" in log, log

    # the ranks saved at a step boundary on Slurm's SIGTERM, and the next attempt resumed there
    stopped = re.search(r"SIGTERM: saved \S+ at step (\d+) and stopping", log)
    assert stopped and 12 <= int(stopped.group(1)) < STEPS, log
    assert f"resuming after step {stopped.group(1)}" in log
    want, got = losses(straight), losses(requeued)
    assert [got[s] for s in range(1, STEPS + 1)] == [want[s] for s in range(1, STEPS + 1)]
    final = f"checkpoints/step_{STEPS:08d}"
    want_params, got_params = load_params(straight / final), load_params(requeued / final)
    for name, value in want_params.items():
        assert torch.equal(got_params[name], value), name


def test_without_sbatch_submission_is_one_line(tmp_path):
    job = tmp_path / "job.toml"
    config = gpt_job(tmp_path / "run", **SECTIONS)
    job.write_text(tomli_w.dumps(config.model_dump(mode="json", exclude_none=True)))
    env = {**os.environ, "PATH": str(Path(sys.executable).parent)}
    done = subprocess.run(
        [SHARDWISE, "launch", "slurm", str(job), "--submit"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.startswith("shardwise: error: sbatch not found") and "\n" not in (
        done.stderr.strip()
    )


def test_the_time_limit_warning_saves_and_the_script_requeues_the_job(cluster, tmp_path):
    """The script's own path: the job asks for SIGTERM 120 s before its time limit. Once it
    trains, the test brings that limit down to two minutes from the start, so the warning is due
    at once: Slurm sends it at its next periodic check, within about 30 s, while about 50 s of
    training remain (with the limit given at submission the signal could come before the first
    step on a loaded machine, or the test would wait a minute for it). The batch shell forwards
    it, the ranks save, and the script requeues the job, whose next attempt (given time now)
    resumes there and finishes."""
    run_dir = tmp_path / "limited"
    job_id = submit(cluster, run_dir, "--time", "00:10:00", "--signal-seconds", "120", step_s=1.5)
    deadline = time.monotonic() + 180
    while not (run_dir / "checkpoints" / "step_00000004").exists():
        assert time.monotonic() < deadline, output(run_dir, job_id)
        time.sleep(0.2)
    cluster.run("scontrol", "update", f"JobId={job_id}", "TimeLimit=2")
    job = cluster.wait(job_id, {"PENDING", "COMPLETED", "FAILED", "TIMEOUT"}, timeout=240)
    log = output(run_dir, job_id)
    assert job["JobState"] == "PENDING", log  # requeued, by the script
    assert f"requeueing job {job_id}" in log
    # the next attempt gets time to finish; Slurm starts it once the requeued job's credential
    # has expired (10 s in the test cluster: starting it earlier fails its launch)
    cluster.run("scontrol", "update", f"JobId={job_id}", "TimeLimit=10")
    job = cluster.wait(job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, timeout=300)
    log = output(run_dir, job_id)
    keys = ("JobState", "Reason", "ExitCode", "Restarts", "RunTime", "TimeLimit", "BatchHost")
    assert job["JobState"] == "COMPLETED", (
        {k: job.get(k) for k in keys},
        log[-3000:],
        cluster.controller_log(job_id),
    )
    stopped = re.search(r"SIGTERM: saved \S+ at step (\d+) and stopping", log)
    assert stopped and int(stopped.group(1)) < STEPS, log
    assert f"resuming after step {stopped.group(1)}" in log
    assert (run_dir / "checkpoints" / f"step_{STEPS:08d}").exists()
