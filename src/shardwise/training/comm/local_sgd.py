"""Fewer synchronisations: each data-parallel rank trains alone on its share of every global
batch and the ranks agree only every H steps (`train.sync_every`).

- Local SGD averages the parameters (and floating-point buffers, such as BatchNorm's running
  statistics) every H steps. With H = 1 and a linear optimizer (SGD, with or without momentum,
  no clipping) it is DDP exactly: averaging parameters after identical linear steps equals
  stepping on averaged gradients. With AdamW it is not, at any H (Adam is not linear).
- DiLoCo (Douillard et al., 2023) keeps the parameters of the last agreement and an outer
  Nesterov SGD (the paper's lr 0.7, momentum 0.9). Every H steps the ranks average their change
  since then (the outer gradient, optionally sent in bf16 or int8) and the outer optimizer
  applies it; every rank continues from the result. With outer lr 1 and momentum 0 the result
  is the average: local SGD.

Traffic: one all-reduce of the parameters every H steps instead of the gradients every step
(÷ H), and a quarter or half of that with `outer_compression`.

Between agreements the ranks' parameters and optimizer states differ, so each rank's own go
into the checkpoint (`sync.rank<N>`), and the checkpoint's model is the ranks' average (local
SGD) or the last agreement (DiLoCo), which is what `export` and another layout get.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from shardwise.training.comm.base import Sync, local_tensor, start_together, step_optimizers, views
from shardwise.training.comm.compression import HALF, Codec, Half, Int8

Named = list[tuple[str, torch.Tensor]]


class LocalSGD(Sync):
    name = "local_sgd"

    def __init__(
        self,
        parts: list[nn.Module],
        group: dist.ProcessGroup,
        *,
        every: int,
        optimizers: list[torch.optim.Optimizer],
    ) -> None:
        super().__init__(parts, group)
        self.every, self.optimizers = every, optimizers
        self.params: Named = [(n, p) for part in parts for n, p in part.named_parameters()]
        self.buffers: Named = [
            (n, b) for part in parts for n, b in part.named_buffers() if b.is_floating_point()
        ]
        self._tensors = [local_tensor(t) for _, t in self.params + self.buffers]
        start_together(self._tensors, group)

    def micro_batch(
        self, part: nn.Module, *, last: bool, step: int
    ) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # nothing to reduce: there is no wrapper

    def apply(
        self,
        optimizers: list[torch.optim.Optimizer],
        scaler: Any,
        step: int,
        *,
        skip: torch.Tensor | None,
    ) -> None:
        """A rank's own verdict on its gradient (nobody else sees it): a rank whose gradient is
        not finite skips its update, and every rank still meets at the agreement."""
        step_optimizers(optimizers, scaler, skip)
        self.traffic.steps += 1
        self.traffic.uncompressed += 2 * (self.ranks - 1) / self.ranks * self._full
        if step % self.every == 0:
            self.agree()

    @torch.no_grad()
    def agree(self) -> None:
        """Average the parameters and buffers over the data-parallel ranks."""
        _unflatten(self._average(count=True), self._tensors)

    def _average(self, *, count: bool) -> torch.Tensor:
        """The ranks' mean of every parameter and buffer, flat (`count`: as traffic; a
        checkpoint's consensus is not training's)."""
        flat = torch.cat([t.detach().flatten().float() for t in self._tensors])
        dist.all_reduce(flat, group=self.group)
        if count:
            self.traffic.all_reduce(flat.numel() * 4, self.ranks)
        return flat.div_(self.ranks)

    @torch.no_grad()
    def consensus(self, model_state: dict[str, Any]) -> dict[str, Any]:
        copies = [torch.empty_like(t) for t in self._tensors]
        _unflatten(self._average(count=False), copies)
        names = [n for n, _ in self.params + self.buffers]
        return _replaced(model_state, dict(zip(names, copies, strict=True)))

    def state_dict(self, rank: int) -> dict[str, Any]:
        """Copies, not the live tensors: a checkpoint is loaded into this state and the run's
        model and optimizer are then set from the consensus before these are put back."""
        mine: dict[str, Any] = {
            f"model.{n}": local_tensor(t).detach().clone() for n, t in self.params + self.buffers
        }
        for i, optimizer in enumerate(self.optimizers):
            for index, values in optimizer.state_dict()["state"].items():
                for key, value in values.items():
                    if isinstance(value, torch.Tensor):
                        mine[f"optim{i}.{index}.{key}"] = value.detach().clone()
        return {f"rank{rank}": mine}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any], rank: int) -> None:
        mine = state.get(f"rank{rank}", {})
        for n, t in self.params + self.buffers:
            if f"model.{n}" in mine:
                local_tensor(t).copy_(mine[f"model.{n}"])
        for i, optimizer in enumerate(self.optimizers):
            saved = optimizer.state_dict()
            for index, values in saved["state"].items():
                for key in values:
                    if f"optim{i}.{index}.{key}" in mine:
                        values[key] = mine[f"optim{i}.{index}.{key}"].clone()
            optimizer.load_state_dict(saved)


class DiLoCo(LocalSGD):
    name = "diloco"

    def __init__(
        self,
        parts: list[nn.Module],
        group: dist.ProcessGroup,
        *,
        every: int,
        optimizers: list[torch.optim.Optimizer],
        outer_lr: float,
        outer_momentum: float,
        compression: str,
    ) -> None:
        super().__init__(parts, group, every=every, optimizers=optimizers)
        self.compression = compression
        self.outer_params = [local_tensor(p).detach().clone() for _, p in self.params]
        self.outer = torch.optim.SGD(
            self.outer_params, lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0
        )
        if outer_momentum > 0:  # zeros: the same first step as none, and a checkpoint key
            for g in self.outer_params:
                self.outer.state[g]["momentum_buffer"] = torch.zeros_like(g)

    @torch.no_grad()
    def agree(self) -> None:
        locals_ = [local_tensor(p) for _, p in self.params]
        delta = torch.cat(
            [(g - p.float()).flatten() for g, p in zip(self.outer_params, locals_, strict=True)]
        )
        delta = self._mean(delta)
        for g, change in zip(self.outer_params, views(delta, self.outer_params), strict=True):
            g.grad = change.clone()
        self.outer.step()
        self.outer.zero_grad(set_to_none=True)
        for g, p in zip(self.outer_params, locals_, strict=True):
            p.copy_(g)
        if self.buffers:  # running statistics: averaged, as in local SGD
            flat = torch.cat([local_tensor(b).flatten().float() for _, b in self.buffers])
            dist.all_reduce(flat, group=self.group)
            self.traffic.all_reduce(flat.numel() * 4, self.ranks)
            _unflatten(flat.div_(self.ranks), [local_tensor(b) for _, b in self.buffers])

    def _mean(self, delta: torch.Tensor) -> torch.Tensor:
        """The ranks' mean change, sent by the codec `compression` names (compression.py)."""
        codec: Codec
        if self.compression == "int8":
            codec = Int8(self)
            codec.sizes = [g.numel() for g in self.outer_params]
        elif self.compression in HALF:
            codec = Half(self, HALF[self.compression])
        else:
            codec = Codec(self)
        total, _ = codec(delta, self.group, self.ranks)
        return total.div_(self.ranks)

    def consensus(self, model_state: dict[str, Any]) -> dict[str, Any]:
        agreed = {n: g.clone() for (n, _), g in zip(self.params, self.outer_params, strict=True)}
        return _replaced(model_state, agreed)

    def state_dict(self, rank: int) -> dict[str, Any]:
        state = super().state_dict(rank)
        shared: dict[str, Any] = {}
        for (name, _), g in zip(self.params, self.outer_params, strict=True):
            shared[f"outer.{name}"] = g
            buffer = self.outer.state.get(g, {}).get("momentum_buffer")
            if buffer is not None:
                shared[f"momentum.{name}"] = buffer
        state["shared"] = shared
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any], rank: int) -> None:
        super().load_state_dict(state, rank)
        shared = state.get("shared", {})
        for (name, _), g in zip(self.params, self.outer_params, strict=True):
            if f"outer.{name}" in shared:
                g.copy_(shared[f"outer.{name}"])
            if f"momentum.{name}" in shared:
                self.outer.state[g]["momentum_buffer"] = shared[f"momentum.{name}"].clone()


def _replaced(model_state: dict[str, Any], values: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The state with the entries it has replaced by `values` (local tensors, put back into
    the same sharding as the entry they replace)."""
    out = dict(model_state)
    for name, value in values.items():
        old = model_state.get(name)
        if isinstance(old, DTensor):
            out[name] = DTensor.from_local(
                value,
                old.device_mesh,
                old.placements,
                run_check=False,
                shape=old.shape,
                stride=old.stride(),
            )
        elif old is not None:
            out[name] = value
    return out


def _unflatten(flat: torch.Tensor, into: list[torch.Tensor]) -> None:
    for t, value in zip(into, views(flat, into), strict=True):
        t.copy_(value)
