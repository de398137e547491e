"""torch's BatchNorm in a pipeline stage: statistics updated apart from the normalisation.

In training, `F.batch_norm` updates the running mean and variance in place and autograd saves
them for the backward, so a schedule that runs a second micro-batch's forward before the first
one's backward (every schedule but one micro-batch at a time) fails that backward: "one of the
variables needed for gradient computation has been modified by an inplace operation". In a
pipeline stage shardwise gives each `nn.BatchNorm1d/2d/3d` (and a user's subclass of torch's
batch norm) a forward that normalises with the batch's own statistics and then updates the
running ones under `no_grad`, as torch does: running = (1 − m)·running + m·batch, with the
batch's unbiased variance, and `momentum=None` the cumulative average (m = 1 / batches seen).
The module keeps its class's name, parameters, buffers and state-dict keys; only its class is
swapped for a subclass that overrides `forward`. `nn.InstanceNorm*` needs nothing: torch keeps
copies of its statistics for the backward.

This module must not decide where a stage begins: parallel/pipeline.py and traced.py do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812 (the conventional name)
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

_SAFE: dict[type[_BatchNorm], type[_BatchNorm]] = {}


class _StatisticsApart(_BatchNorm):
    """The forward every pipeline-safe batch norm has (see the module docstring)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        stats = self.running_mean is not None and self.running_var is not None
        if not (self.training and self.track_running_stats and stats):
            return super().forward(input)
        self._check_input_dim(input)  # type: ignore[no-untyped-call]
        out = F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)
        with torch.no_grad():
            self._update(input.detach())
        return out

    def _update(self, x: torch.Tensor) -> None:
        assert self.running_mean is not None
        assert self.running_var is not None
        dims = [0, *range(2, x.dim())]
        x = x.to(self.running_mean.dtype)
        if self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        if self.momentum is not None:
            factor: float | torch.Tensor = self.momentum
        else:  # a cumulative average, as torch's; a tensor: the host reads nothing
            assert self.num_batches_tracked is not None
            factor = 1.0 / self.num_batches_tracked.to(x.dtype)
        self.running_mean.lerp_(x.mean(dims), factor)
        self.running_var.lerp_(x.var(dims, unbiased=True), factor)


def statistics_apart(module: nn.Module) -> list[str]:
    """Give every torch batch norm in `module` that keeps running statistics the forward above;
    returns their names."""
    swapped = []
    for name, child in module.named_modules():
        if (
            isinstance(child, _BatchNorm)
            and not isinstance(child, nn.SyncBatchNorm | _StatisticsApart)
            and child.track_running_stats
        ):
            child.__class__ = _safe_class(type(child))
            swapped.append(name)
    return swapped


def _safe_class(cls: type[_BatchNorm]) -> type[_BatchNorm]:
    """`cls` with `_StatisticsApart`'s forward, named as `cls` (printed, pickled by name)."""
    if cls not in _SAFE:
        _SAFE[cls] = type(cls.__name__, (_StatisticsApart, cls), {"__module__": __name__})
    return _SAFE[cls]
