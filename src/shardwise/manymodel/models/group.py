"""The workers that fit one global model together (manymodel/models/global_models.py), as a model's
`fit(frame, group)` sees them: its rank, their number, LightGBM's machine list, and collectives
over torch.distributed (gloo) for models that reduce statistics or gradients themselves.

A model whose `fit` takes a `group` argument is fitted on every worker at once, each on its own
series' rows; a model without one is fitted once, on every series' rows gathered to one worker.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import numpy as np

TIMEOUT_MINUTES = 5
"""How long a worker waits for the others in a collective before the fit fails."""


@dataclass(frozen=True)
class Group:
    rank: int
    size: int
    endpoints: tuple[tuple[str, int, int], ...] = ()
    """Per rank: its address, its LightGBM port and its torch.distributed port."""

    @property
    def lightgbm(self) -> dict[str, Any]:
        """LightGBM's parameters for data-parallel training over sockets; {} alone."""
        if self.size < 2:
            return {}
        port = self.endpoints[self.rank][1]
        return {
            "tree_learner": "data",
            "num_machines": self.size,
            "machines": ",".join(f"{h}:{p}" for h, p, _ in self.endpoints),
            "local_listen_port": port,
            "time_out": TIMEOUT_MINUTES,
        }

    def allreduce(self, values: np.ndarray) -> np.ndarray:
        """The elementwise sum of `values` over the group (float64)."""
        values = np.asarray(values, dtype=np.float64)
        if self.size < 2:
            return values
        import torch
        import torch.distributed as dist

        self._connect()
        tensor = torch.from_numpy(values.copy())
        dist.all_reduce(tensor)
        return tensor.numpy()

    def union(self, values: list[Any]) -> list[Any]:
        """The sorted union of every rank's `values`."""
        if self.size < 2:
            return sorted(set(values))
        import torch.distributed as dist

        self._connect()
        gathered: list[list[Any] | None] = [None] * self.size
        dist.all_gather_object(gathered, list(values))
        return sorted({v for part in gathered for v in part or ()})

    def _connect(self) -> None:
        """Join the gloo process group on first use (every rank calls the same collectives in the
        same order, so every rank gets here)."""
        import torch.distributed as dist

        if dist.is_initialized():
            return
        host, _, port = self.endpoints[0]
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{host}:{port}",
            rank=self.rank,
            world_size=self.size,
            timeout=datetime.timedelta(minutes=TIMEOUT_MINUTES),
        )
