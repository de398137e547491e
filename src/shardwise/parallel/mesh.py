"""The device mesh: named axes `pp`, `dp_replicate`, `dp_shard`, `tp` (outermost first) built from
degrees that `config.ParallelSection.degrees` has already checked against the world size."""

from __future__ import annotations

from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardwise.config import MESH_AXES


def build_mesh(degrees: dict[str, int], device_type: str) -> DeviceMesh:
    """A mesh with one named axis per degree above 1 (a 1-rank run gets one axis of size 1)."""
    axes = [axis for axis in MESH_AXES if degrees[axis] > 1] or ["dp_replicate"]
    shape = tuple(degrees[axis] for axis in axes)
    return init_device_mesh(device_type, shape, mesh_dim_names=tuple(axes))


def dp_position(mesh: DeviceMesh) -> tuple[int, int]:
    """(rank, size) of this process among the data-parallel ranks, i.e. ranks that read
    different samples: dp_replicate × dp_shard, replicate outermost."""
    names = mesh.mesh_dim_names or ()
    rank, size = 0, 1
    for axis in ("dp_replicate", "dp_shard"):
        if axis in names:
            axis_size = mesh.size(names.index(axis))
            rank = rank * axis_size + mesh.get_local_rank(axis)
            size *= axis_size
    return rank, size


def dp_group(mesh: DeviceMesh) -> ProcessGroup:
    """The process group of the data-parallel ranks, for reducing metrics over distinct samples."""
    names = mesh.mesh_dim_names or ()
    axes = [axis for axis in ("dp_replicate", "dp_shard") if axis in names]
    assert len(axes) == 1, "derive() allows one data-parallel axis in this version"
    return mesh.get_group(axes[0])
