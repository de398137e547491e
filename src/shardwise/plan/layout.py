"""A candidate layout and the training precision: what the memory and time models take."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Recompute = Literal["none", "selective", "full"]
RECOMPUTE: tuple[Recompute, ...] = ("none", "selective", "full")


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    """ZeRO stage (Rajbhandari et al. 2019): 0 none (DDP), 1 optimizer states sharded over the
    data-parallel ranks, 2 also gradients, 3 also parameters (FSDP)."""
    micro_batch: int = 1
    microbatches: int = 1
    """Micro-batches per data-parallel rank per step (pipeline micro-batches, or gradient
    accumulation without a pipeline)."""
    recompute: Recompute = "none"
    sequence_parallel: bool = False
    schedule: str = "1F1B"
    stages_per_rank: int = 1
    offload_optimizer: bool = False
    """ZeRO-Offload: optimizer states (and the update) in host memory."""
    unsharded_accumulation: bool = False
    """Gradients accumulate unsharded across micro-batches and are reduce-scattered once per
    step (FSDP with gradient sync off until the last micro-batch, as shardwise runs it), rather
    than reduce-scattered after every micro-batch (DeepSpeed's ZeRO-2)."""
    hold_gathered_params: bool = False
    """FSDP with `reshard_after_forward = false` (shardwise's "ZeRO-2"): parameters are sharded
    at rest but gathered whole from the forward pass to the end of the backward pass."""

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def global_batch(self) -> int:
        return self.dp * self.micro_batch * self.microbatches

    def name(self) -> str:
        parts = [f"dp{self.dp}"]
        if self.zero:
            parts.append(f"zero{self.zero}")
        if self.tp > 1:
            parts.append(f"tp{self.tp}" + ("+sp" if self.sequence_parallel else ""))
        if self.pp > 1:
            parts.append(f"pp{self.pp}")
            if self.stages_per_rank > 1:
                parts.append(f"v{self.stages_per_rank}")
        parts.append(f"mb{self.micro_batch}x{self.microbatches}")
        if self.recompute != "none":
            parts.append(f"rc-{self.recompute}")
        if self.offload_optimizer:
            parts.append("offload")
        return " ".join(parts)


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter for each kind of model state, and per activation value."""

    name: str
    param: int
    grad: int
    master: int
    """An fp32 copy of the parameters the optimizer updates (mixed precision only)."""
    activation: int

    def optimizer_bytes(self, optimizer: str) -> int:
        """K in the ZeRO paper: the master copy plus the optimizer's fp32 states (Adam: momentum
        and variance; SGD with momentum: one; plain SGD: none)."""
        states = {"adamw": 2, "adam": 2, "sgd-momentum": 1, "sgd": 0}[optimizer]
        return self.master + 4 * states


PRECISIONS = {
    "bf16": Precision("bf16", param=2, grad=2, master=4, activation=2),
    "fp16": Precision("fp16", param=2, grad=2, master=4, activation=2),
    "fp32": Precision("fp32", param=4, grad=4, master=0, activation=4),
    # shardwise's own mixed precision: fp32 parameters and gradients, 16-bit autocast compute
    "bf16-autocast": Precision("bf16-autocast", param=4, grad=4, master=0, activation=2),
    "fp16-autocast": Precision("fp16-autocast", param=4, grad=4, master=0, activation=2),
}
OPTIMIZERS = ("adamw", "adam", "sgd-momentum", "sgd")
