"""Which rank writes a value every rank holds.

DCP writes a tensor that several ranks hold (a replicated parameter, a buffer) once, from the
rank whose share of the checkpoint is smallest so far, which balances the writing. That is right
for values the ranks agree on. Values they may disagree on (a BatchNorm's running statistics,
each data-parallel rank's from its own micro-batches) are written by the lowest rank that holds
them instead: the first data-parallel replica's, whatever the sizes, so a checkpoint and its
export hold one replica's statistics, as DDP (which broadcasts rank 0's) has them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan


class FirstHolderPlanner(DefaultSavePlanner):
    """DCP's save planner, the values named in `first_holder` (flattened state-dict keys)
    written by the lowest rank that holds them."""

    def __init__(self, first_holder: Collection[str]) -> None:
        super().__init__()
        self.first_holder = frozenset(first_holder)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        taken: set[MetadataIndex] = set()
        plans = []
        for plan in all_plans:  # in rank order
            items = []
            for item in plan.items:
                if item.index.fqn in self.first_holder:
                    if item.index in taken:
                        continue
                    taken.add(item.index)
                items.append(item)
            plans.append(dataclasses.replace(plan, items=items))
        return super().create_global_plan(plans)
