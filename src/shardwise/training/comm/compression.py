"""Compressed gradient all-reduce for DDP, as comm hooks on `torch.distributed` collectives, so
they work the same on gloo and NCCL: `bf16`/`fp16` (half the bytes), `int8` (a quarter: an
all-to-all of 8-bit chunks, each rank sums its chunk in fp32, an all-gather of the 8-bit sums,
one fp32 scale per chunk) and PowerSGD (powersgd.py). With error feedback (the default) what a
step's compression lost is added to this rank's next gradient, so nothing is lost for good.

Under FSDP2 the reduce-scatter's precision (`MixedPrecisionPolicy.reduce_dtype`) is the lever,
set from `parallel.grad_compression` in parallel/apply.py; this module is for DDP.

The hook keeps its state per parameter (by name), not per DDP bucket: DDP rebuilds its buckets
after the first step, so a bucket's index means different parameters before and after a resume.
"""

from __future__ import annotations

import contextlib
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._C._distributed_c10d import GradBucket
from torch.nn.parallel import DistributedDataParallel

from shardwise.training.comm.base import Sync, gradient_bytes, views
from shardwise.training.comm.collectives import all_gather_single
from shardwise.training.comm.hierarchical import Topology

HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Codec:
    """What one sum over a group sends; fp32 as it is."""

    def __init__(self, sync: Sync) -> None:
        self.traffic = sync.traffic

    def __call__(
        self, flat: torch.Tensor, group: dist.ProcessGroup, ranks: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        dist.all_reduce(flat, group=group)
        self.traffic.all_reduce(flat.numel() * flat.element_size(), ranks)
        return flat, None


class Half(Codec):
    def __init__(self, sync: Sync, dtype: torch.dtype) -> None:
        super().__init__(sync)
        self.dtype = dtype

    def __call__(
        self, flat: torch.Tensor, group: dist.ProcessGroup, ranks: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        low = flat.to(self.dtype)
        lost = flat - low.float()
        dist.all_reduce(low, group=group)
        self.traffic.all_reduce(low.numel() * low.element_size(), ranks)
        return low.float(), lost


class Int8(Codec):
    """Each tensor of the sum (`sizes`, in order) is split into one chunk per rank and every
    chunk quantised with its own scale, so the result does not depend on which tensors share a
    DDP bucket (DDP regroups them after a process's first step, and a resumed run must match)."""

    def __init__(self, sync: Sync) -> None:
        self.traffic = sync.traffic
        self.sizes: list[int] = []

    def __call__(
        self, flat: torch.Tensor, group: dist.ProcessGroup, ranks: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        sizes = self.sizes or [flat.numel()]
        widths = [math.ceil(size / ranks) for size in sizes]
        pieces = torch.split(flat, sizes)
        x = torch.cat(
            [
                torch.nn.functional.pad(piece, (0, w * ranks - piece.numel())).view(ranks, w)
                for piece, w in zip(pieces, widths, strict=True)
            ],
            dim=1,
        )  # row j: the j-th chunk of every tensor, which rank j sums
        q, scale = quantize(x, widths)
        lost = x - dequantize(q, scale, widths)
        mine_q, mine_scale = torch.empty_like(q), torch.empty_like(scale)
        dist.all_to_all_single(mine_q, q, group=group)
        dist.all_to_all_single(mine_scale, scale, group=group)
        part = dequantize(mine_q, mine_scale, widths).sum(0, keepdim=True)  # my chunks' sums
        q2, scale2 = quantize(part, widths)
        # the sum's own rounding, fed back through this rank (which owns the chunks)
        lost[dist.get_rank(group)] += (part - dequantize(q2, scale2, widths))[0]
        all_q = torch.empty(ranks, q2.shape[1], dtype=torch.int8, device=flat.device)
        all_scale = torch.empty(ranks, scale2.shape[1], dtype=scale.dtype, device=flat.device)
        all_gather_single(all_q, q2, group=group)
        all_gather_single(all_scale, scale2, group=group)
        payload = q.numel() + scale.numel() * 4  # int8 values and a scale per chunk
        self.traffic.scatter_or_gather(payload, ranks)
        self.traffic.scatter_or_gather(payload, ranks)
        total = dequantize(all_q, all_scale, widths)
        return _unchunk(total, sizes, widths), _unchunk(lost, sizes, widths)


def _unchunk(x: torch.Tensor, sizes: list[int], widths: list[int]) -> torch.Tensor:
    """The inverse of Int8's layout: (ranks, Σ widths) back to the tensors, concatenated."""
    return torch.cat(
        [c.reshape(-1)[:size] for c, size in zip(torch.split(x, widths, dim=1), sizes, strict=True)]
    )


def quantize(x: torch.Tensor, widths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's segments of `widths` columns to int8, one fp32 scale per segment (its largest
    magnitude ↦ 127)."""
    segments = torch.split(x, widths, dim=1)
    scale = torch.stack([s.abs().amax(dim=1) for s in segments], dim=1)
    scale = scale.clamp(min=torch.finfo(torch.float32).tiny) / 127
    q = torch.round(x / _spread(scale, widths)).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, widths: list[int]) -> torch.Tensor:
    return q.float() * _spread(scale, widths)


def _spread(scale: torch.Tensor, widths: list[int]) -> torch.Tensor:
    counts = torch.tensor(widths, device=scale.device)
    return torch.repeat_interleave(scale, counts, dim=1)


class CompressedSync(Sync):
    """Every step, DDP's all-reduce replaced by a hook that compresses (bf16, fp16, int8), or
    reduces hierarchically, or both."""

    name = "compressed"

    def __init__(
        self,
        parts: list[nn.Module],
        group: dist.ProcessGroup,
        topology: Topology,
        *,
        compression: str,
        error_feedback: bool,
    ) -> None:
        super().__init__(parts, group)
        self.topology = topology
        self.compression = compression
        self.error_feedback = error_feedback and compression != "none"
        self.names: dict[torch.Tensor, str] = {
            p: name
            for part in parts
            for name, p in _user(part).named_parameters()
            if p.requires_grad
        }
        self.residuals = {
            name: torch.zeros_like(p) for p, name in self.names.items() if self.error_feedback
        }
        self.step = 0
        self.codec = self._codec()
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardwise-comm")
        for part in parts:
            assert isinstance(part, DistributedDataParallel)
            part.register_comm_hook(self, _hook)

    def _codec(self) -> Codec:
        if self.compression in HALF:
            return Half(self, HALF[self.compression])
        if self.compression == "int8":
            return Int8(self)
        return Codec(self)

    def micro_batch(
        self, part: nn.Module, *, last: bool, step: int
    ) -> contextlib.AbstractContextManager[None]:
        self.step = step
        return super().micro_batch(part, last=last, step=step)

    def count(self, step: int) -> None:
        self.traffic.steps += 1
        self.traffic.uncompressed += 2 * (self.ranks - 1) / self.ranks * self._full

    def reduce(self, bucket: GradBucket) -> torch.Tensor:
        """The bucket's gradients averaged over the data-parallel ranks."""
        flat = bucket.buffer()
        params = bucket.parameters()
        if isinstance(self.codec, Int8):
            self.codec.sizes = [p.numel() for p in params]
        if self.error_feedback:
            flat.add_(torch.cat([self.residuals[self.names[p]].flatten() for p in params]))
        total, lost = self.topology.all_reduce(flat, self.codec, self.traffic)
        if self.error_feedback:
            self._keep(params, lost)
        return total.div_(self.ranks)

    def _keep(self, params: list[torch.Tensor], lost: torch.Tensor | None) -> None:
        if lost is None:
            for p in params:
                self.residuals[self.names[p]].zero_()
            return
        for p, value in zip(params, views(lost, params), strict=True):
            self.residuals[self.names[p]].copy_(value)

    def state_dict(self, rank: int) -> dict[str, Any]:
        if not self.residuals:
            return {}
        return {f"rank{rank}": {f"residual.{k}": v for k, v in self.residuals.items()}}

    def load_state_dict(self, state: dict[str, Any], rank: int) -> None:
        for key, value in state.get(f"rank{rank}", {}).items():
            self.residuals[key.removeprefix("residual.")].copy_(value)


def _hook(state: CompressedSync, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Reduce the bucket on the sync's communication thread while backward goes on computing
    the next buckets' gradients (DDP waits for every bucket's future at the end of backward).
    One thread, so every rank reduces the buckets in the same order."""
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()

    def reduce() -> None:
        try:
            future.set_result(state.reduce(bucket))
        except Exception as failure:  # surfaced by DDP in backward, on the training thread
            future.set_exception(failure)  # type: ignore[arg-type]  # (torch's stub: a Tensor)

    state.thread.submit(reduce)
    return future


# DDP checks a hook's annotations against the classes themselves, and this module's are strings
# (`from __future__ import annotations`).
_hook.__annotations__.update(bucket=GradBucket, state=CompressedSync)
_hook.__annotations__["return"] = torch.futures.Future[torch.Tensor]


def _user(part: nn.Module) -> nn.Module:
    return part.module if isinstance(part, DistributedDataParallel) else part


def fsdp_reduce_bytes(compression: str) -> int:
    """Bytes per gradient element FSDP2's reduce-scatter sends under `compression`."""
    return 2 if compression in HALF else 4


__all__ = ["CompressedSync", "fsdp_reduce_bytes", "gradient_bytes"]
