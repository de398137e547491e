"""The `Sync` seam and its default: every step, the data-parallel wrapper reduces gradients.

A `Sync` is asked four things by the trainer: how to run a micro-batch's backward (reduce its
gradients, or let them accumulate), how to apply the step's update (the optimizer, then whatever
the mode does with parameters), what it must checkpoint, and what it measured. Every mode counts
the bytes this rank sent for data-parallel synchronisation in a `Traffic`.

Bytes are counted as the ring algorithms gloo and NCCL use send them: an all-reduce of S bytes
over n ranks sends 2(n−1)/n·S from each rank, a reduce-scatter or all-gather of S bytes in all
(n−1)/n·S, an all-to-all of S bytes (n−1)/n·S, a broadcast or reduce inside a node S. Pipeline
activations and tensor-parallel collectives are not data-parallel synchronisation and are not
counted.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from shardwise.training.parallel.apply import gradient_sync


@dataclass
class Traffic:
    """Bytes this rank sent for synchronisation, and what plain fp32 all-reduce of every
    gradient every step would have sent in the same steps."""

    sent: float = 0.0
    inter_node: float = 0.0
    """What crossed from this rank's node to another: in a ring over ranks placed node by node
    one hop leaves each node and carries what every rank sends; in a hierarchical reduction
    the leaders' all-reduce."""
    uncompressed: float = 0.0
    steps: int = 0
    spans_nodes: bool = False
    """The collectives counted run over ranks on more than one node."""
    window_steps: int = 0
    """The steps of the last window `metrics` reported on,"""
    window_uncompressed: float = 0.0
    """and what fp32 all-reduce would have sent in them."""
    _mark: tuple[float, float, float, int] = (0.0, 0.0, 0.0, 0)

    def all_reduce(self, nbytes: float, ranks: int) -> None:
        self._add(2 * (ranks - 1) / ranks * nbytes if ranks > 1 else 0.0)

    def scatter_or_gather(self, nbytes: float, ranks: int) -> None:
        """A reduce-scatter, all-gather or all-to-all of `nbytes` in all."""
        self._add((ranks - 1) / ranks * nbytes if ranks > 1 else 0.0)

    def _add(self, sent: float) -> None:
        self.sent += sent
        if self.spans_nodes:
            self.inter_node += sent

    def metrics(self) -> dict[str, float]:
        """The mean per step over the window since the last call (the logging window, as
        samples/s is; a mode that synchronises every H steps sends in one step what this
        spreads over the window's steps, and nothing in a window without an agreement), and
        since this process started training (`…_since_start`). The compression ratio is
        against fp32 all-reduce of every gradient every step: of the bytes this rank sent on
        one machine, of the bytes that crossed between machines on several; a window that sent
        nothing has none."""
        now = (self.sent, self.inter_node, self.uncompressed, self.steps)
        sent, inter, full, steps = (a - b for a, b in zip(now, self._mark, strict=True))
        self._mark, self.window_steps, self.window_uncompressed = now, int(steps), full
        per, overall = max(steps, 1), max(self.steps, 1)
        # across machines what matters is what crosses between them: fp32 DDP's ring sends
        # `uncompressed` off each node, the same as each rank sends
        paid = inter if self.spans_nodes else sent
        paid_overall = self.inter_node if self.spans_nodes else self.sent
        out = {
            "comm/bytes_per_step": sent / per,
            "comm/bytes_per_step_since_start": self.sent / overall,
            "comm/compression_ratio_since_start": (
                self.uncompressed / paid_overall if paid_overall else 1.0
            ),
        }
        if paid or not full:  # a window that sent nothing (local SGD between agreements) has none
            out["comm/compression_ratio"] = full / paid if paid else 1.0
        if self.spans_nodes:
            out["comm/inter_node_bytes_per_step"] = inter / per
            out["comm/inter_node_bytes_per_step_since_start"] = self.inter_node / overall
        return out


def gradient_bytes(parts: list[nn.Module]) -> int:
    """The fp32 bytes of every gradient this rank holds (its shard under FSDP)."""
    return sum(
        local_tensor(p).numel() * 4 for part in parts for p in part.parameters() if p.requires_grad
    )


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor (a DTensor's local shard), or the tensor itself."""
    to_local = getattr(p, "to_local", None)
    return to_local() if to_local is not None else p


def start_together(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Every rank of `group` takes its first rank's values (DDP does this when it wraps; the
    modes without a wrapper do it here)."""
    source = dist.get_process_group_ranks(group)[0]
    for t in tensors:
        dist.broadcast(t.data, src=source, group=group)


def views(flat: torch.Tensor, like: Sequence[torch.Tensor | torch.Size]) -> list[torch.Tensor]:
    """`flat`'s first elements cut into consecutive views shaped as `like` (tensors or shapes):
    the inverse of concatenating their flattened values."""
    shapes = [t.shape if isinstance(t, torch.Tensor) else t for t in like]
    sizes = [s.numel() for s in shapes]
    pieces = torch.split(flat[: sum(sizes)], sizes)
    return [piece.view(shape) for piece, shape in zip(pieces, shapes, strict=True)]


class Sync:
    """Every step: DDP's all-reduce or FSDP2's reduce-scatter in backward, after the last
    micro-batch; the optimizer then applies the same update on every rank."""

    name = "every_step"
    meets_every_step = True
    """Whether the ranks wait for each other every step (False: asynchronous updates, where
    the trainer's own collectives are kept to the reporting steps)."""

    def __init__(
        self, parts: list[nn.Module], group: dist.ProcessGroup, *, reduce_bytes: int = 4
    ) -> None:
        self.parts, self.group = parts, group
        self.ranks = dist.get_world_size(group)
        self.traffic = Traffic()
        self._full = gradient_bytes(parts)
        self._reduce_bytes = reduce_bytes
        self._per_part = [gradient_bytes([part]) for part in parts]  # counted once, not per step

    def micro_batch(
        self, part: nn.Module, *, last: bool, step: int
    ) -> contextlib.AbstractContextManager[None]:
        """The context a micro-batch's forward and backward run in: gradients are reduced only
        after the last micro-batch of the step."""
        return gradient_sync(part, enabled=last)

    def apply(
        self,
        optimizers: list[torch.optim.Optimizer],
        scaler: Any,
        step: int,
        *,
        skip: torch.Tensor | None,
    ) -> None:
        """The step's update, once its gradients are final (reduced, clipped, checked). Called
        every step: where `skip` (1.0 or 0.0 on the device; None when unchecked) is 1 the
        optimizer does not step, but a mode that synchronises on a schedule keeps it."""
        step_optimizers(optimizers, scaler, skip)
        self.count(step)

    def count(self, step: int) -> None:
        """One step's traffic (the wrappers' collectives, which no hook of ours sees)."""
        self.traffic.steps += 1
        self.traffic.uncompressed += 2 * (self.ranks - 1) / self.ranks * self._full
        for part, nbytes in zip(self.parts, self._per_part, strict=True):
            if isinstance(part, DistributedDataParallel):
                self.traffic.all_reduce(nbytes, self.ranks)
            elif isinstance(part, FSDPModule):
                # the shard's gradients were reduce-scattered from the whole (× ranks), and the
                # parameters gathered for forward (and again for backward when resharded)
                whole = nbytes * self.ranks
                self.traffic.scatter_or_gather(whole * self._reduce_bytes / 4, self.ranks)
                self.traffic.scatter_or_gather(whole, self.ranks)

    def state_dict(self, rank: int) -> dict[str, Any]:
        """What a checkpoint must hold to resume this mode exactly: `shared` (the same on every
        rank) and `rank<N>` (this rank's own)."""
        return {}

    def load_state_dict(self, state: dict[str, Any], rank: int) -> None:
        pass

    def consensus(self, model_state: dict[str, Any]) -> dict[str, Any]:
        """The model a checkpoint stores for export and for another layout: in modes where the
        ranks' parameters differ between synchronisations, their agreed value."""
        return model_state

    def metrics(self) -> dict[str, float]:
        return self.traffic.metrics()

    def close(self) -> None:
        """The run's last step is done (or it stops early, on SIGTERM): every rank calls this."""


def step_optimizers(
    optimizers: list[torch.optim.Optimizer], scaler: Any, skip: torch.Tensor | None
) -> None:
    """Step each optimizer unless `skip` (a float tensor) is 1, without the host reading it where
    the optimizer can skip on the device: fused AdamW and SGD take it as `found_inf`, as they do
    from a gradient scaler, and leave parameters, moments and their step count untouched. Other
    optimizers (foreach ones) make the host wait for the verdict."""
    if skip is None:  # unchecked: fp16, whose scaler skips steps itself
        for optimizer in optimizers:
            scaler.step(optimizer)
        scaler.update()
        return
    apply: bool | None = None
    for optimizer in optimizers:
        if skips_on_device(optimizer):
            optimizer.grad_scale, optimizer.found_inf = None, skip  # type: ignore[attr-defined]
            try:
                optimizer.step()
            finally:
                del optimizer.grad_scale, optimizer.found_inf  # type: ignore[attr-defined]
            continue
        if apply is None:
            apply = not bool(skip)
        if apply:
            optimizer.step()


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer skips a step on the device when given `found_inf` (fused ones:
    every parameter group's own setting, which is what its step reads)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and all(
        group.get("fused") for group in optimizer.param_groups
    )
