"""A pod of a Kubeflow job joins it from the environment the operator injects: two simulated
machines (network namespaces, tests/netns.py), each running the command the rendered manifests
give their containers (`shardwise train JOB --resume auto --local-addr $POD_IP`) with only the
PET_* variables (and PyTorchJob's MASTER_ADDR/RANK/WORLD_SIZE, which count pods) to say which
job it is part of. They form one 2-rank job, and it trains exactly like the same job on one
machine."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tomli_w

import shardwise
from helpers import assert_bitwise_same_run, gpt_job

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
STEPS = 12


def test_two_pods_with_kubeflows_environment_form_one_job(tmp_path):
    from netns import two_nodes

    # one thread per rank, as a rank alone on its "node" would otherwise sum in another order
    sections = {"job": {"threads_per_rank": 1}, "train": {"steps": STEPS}}
    reference = shardwise.train(gpt_job(tmp_path / "one-machine", **sections), nproc=2)
    assert reference is not None
    job = tmp_path / "job.toml"
    config = gpt_job(tmp_path / "run", **sections)
    job.write_text(tomli_w.dumps(config.model_dump(mode="json", exclude_none=True)))
    with two_nodes() as (a, b):
        port = a.free_port()
        started = []
        for rank, node in enumerate((a, b)):
            pod = {  # what the training operator sets (PyTorchJob with nprocPerNode: 1)
                "PET_NNODES": "2",
                "PET_NPROC_PER_NODE": "1",
                "PET_NODE_RANK": str(rank),
                "PET_MASTER_ADDR": a.addr,
                "PET_MASTER_PORT": str(port),
                "MASTER_ADDR": a.addr,
                "MASTER_PORT": str(port),
                "WORLD_SIZE": "2",
                "RANK": str(rank),
                "POD_IP": node.addr,
                "GLOO_SOCKET_IFNAME": node.interface,
            }
            command = [
                str(Path(sys.executable).parent / "shardwise"), "train", str(job),
                "--resume", "auto", "--local-addr", node.addr,
            ]  # fmt: skip
            started.append(
                subprocess.Popen(
                    node.command("env", *(f"{k}={v}" for k, v in pod.items()), *command),
                    cwd=REPO,
                    env={k: v for k, v in os.environ.items() if not k.startswith("SHARDWISE_")},
                    stdout=(tmp_path / f"{node.namespace}.out").open("w"),
                    stderr=(tmp_path / f"{node.namespace}.err").open("w"),
                )
            )
        deadline = time.monotonic() + 240
        for process in started:
            process.wait(timeout=max(1.0, deadline - time.monotonic()))
        outputs = [
            (
                (tmp_path / f"{n.namespace}.out").read_text(),
                (tmp_path / f"{n.namespace}.err").read_text(),
            )
            for n in (a, b)
        ]
    for process, (_, err) in zip(started, outputs, strict=True):
        assert process.returncode == 0, err
    assert sum(f"done: step {STEPS}" in out for out, _ in outputs) == 1
    assert any("world size 2" in out for out, _ in outputs), outputs
    assert_bitwise_same_run(tmp_path / "run", tmp_path / "one-machine", STEPS)
