"""The one place that reads launcher environment variables (torchrun / torch elastic, Slurm,
Kubeflow's training operator).

Everything else receives a `WorkerEnv`. This module must not import torch or start anything, so it
can be unit-tested with a plain dict standing in for `os.environ`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerEnv:
    """Who this process is in a job that something else started."""

    launcher: str
    """`torchrun` (torch elastic, including `shardwise --nproc`) or `slurm` (`srun`)."""
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    init_method: str
    """How to reach the rendezvous: `env://` under torch elastic, `tcp://host:port` under Slurm."""
    restart_count: int = 0
    """How many times torch elastic has restarted the worker group (0 on the first attempt)."""
    master_addr: str = ""
    master_port: int = 0
    agent_store: bool = False
    """torch elastic's agent hosts the job's TCPStore at master_addr:master_port."""
    node: int = 0
    """The index of the machine this worker runs on (torch elastic's group rank, Slurm's node
    id): ranks with the same `node` share a machine."""


def detect(environ: Mapping[str, str] | None = None) -> WorkerEnv | None:
    """This worker's place in a job something else launched; None if we must launch workers."""
    env = os.environ if environ is None else environ
    pod = "PET_NNODES" in env  # Kubeflow: RANK and WORLD_SIZE count pods, each a node's agent
    if "TORCHELASTIC_RUN_ID" in env or (
        not pod and all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
    ):
        world = int(env["WORLD_SIZE"])
        return WorkerEnv(
            launcher="torchrun",
            rank=int(env["RANK"]),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            world_size=world,
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", str(world))),
            init_method="env://",
            restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
            master_addr=env.get("MASTER_ADDR", ""),
            master_port=int(env.get("MASTER_PORT", "0")),
            agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
            node=int(env.get("GROUP_RANK", "0")),
        )
    # `srun` sets SLURM_STEP_NUM_TASKS for each task of a job step; a batch script alone does not,
    # so `shardwise train --nproc N` inside `sbatch` still launches its own workers.
    if int(env.get("SLURM_STEP_NUM_TASKS", "1")) > 1 and "SLURM_PROCID" in env:
        host = env.get("MASTER_ADDR") or first_host(env["SLURM_STEP_NODELIST"])
        # Every task must agree on the port without talking to the others first, so it is derived
        # from the job id unless the user exports MASTER_PORT.
        port = int(env.get("MASTER_PORT") or 20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000)
        tasks_per_node = env.get("SLURM_STEP_TASKS_PER_NODE", "1").split("(")[0].split(",")[0]
        return WorkerEnv(
            launcher="slurm",
            rank=int(env["SLURM_PROCID"]),
            local_rank=int(env.get("SLURM_LOCALID", "0")),
            world_size=int(env["SLURM_STEP_NUM_TASKS"]),
            local_world_size=int(tasks_per_node),
            init_method=f"tcp://{host}:{port}",
            node=int(env.get("SLURM_NODEID", "0")),
        )
    return None


@dataclass(frozen=True)
class KubeflowPod:
    """A pod of a Kubeflow TrainJob (torch runtime) or PyTorchJob with `nprocPerNode`: one node of
    the job, whose agent meets the others at the master's address (the `PET_*` variables the
    operator sets for torchrun)."""

    nnodes: int
    nproc_per_node: int | None
    """None for `auto`: one rank per GPU, or one on a CPU."""
    node_rank: int
    master_addr: str
    master_port: int

    @property
    def endpoint(self) -> str:
        return f"{self.master_addr}:{self.master_port}"


def kubeflow(environ: Mapping[str, str] | None = None) -> KubeflowPod | None:
    """This pod's place in a Kubeflow job, or None outside one."""
    env = os.environ if environ is None else environ
    if "PET_NNODES" not in env or "TORCHELASTIC_RUN_ID" in env:
        return None
    nproc = env.get("PET_NPROC_PER_NODE", "auto")
    return KubeflowPod(
        nnodes=int(env["PET_NNODES"].split(":")[-1]),  # elastic jobs give MIN:MAX
        nproc_per_node=None if nproc == "auto" else int(nproc),
        node_rank=int(env.get("PET_NODE_RANK", "0")),
        master_addr=env.get("PET_MASTER_ADDR") or env.get("MASTER_ADDR", ""),
        master_port=int(env.get("PET_MASTER_PORT") or env.get("MASTER_PORT") or 29400),
    )


def first_host(nodelist: str) -> str:
    """The first host of a Slurm hostlist such as `gpu[003-005,9],cpu1` (→ `gpu003`)."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise ValueError(f"cannot read the Slurm node list {nodelist!r}")
    prefix, ranges = match.groups()
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first
