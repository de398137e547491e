"""A pipeline stage that times its own work. Its own module because it subclasses torch's
`PipelineStage`: `torch.distributed.pipelining` pulls in TorchDynamo (half a second of every
rank's start), so it is imported only when a run has a pipeline (pipeline.py's `Pipeline.start`).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage


class TimedStage(PipelineStage):
    """A pipeline stage that adds up the time it spends computing (forward and backward chunks),
    so that the bubble, the time a rank waits, can be measured; and whose shape inference leaves
    no trace in the model."""

    busy_seconds: float = 0.0

    def __init__(
        self, submodule: nn.Module, stage_index: int, num_stages: int, *args: Any, **kwargs: Any
    ) -> None:
        # What a stage sends must be contiguous (gloo and NCCL send whole buffers): a traced
        # BERT's second stage receives the attention mask as its first stage expanded it.
        # And no view (_own_memory). The last stage sends nothing.
        if stage_index < num_stages - 1:
            submodule.register_forward_hook(_contiguous_outputs)
        super().__init__(submodule, stage_index, num_stages, *args, **kwargs)

    def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        """torch learns what flows between stages by running each stage once, in training mode,
        before the first step: the first stage on the first micro-batch, the others on
        uninitialised tensors of the right shape, then a backward through that forward. Buffers
        (BatchNorm's running statistics) must never see it: it runs on copies of them, and the
        module gets its own back untouched (putting values back in place instead would change
        tensors that backward has saved). (torch itself keeps the random streams out of it.)"""
        owners = [
            (module, name, buffer)
            for module in self.submod.modules()
            for name, buffer in module._buffers.items()
            if buffer is not None
        ]
        copies: dict[int, torch.Tensor] = {}
        for module, name, buffer in owners:  # a buffer held twice gets one copy
            module._buffers[name] = copies.setdefault(id(buffer), buffer.detach().clone())
        try:
            return super()._forward_metadata_inference(*args, **kwargs)
        finally:
            for module, name, buffer in owners:
                module._buffers[name] = buffer

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return super().forward_one_chunk(*args, **kwargs)
        finally:
            self.busy_seconds += time.perf_counter() - began

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return super().backward_one_chunk(*args, **kwargs)
        finally:
            self.busy_seconds += time.perf_counter() - began

    def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return super().backward_weight_one_chunk(*args, **kwargs)
        finally:
            self.busy_seconds += time.perf_counter() - began


def _contiguous_outputs(_module: nn.Module, _inputs: Any, output: Any) -> Any:
    if isinstance(output, tuple):
        return tuple(_own_memory(o) for o in output)
    return _own_memory(output)


def _own_memory(value: Any) -> Any:
    """`value` as a tensor that is contiguous and no view of another: the zero-bubble schedules
    detach a stage's outputs in place, which torch refuses for a view (the passed-through
    hidden state of a Hugging Face stage is a slice)."""
    if isinstance(value, torch.Tensor) and (value._is_view() or not value.is_contiguous()):
        return value.clone(memory_format=torch.contiguous_format)
    return value
