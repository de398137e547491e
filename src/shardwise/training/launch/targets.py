"""What every cluster launcher (`shardwise launch slurm`, …) checks before it submits anything: the
job against the ranks the target will run (its mesh, its model, its layout), and a checkpoint
directory that every node can see."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from shardwise.common.errors import ConfigError
from shardwise.training.checkpoint.disk_layout import is_local
from shardwise.training.config.schema import JobConfig

NETWORK_FILESYSTEMS = frozenset(
    {
        "nfs", "nfs4", "lustre", "gpfs", "beegfs", "ceph", "cephfs", "glusterfs", "cifs",
        "smb3", "smbfs", "wekafs", "panfs", "afs", "orangefs", "pvfs2", "9p", "virtiofs",
        "fuse.glusterfs", "fuse.sshfs", "fuse.gcsfuse", "fuse.s3fs", "fuse.juicefs",
        "fuse.mountpoint-s3", "fuse.cephfs", "fuse.weka",
    }
)  # fmt: skip
"""Filesystem types (as /proc/mounts names them) that other machines can mount too."""

T = TypeVar("T")


@dataclass(frozen=True)
class Target:
    """A job as a cluster will run it: `nodes` machines, `per_node` ranks on each (one per GPU
    when `gpus_per_node`)."""

    job: Path
    """The job file, absolute: the nodes read it."""
    config: JobConfig
    """The job with the launch's `--set` overrides applied."""
    overrides: tuple[str, ...]
    nodes: int
    per_node: int
    gpus_per_node: int = 0

    @property
    def world_size(self) -> int:
        return self.nodes * self.per_node


def check_target(target: Target) -> None:
    """Before submission: the job's layout on `target.world_size` ranks (the mesh, the model, its
    blocks) and GPUs for a GPU job; ConfigError in one line otherwise."""
    from shardwise.training.run import check_job

    try:
        check_job(target.config, target.world_size, target.per_node, devices_here=False)
    except ConfigError as e:
        raise ConfigError(
            f"--nodes {target.nodes} × {target.per_node} ranks per node: {e}"
        ) from None
    device = target.config.job.device
    if device == "cuda" and not target.gpus_per_node:
        raise ConfigError(
            "job.device = 'cuda' but no GPUs were asked for: add --gpus-per-node G (one rank per "
            "GPU)"
        )
    if target.gpus_per_node and device == "cpu":
        raise ConfigError(
            f"--gpus-per-node {target.gpus_per_node} with job.device = 'cpu': drop the GPUs, or "
            "set job.device = 'auto'"
        )


def check_storage(target: Target, problem: Callable[[str], str | None]) -> None:
    """The checkpoint and run directories, each as `problem` judges it (None: every node sees
    it); ConfigError naming the first that fails."""
    for what, location in (
        ("checkpoint.dir", target.config.checkpoint_dir),
        ("job.run_dir", str(target.config.run_dir)),
    ):
        wrong = problem(location)
        if wrong:
            raise ConfigError(f"{what} = {location!r}: {wrong}")


def unshared(location: str, nodes: int) -> str | None:
    """Why the nodes of a job across `nodes` machines could not all see `location`: a path on
    this machine's own disk; None for one node, an object store, or a network filesystem."""
    if nodes <= 1 or not is_local(location):
        return None
    kind = filesystem_type(Path(location))
    if kind in NETWORK_FILESYSTEMS:
        return None
    return (
        f"on this machine's own disk ({kind}), which the other nodes of {nodes} cannot see; "
        "use a path on shared storage (NFS, Lustre, GPFS, …) or an object store "
        "(s3://…), or pass --shared-storage if every node mounts it"
    )


def filesystem_type(path: Path) -> str:
    """The type of the filesystem holding `path` (or, where it does not exist yet, its nearest
    existing parent), from the longest matching mount point in /proc/self/mounts."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    real = os.path.realpath(path)
    best, kind = "", "unknown"
    try:
        with open("/proc/self/mounts", encoding="utf-8") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) < 3:
                    continue
                point = fields[1].replace("\\040", " ")
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, fields[2]
    except OSError:
        return "unknown"
    return kind


def absolute_paths(target: Target) -> dict[str, Any]:
    """The job as the actors get it: the run and checkpoint directories absolute (as seen from
    here), since the actors' working directory is Ray's."""
    config = target.config
    data = config.model_dump(mode="json")
    data["job"]["run_dir"] = str(config.run_dir.absolute())
    checkpoint = config.checkpoint_dir
    if "://" not in checkpoint:
        data["checkpoint"]["dir"] = str(Path(checkpoint).absolute())
    return data


def forwarded_env() -> dict[str, str]:
    """The SHARDWISE_* variables of this process, which the ranks a launcher starts on a
    cluster's workers (not children of this process) are given."""
    return {k: v for k, v in os.environ.items() if k.startswith("SHARDWISE_")}


def run_with_restarts(
    restarts: int,
    attempt: Callable[[int], T],
    *,
    again: Callable[[Exception], str],
    fatal: Callable[[Exception], Exception],
) -> T:
    """`attempt(0)`, and after a failure `attempt(1)`, … up to `restarts` more times: a launcher
    that starts its ranks again (Ray's actor group, Spark's stage) numbers the attempt, and the
    ranks resume from the newest good checkpoint. `again(failure)` says what failed and what runs
    again; a ConfigError, or the last failure, is raised as `fatal(failure)`."""
    for n in range(restarts + 1):
        try:
            return attempt(n)
        except Exception as failure:
            if isinstance(failure, ConfigError) or n == restarts:
                raise fatal(failure) from None
            print(
                f"shardwise: {again(failure)} ({n + 1} of {restarts}) from the newest good "
                "checkpoint",
                flush=True,
            )
    raise AssertionError("unreachable")
