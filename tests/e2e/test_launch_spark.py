"""`shardwise launch spark` on Spark's local-cluster mode: a master and two executors in their own
JVMs and Python workers, as on a cluster; the job's two ranks are the tasks of one barrier stage
(pyspark's TorchDistributor). Rank 1 SIGKILLs itself after step 6: the stage fails, shardwise
runs it again, the ranks resume from step 4, and the run ends bitwise like the same job on one
machine without a failure.

The launch listens on loopback only (read from /proc all through the run, as `ss -ltnp` shows
it). Spark's master, workers and executors (their RPC servers and block managers) bound to the
host's network address, some to every address; TorchDistributor then checked the free port for
the ranks' store on loopback alone, so that store could collide with them. Two servers pyspark
and torchrun start still listen on every address (docs/launchers.md: `launch spark`):
TorchDistributor's log server in the driver and torchrun's rendezvous store."""

from __future__ import annotations

import os

import pytest

import shardwise
from helpers import assert_bitwise_same_run, gpt_job, launch_on_two_nodes, not_on_loopback

pytestmark = pytest.mark.slow
STEPS = 12
SECTIONS = {
    "job": {"threads_per_rank": 1},
    "train": {"steps": STEPS},
    "checkpoint": {"every_steps": 4},
    "fault": {"max_restarts": 1},
}


def test_the_ranks_run_as_spark_barrier_tasks_on_two_executors(tmp_path):
    reference = shardwise.train(gpt_job(tmp_path / "reference", **SECTIONS), nproc=2)
    assert reference is not None
    # the model is logged once the ranks are done, by the launching process, as `train` does
    logged = {"mlflow": True, "log_model": True, "registered_model": "gpt-on-spark"}
    config = gpt_job(tmp_path / "run", **SECTIONS, tracking=logged)
    fault = {"SHARDWISE_FAULT": "kill:rank=1:step=6"}
    listening: dict[tuple[str, int], str] = {}
    done = launch_on_two_nodes(
        "spark", config, tmp_path / "job.toml", env={**os.environ, **fault}, listening=listening
    )
    # the ranks' output (streamed to stderr) ends with what failed: keep the end of it
    assert done.returncode == 0, done.stdout + done.stderr[-8000:]
    assert "the Spark stage failed" in done.stdout and "running it again (1 of 1)" in done.stdout
    assert f"done: step {STEPS}" in done.stdout
    assert "mlflow model: models:/gpt-on-spark/1" in done.stdout
    assert "resuming after step 4" in done.stdout + done.stderr  # the ranks' output
    assert_bitwise_same_run(tmp_path / "run", tmp_path / "reference", STEPS)
    # Spark's driver, master, worker and executors, the stores and gloo
    assert len(listening) >= 12, listening
    known = ("shardwise launch spark", "torch.distributed.run")
    exposed = not_on_loopback(listening)
    assert [s for s in exposed if not any(k in listening[s] for k in known)] == [], listening
