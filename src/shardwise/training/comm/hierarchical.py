"""Where a sum over the data-parallel ranks travels: across all of them at once (flat), or inside
each node first, then across nodes among one rank per node (the node's leader), then back inside
the node (hierarchical). Only the leaders' step crosses the slow network between machines, and
it carries one copy per node instead of a ring's 2(n−1)/n per rank; compression applies there.

Groups come from the node each rank runs on (the launcher's node rank), gathered over the
data-parallel group. Every rank creates every group, in the same order (torch requires it).
HSDP (dp_replicate × dp_shard) is the sharded analogue: FSDP2 reduce-scatters inside a replica
and all-reduces across replicas, so place a replica's ranks on one node.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardwise.training.comm.base import Traffic

Reduce = Callable[[torch.Tensor, dist.ProcessGroup, int], tuple[torch.Tensor, torch.Tensor | None]]
"""A sum over a group of `ranks` ranks: the sum, and what this rank's contribution lost to
compression (None when nothing was lost)."""


@dataclass
class Topology:
    group: dist.ProcessGroup
    """The data-parallel group (flat reduction)."""
    ranks: int
    intra: dist.ProcessGroup | None = None
    intra_ranks: int = 1
    leader: int = 0
    """The global rank of this node's leader."""
    inter: dist.ProcessGroup | None = None
    """The leaders' group (None on other ranks)."""
    nodes: int = 1

    @property
    def hierarchical(self) -> bool:
        return self.intra is not None

    def all_reduce(
        self, flat: torch.Tensor, reduce: Reduce, traffic: Traffic
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The sum of `flat` over every data-parallel rank, by `reduce` where it matters."""
        if self.intra is None:
            return reduce(flat, self.group, self.ranks)
        nbytes = flat.numel() * flat.element_size()
        lost = None
        dist.reduce(flat, dst=self.leader, group=self.intra)
        is_leader = dist.get_rank() == self.leader
        traffic.sent += 0.0 if is_leader else nbytes
        if self.inter is not None and self.nodes > 1:
            flat, lost = reduce(flat, self.inter, self.nodes)  # counted as crossing nodes
        dist.broadcast(flat, src=self.leader, group=self.intra)
        traffic.sent += nbytes if is_leader else 0.0
        return flat, lost


def topology(group: dist.ProcessGroup, node: int, hierarchical: bool | str) -> Topology:
    """The reduction for this data-parallel group; `hierarchical` "auto" is on when the group
    spans more than one node and some node holds more than one of its ranks."""
    ranks = dist.get_process_group_ranks(group)
    nodes: list[int] = [0] * len(ranks)
    dist.all_gather_object(nodes, node, group=group)
    members: dict[int, list[int]] = {}
    for rank, n in zip(ranks, nodes, strict=True):
        members.setdefault(n, []).append(rank)
    flat = Topology(group=group, ranks=len(ranks), nodes=len(members))
    useful = len(members) > 1 and len(members) < len(ranks)
    if hierarchical is False or (hierarchical == "auto" and not useful) or len(ranks) == 1:
        return flat
    me = dist.get_rank()
    for n in sorted(members):
        created = dist.new_group(members[n], use_local_synchronization=False)
        if me in members[n]:
            flat.intra, flat.intra_ranks, flat.leader = created, len(members[n]), members[n][0]
    leaders = [members[n][0] for n in sorted(members)]
    inter = dist.new_group(leaders, use_local_synchronization=False)
    flat.inter = inter if me in leaders else None
    return flat
