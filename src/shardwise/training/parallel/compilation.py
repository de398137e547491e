"""`train.compile`: torch.compile applied the way the layout allows.

- **Whole model** where nothing wraps the blocks (one process, DDP and its compressed modes,
  the synchronisation modes without a wrapper: local SGD, DiLoCo, async): the model is compiled
  as `torch.compile(model)` compiles it, so the embeddings, the head and the residual stream
  between blocks fuse too. On one process a built-in loss is compiled in the same graph (the
  logits' upcast and the cross-entropy fuse with the head). Under DDP, DDP's own forward stays
  eager and the model inside it is compiled; dynamo's DDP optimizer splits its graph at DDP's
  gradient buckets, so each bucket's all-reduce still overlaps the rest of backward; a built-in
  loss is compiled apart.
- **Per block** where a wrapper needs the blocks eager around their graphs (FSDP2's gathers and
  reduce-scatters in its module hooks, pipeline stages, activation checkpointing, tensor
  parallelism): each block's own `forward` is compiled inside its wrapper, as torchtitan does.
  Identical blocks share one graph (dynamo guards on the blocks' structure, not on which block
  it is), so a 48-layer model compiles about as fast as a 2-layer one. What is not in a block
  (embeddings, head) runs eagerly; a built-in loss is compiled apart.

A user's loss (`train.loss = "package.module:function"`) is never compiled: it runs eagerly,
outside the graphs, and the start-up line says so. Evaluation runs eagerly
(`torch.compiler.set_stance("force_eager")`): compiling it would compile the model again in
eval mode, mid-run.

Compilation happens in the first step's forward and backward; the trainer reports its time
(`compile/seconds`) apart from the step time, and any graph compiled after the second step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.nn.parallel import DistributedDataParallel

from shardwise.training.parallel.pipeline import has_submodule

ForwardLoss = Callable[[Any, Any], torch.Tensor]
"""`(inputs, target) -> loss`: one micro-batch's forward and loss."""


def whole_model(degrees: dict[str, int], activation_checkpoint: str, wrapper: str) -> bool:
    """Whether the layout lets the model be compiled whole (see the module docstring)."""
    plain = degrees["pp"] == 1 and degrees["tp"] == 1 and activation_checkpoint == "none"
    return plain and wrapper in ("none", "ddp")


def apply_compile(part: nn.Module, blocks: list[str], *, backend: str) -> list[str]:
    """Compile the forward of each of `blocks` held by `part` (the whole part's when it holds
    none) with torch.compile's `backend`; returns the names compiled."""
    names = [b for b in blocks if has_submodule(part, b)] or [""]
    for name in names:
        module = part.get_submodule(name) if name else part
        while isinstance(module, CheckpointWrapper):
            module = module._checkpoint_wrapped_module
        module.forward = torch.compile(module.forward, backend=backend)
    return names


def forward_loss(
    part: nn.Module,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    *,
    compiled: str,
    builtin: bool,
    backend: str,
) -> ForwardLoss:
    """The callable a training step runs per micro-batch: `part`'s forward and the loss,
    compiled as `compiled` says (`whole`, or `blocks`: compiled by `apply_compile`; "" not at
    all) with torch.compile's `backend`; `builtin`: the loss is shardwise's own, and is
    compiled with the model or apart."""
    if not compiled:
        return lambda inputs, target: loss_fn(part(inputs), target)
    inner = part.module if isinstance(part, DistributedDataParallel) else part
    if compiled == "whole" and builtin and inner is part:  # one graph: model and loss
        return torch.compile(lambda inputs, target: loss_fn(part(inputs), target), backend=backend)
    if compiled == "whole":
        inner.compile(backend=backend)  # in place: the same module, its names unchanged
    loss = compiled_loss(loss_fn, builtin=builtin, backend=backend)
    return lambda inputs, target: loss(part(inputs), target)


def compiled_loss(
    loss_fn: Callable[[Any, Any], torch.Tensor], *, builtin: bool, backend: str
) -> Any:
    """A built-in loss compiled in a graph of its own (with torch.compile's `backend`); a
    user's as it is."""
    return torch.compile(loss_fn, backend=backend) if builtin else loss_fn


def describe_loss(loss: str, *, compiled: str, one_graph: bool, builtin: bool) -> str:
    """The start-up line's words for where the loss runs under `train.compile`."""
    if not builtin:
        return f"the loss ({loss}) is the user's and runs eagerly, outside the compiled graphs"
    if compiled == "whole" and one_graph:
        return f"the loss ({loss}) is compiled in the same graph as the model"
    return f"the loss ({loss}) is compiled in a graph of its own"


@dataclass
class CompileWatch:
    """What dynamo compiled during one run, from its process-wide counters: graphs and graph
    breaks up to the end of the second step (the compiling ones), and graphs compiled after it
    (recompilation: a shape, a flag or a guard that changed)."""

    graphs: int = 0
    breaks: int = 0
    _at_start: tuple[int, int] = (0, 0)
    _at_warm: tuple[int, int] = (0, 0)

    def start(self) -> None:
        self._at_start = _counts()

    def warmed_up(self) -> None:
        """The second step ended: what compiled so far is the run's compilation."""
        self._at_warm = _counts()
        self.graphs = self._at_warm[0] - self._at_start[0]
        self.breaks = self._at_warm[1] - self._at_start[1]

    def recompiled(self) -> int:
        """Graphs compiled since the second step."""
        return _counts()[0] - self._at_warm[0]

    @staticmethod
    def break_reasons() -> list[str]:
        """Each reason dynamo gave for a graph break in this process, its first line."""
        from torch._dynamo.utils import counters

        return [str(reason).strip().splitlines()[0] for reason in counters["graph_break"]]


def _counts() -> tuple[int, int]:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def eager() -> contextlib.AbstractContextManager[Any]:
    """Run compiled code eagerly (an evaluation, a one-off count): no graph is compiled for it."""
    return torch.compiler.set_stance("force_eager")  # type: ignore[no-any-return]
