"""A pipeline stage that times its own work. Its own module because it subclasses torch's
`PipelineStage`: `torch.distributed.pipelining` pulls in TorchDynamo (half a second of every
rank's start), so it is imported only when a run has a pipeline (pipeline.py's `Pipeline.start`).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.distributed.pipelining import PipelineStage


class TimedStage(PipelineStage):
    """A pipeline stage that adds up the time it spends computing (forward and backward chunks),
    so that the bubble, the time a rank waits, can be measured; and whose shape inference leaves
    no trace in the model."""

    busy_seconds: float = 0.0

    def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        """torch learns what flows between stages by running each stage once, in training mode,
        before the first step: the first stage on the first micro-batch, the others on
        uninitialised tensors of the right shape. Buffers (BatchNorm's running statistics) must
        never see that forward, so they are put back afterwards. (torch itself keeps the random
        streams out of it.)"""
        saved = [b.detach().clone() for b in self.submod.buffers()]
        try:
            return super()._forward_metadata_inference(*args, **kwargs)
        finally:
            with torch.no_grad():
                for buffer, value in zip(self.submod.buffers(), saved, strict=True):
                    buffer.copy_(value)

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
