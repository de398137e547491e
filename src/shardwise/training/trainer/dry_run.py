"""`--dry-run`: build the layout on the meta device without allocating or training, and print
what each rank would hold."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from shardwise.training.config.derive import config_as_saved, derive
from shardwise.training.config.schema import JobConfig
from shardwise.training.parallel.mesh import build_mesh, dp_position
from shardwise.training.trainer import display
from shardwise.training.trainer.build import build_layout, open_data, tokens_per_sample_of
from shardwise.training.trainer.memory import state_bytes
from shardwise.training.trainer.optim import states_per_param


def dry_run(config: JobConfig, device: torch.device) -> None:
    """Build the layout on the meta device, without allocating or training, and print on rank 0
    the mesh, which blocks each rank holds and each rank's parameter, gradient and optimizer
    bytes."""
    derived = derive(config, dist.get_world_size())
    config = config_as_saved(config, derived)
    mesh = build_mesh(derived.degrees, device.type)
    # the model is shaped by the first samples (a stream's first rows); nothing is evaluated
    samples = open_data(config, derived, *dp_position(mesh), held_out_too=False).samples
    layout = build_layout(
        config, derived, mesh, device, sample=samples[0], materialize_weights=False
    )
    per_param = states_per_param(config.train)
    mine: dict[str, Any] = {
        "rank": dist.get_rank(),
        "coordinates": " ".join(
            f"{a}={mesh.get_local_rank(a)}" for a in mesh.mesh_dim_names or () if mesh[a].size() > 1
        ),
        "holds": display.holds(layout),
        **state_bytes(layout.parts, optimizer_states_per_param=per_param),
    }
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if dist.get_rank() == 0:
        display.dry_run_table(ranks, derived, layout, tokens_per_sample_of(samples[0]))
