"""A run on one machine listens on loopback only: the rendezvous store, rank 0's store, gloo,
many-models' local Ray and Spark, and `launch spark`'s local cluster, measured from /proc while
the job runs (what `ss -ltnp` shows)."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import listening_sockets

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]


def exposed(sockets: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """The sockets listening on an address other than loopback."""
    found = []
    for address, port, pid in sockets:
        ip = ipaddress.ip_address(address)
        mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1
        if not (ip.is_loopback or (mapped is not None and mapped.is_loopback)):
            found.append((address, port, pid))
    return found


def sockets_while_running(
    command: list[str], ready: str, expect: int, commands: dict[int, str] | None = None
) -> list:
    """Start `command`, wait for a line containing `ready` and then for at least `expect`
    listening sockets, and return them (and, in `commands`, the command line of each process
    they belong to); the job is stopped."""
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
        for pid in {pid for _, _, pid in found} if commands is not None else ():
            with contextlib.suppress(OSError):
                commands[pid] = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
        return found
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_a_training_run_listens_on_loopback_only(tmp_path):
    found = sockets_while_running(
        [
            str(BIN / "shardwise"),
            "train",
            "examples/digits.toml",
            "--nproc",
            "2",
            "--set",
            f"job.run_dir={tmp_path}",
            "--set",
            "train.steps=1000000",
            "--set",
            "tracking.log_every=10",
            "--set",
            "tracking.mlflow=false",
        ],
        ready="step ",
        expect=3,  # at least the rendezvous store, rank 0's store and gloo
    )
    assert len(found) >= 3, found
    assert exposed(found) == [], found


def test_many_models_with_local_ray_and_spark_listens_on_loopback_only(tmp_path):
    found = sockets_while_running(
        [
            str(BIN / "shardwise"),
            "many-models",
            "examples/retail-synthetic.toml",
            "--set",
            f"job.run_dir={tmp_path}",
            "--set",
            "tracking.mlflow=false",
            "--features-backend",
            "spark",
            "--spark-master",
            "local[1]",
        ],
        ready="features (spark",  # "(spark, from the driver's copy)" for a built-in source
        expect=5,  # at least Ray's GCS, the raylet's two servers, the driver and one worker
    )
    assert len(found) >= 5, found
    assert exposed(found) == [], found


def test_a_spark_launch_on_a_local_cluster_listens_on_loopback_only(tmp_path):
    """Spark's master, workers and executors (their RPC servers and block managers) bound to
    the host's network address, some to every address; TorchDistributor then checked the free
    port for the ranks' store on loopback alone, so that store could collide with them. Two
    servers pyspark and torchrun start still listen on every address (docs/launchers.md:
    `launch spark`): TorchDistributor's log server in the driver and torchrun's rendezvous
    store."""
    commands: dict[int, str] = {}
    found = sockets_while_running(
        [str(BIN / "shardwise"), "launch", "spark", "examples/digits.toml", "--nodes", "2",
         "--nproc-per-node", "1", "--shared-storage", "--set", f"job.run_dir={tmp_path}",
         "--set", "train.steps=1000000", "--set", "tracking.log_every=10",
         "--set", "tracking.mlflow=false"],
        ready="step ",
        expect=12,  # Spark's driver, master, worker and executors, the stores and gloo
        commands=commands,
    )  # fmt: skip
    assert len(found) >= 12, found
    known = ("shardwise launch spark", "torch.distributed.run")
    unknown = [s for s in exposed(found) if not any(k in commands.get(s[2], "") for k in known)]
    assert unknown == [], (unknown, commands)
