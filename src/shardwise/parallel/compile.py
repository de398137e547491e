"""`train.compile`: torch.compile per block, as torchtitan does.

Each block's own `forward` is compiled, not the module around it: the wrappers' work stays eager
and outside the graphs (FSDP2's gathers and reduce-scatters run in its module hooks, activation
checkpointing wraps the block from outside, DDP hooks the parameters), so compiling composes with
every layout without tracing a collective. Identical blocks share one graph (dynamo guards on the
blocks' structure, not on which block it is), so a 48-layer model compiles about as fast as a
2-layer one. What is not in a block (embeddings, the head, the loss) runs eagerly; a model without
blocks is compiled whole.

Compilation happens in the first step's forward and backward; the trainer reports its time
(`compile/seconds`) apart from the step time.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from shardwise.parallel.pipeline import has_submodule


def apply_compile(part: nn.Module, blocks: list[str]) -> list[str]:
    """Compile the forward of each of `blocks` held by `part` (the whole part's when it holds
    none); returns the names compiled."""
    names = [b for b in blocks if has_submodule(part, b)] or [""]
    for name in names:
        module = part.get_submodule(name) if name else part
        while isinstance(module, CheckpointWrapper):
            module = module._checkpoint_wrapped_module
        module.forward = torch.compile(module.forward)
    return names
