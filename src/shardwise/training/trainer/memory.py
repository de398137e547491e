"""What each rank holds: parameter, gradient and optimizer-state bytes, counted from the tensors
this rank actually stores (its shard of a DTensor, not the global size), and the peak memory of
the process.

On CUDA the peak is the allocator's peak; on the CPU it is the process's peak resident set size,
which also counts the Python interpreter and torch's libraries (a few hundred MB).
"""

from __future__ import annotations

import resource
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes this rank stores for these tensors (the local shard of a DTensor)."""
    total = 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def state_bytes(
    parts: list[nn.Module],
    optimizers: list[torch.optim.Optimizer] | None = None,
    *,
    optimizer_states_per_param: int | None = None,
) -> dict[str, int]:
    """Parameter, gradient and optimizer-state bytes on this rank.

    Gradients are counted as one per trainable parameter, in the parameter's dtype and shard (they
    are freed after each step). Optimizer state is counted from the optimizers' tensors once they
    exist, or, before the first step (a dry run), as `optimizer_states_per_param` fp32 tensors
    shaped like each trainable parameter (AdamW: 2, SGD with momentum: 1).
    """
    params = list({id(p): p for part in parts for p in part.parameters()}.values())
    trainable = [p for p in params if p.requires_grad]
    out = {"params": local_bytes(params), "grads": local_bytes(trainable)}
    states = [
        t
        for optimizer in optimizers or []
        for state in optimizer.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    ]
    if states:
        out["optimizer"] = local_bytes(states)
    else:
        per = optimizer_states_per_param or 0
        out["optimizer"] = per * sum(
            (p.to_local() if isinstance(p, DTensor) else p).numel() * 4 for p in trainable
        )
    return out


def current_bytes(device: torch.device) -> int:
    """The memory this process holds now (CUDA: allocated; CPU: resident set size)."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_bytes(device: torch.device) -> int:
    """The peak memory of this process so far."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
