"""The device mesh: named axes `pp`, `dp_replicate`, `dp_shard`, `tp` (outermost first) built from
degrees that `ParallelSection.degrees` (training/config/schema.py) has already checked against the
world size, and the process groups the trainer reduces over. Every axis exists, of size 1 when
unused, so code can ask for any axis under any layout."""

from __future__ import annotations

from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardwise.training.config.schema import MESH_AXES

DP_AXES = ("dp_replicate", "dp_shard")


def build_mesh(degrees: dict[str, int], device_type: str) -> DeviceMesh:
    shape = tuple(degrees[axis] for axis in MESH_AXES)
    return init_device_mesh(device_type, shape, mesh_dim_names=MESH_AXES)


def dp_position(mesh: DeviceMesh) -> tuple[int, int]:
    """(rank, size) of this process among the data-parallel ranks, i.e. ranks that read
    different samples: dp_replicate × dp_shard, replicate outermost."""
    rank, size = 0, 1
    for axis in DP_AXES:
        axis_size = mesh[axis].size()
        rank = rank * axis_size + mesh.get_local_rank(axis)
        size *= axis_size
    return rank, size


def dp_group(mesh: DeviceMesh) -> ProcessGroup:
    """The process group of the data-parallel ranks (both data-parallel axes), for reducing
    metrics over distinct samples."""
    return mesh[DP_AXES]._flatten("dp").get_group()


def pp_group(mesh: DeviceMesh) -> ProcessGroup | None:
    """The pipeline axis's group, None without pipeline parallelism."""
    return mesh.get_group("pp") if mesh["pp"].size() > 1 else None
