"""Collectives whose names changed across the torch versions shardwise supports (pyproject's
`torch>=2.6`): torch 2.13 renamed `all_gather_into_tensor` and `reduce_scatter_tensor` to
`all_gather_single` and `reduce_scatter_single` and deprecates the old names (a FutureWarning on
every call); torch before 2.13 has only the old ones. Each function here calls the new name where
it exists and the old one elsewhere, so one code path runs on every supported torch."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def all_gather_single(
    output: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup | None = None
) -> Any:
    """Every rank's `tensor`, concatenated along the first dimension into `output`."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, tensor, group=group)


def reduce_scatter_single(
    output: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup | None = None
) -> Any:
    """The sum over ranks of `tensor`, this rank's equal share of it into `output`."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, tensor, group=group)
