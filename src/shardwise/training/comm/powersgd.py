"""PowerSGD (Vogels et al., 2019) as a DDP comm hook on `torch.distributed` collectives.

Each gradient matrix M (n × m; a tensor's first dimension by the rest) is sent as two low-rank
factors: P = M·Q is summed over ranks and orthonormalised, then Q = Mᵀ·P is summed, and the mean
gradient is approximated by P·Qᵀ / ranks: r·(n + m) numbers instead of n·m. Q is kept from step
to step (warm start), initialised from the same seed on every rank. With error feedback each
rank adds M − P·Qᵀ/ranks (what the approximation missed of its own matrix) to its next gradient.
Vectors (biases, norms) and matrices that the factors would not shrink go uncompressed, in one
fp32 all-reduce. The first `start_step` steps are reduced uncompressed (the paper's warm-up).

Why not torch's hooks (measured with torch 2.13 on gloo): `batched_powerSGD_hook` fails on the
first compressed step on every backend (`_orthogonalize` asserts a batch of matrices and the
hook passes one); `bf16_compress_hook` is refused at registration on gloo (DDP checks the hook's
name, not what the backend can do); `powerSGD_hook` runs, but keeps its error feedback and warm
start per DDP bucket index, and DDP rebuilds its buckets after a process's first step, so a
resumed run would add each residual to other parameters. State here is kept per parameter.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._C._distributed_c10d import GradBucket

from shardwise.training.comm.base import views
from shardwise.training.comm.compression import Codec, CompressedSync
from shardwise.training.comm.hierarchical import Topology


def factor_bytes(shape: torch.Size, rank: int) -> int | None:
    """The fp32 bytes of the two factors of a tensor of `shape` at `rank`; None when the
    tensor goes uncompressed."""
    if not _compressible(shape, rank, 1.0):
        return None
    n, m = shape[0], shape[1:].numel()
    return 4 * min(rank, n, m) * (n + m)


def _compressible(shape: torch.Size, rank: int, min_compression: float) -> bool:
    if len(shape) < 2:
        return False
    n, m = shape[0], shape[1:].numel()
    return min(rank, n, m) * (n + m) * min_compression <= n * m


class PowerSGDSync(CompressedSync):
    name = "powersgd"

    def __init__(
        self,
        parts: list[nn.Module],
        group: dist.ProcessGroup,
        topology: Topology,
        *,
        rank: int,
        start_step: int,
        error_feedback: bool,
        seed: int,
        min_compression: float = 1.0,
    ) -> None:
        """`min_compression`: compress a matrix only where the factors are at least this many
        times smaller (0 compresses every matrix, even at full rank: for tests)."""
        super().__init__(
            parts, group, topology, compression="powersgd", error_feedback=error_feedback
        )
        self.rank, self.start_step = rank, start_step
        generator = torch.Generator().manual_seed(seed)
        self.qs: dict[str, torch.Tensor] = {}
        for p, name in self.names.items():
            if _compressible(p.shape, rank, min_compression):
                n, m = p.shape[0], p[0].numel()
                q = torch.randn(m, min(rank, n, m), generator=generator)
                self.qs[name] = q.to(p.device)

    def reduce(self, bucket: GradBucket) -> torch.Tensor:
        if self.step <= self.start_step:
            flat = bucket.buffer()
            total, _ = self.topology.all_reduce(flat, Codec(self), self.traffic)
            return total.div_(self.ranks)
        params, grads = bucket.parameters(), bucket.gradients()
        named = [(self.names[p], g) for p, g in zip(params, grads, strict=True)]
        self.average(named)
        out: torch.Tensor = bucket.buffer()
        return out

    def average(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Each gradient (named as its parameter) replaced in place by the ranks' mean: the
        matrices' through their low-rank factors, the rest as they are; with error feedback,
        what was lost last step added first and what is lost now kept. The hook's work, and
        what `shardwise plan --calibrate` times."""
        matrices: list[tuple[str, torch.Tensor]] = []
        vectors: list[tuple[str, torch.Tensor]] = []
        for name, g in named:
            if self.error_feedback:
                g.add_(self.residuals[name])
            (matrices if name in self.qs else vectors).append((name, g))
        self._low_rank(matrices)
        if vectors:
            flat = torch.cat([g.flatten() for _, g in vectors])
            total, _ = self.topology.all_reduce(flat, Codec(self), self.traffic)
            total.div_(self.ranks)
            for (name, g), mean in zip(vectors, views(total, [g for _, g in vectors]), strict=True):
                if self.error_feedback:
                    self.residuals[name].zero_()
                g.copy_(mean)

    def _low_rank(self, matrices: list[tuple[str, torch.Tensor]]) -> None:
        if not matrices:
            return
        ms = [g.view(g.shape[0], -1) for _, g in matrices]
        ps = [m @ self.qs[name] for (name, _), m in zip(matrices, ms, strict=True)]
        summed = self._sum([p.flatten() for p in ps])
        ps = [orthonormal(p) for p in views(summed, ps)]
        qs = [m.t() @ p for m, p in zip(ms, ps, strict=True)]
        summed = self._sum([q.flatten() for q in qs])
        qs = views(summed, qs)
        for (name, _), m, p, q in zip(matrices, ms, ps, qs, strict=True):
            approx = p @ q.t() / self.ranks
            if self.error_feedback:
                self.residuals[name].copy_((m - approx).view_as(self.residuals[name]))
            self.qs[name].copy_(q)  # warm start: the next step begins from this Q
            m.copy_(approx)

    def _sum(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        total, _ = self.topology.all_reduce(torch.cat(tensors), Codec(self), self.traffic)
        return total

    def state_dict(self, rank: int) -> dict[str, Any]:
        state = super().state_dict(rank)
        state["shared"] = {f"q.{k}": v for k, v in self.qs.items()}
        return state

    def load_state_dict(self, state: dict[str, Any], rank: int) -> None:
        super().load_state_dict(state, rank)
        for key, value in state.get("shared", {}).items():
            self.qs[key.removeprefix("q.")].copy_(value)


def orthonormal(p: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis whose span holds P's columns (reduced QR; exact for rank-deficient
    P too, since P = Q·R puts P's columns in Q's span)."""
    basis: torch.Tensor = torch.linalg.qr(p, mode="reduced").Q
    return basis
