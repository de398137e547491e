"""A byte-level GPT (decoder-only transformer, pre-norm), after nanoGPT, shaped for every layout.

- A sequence of blocks (`embed`, `layers.0` … `layers.N-1`, `final`) whose parts may be absent,
  so a pipeline stage deletes the blocks it does not own and keeps the others' names (the
  torchtitan convention); checkpoints then use the same names under every layout.
- Separate query, key and value projections, so tensor parallelism can split them by heads
  (`tp_plan`).
- `init_weights(module)`: GPT-2's initialisation, one module at a time, so the model can be built
  on the meta device and each rank initialise only its shard (parallel/meta_init.py).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Annotated

import torch
import torch.nn.functional as F  # noqa: N812 (the conventional name)
from pydantic import Field, PositiveInt
from torch import nn

if TYPE_CHECKING:  # DTensor's import takes 0.5 s: imported where a plan is made (the ranks)
    from torch.distributed.tensor.parallel import ParallelStyle, PrepareModuleInput


class Embed(nn.Module):
    """Token plus learned position embeddings."""

    def __init__(self, vocab: int, seq_len: int, hidden: int) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq_len, hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        if seq > self.seq_len:
            raise ValueError(
                f"input of {seq} tokens is longer than the model's seq_len {self.seq_len}; "
                "raise model.args.seq_len or lower data.args.seq_len"
            )
        positions = torch.arange(seq, device=tokens.device)
        out: torch.Tensor = self.tok(tokens) + self.pos(positions)
        return out


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, dropout: float, residual_std: float) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = hidden // heads
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.proj.init_std = residual_std  # type: ignore[assignment]
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds only its share of the heads
        q, k, v = (
            proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
            for proj in (self.q, self.k, self.v)
        )
        drop = self.dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=drop)
        projected: torch.Tensor = self.proj(out.transpose(1, 2).reshape(batch, seq, -1))
        return projected


class MLP(nn.Module):
    def __init__(self, hidden: int, ratio: int, residual_std: float) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, ratio * hidden)
        self.down = nn.Linear(ratio * hidden, hidden)
        self.down.init_std = residual_std  # type: ignore[assignment]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(F.gelu(self.up(x)))
        return out


class Block(nn.Module):
    def __init__(
        self, hidden: int, heads: int, mlp_ratio: int, dropout: float, residual_std: float
    ) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads, dropout, residual_std)
        self.mlp_norm = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden, mlp_ratio, residual_std)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.attn_norm(x)))
        out: torch.Tensor = x + self.drop(self.mlp(self.mlp_norm(x)))
        return out


class Final(nn.Module):
    """The last norm and the projection to byte logits."""

    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.norm(h))
        return out


class GPT(nn.Module):
    def __init__(
        self,
        *,
        vocab: int,
        seq_len: int,
        layers: int,
        heads: int,
        hidden: int,
        mlp_ratio: int,
        dropout: float,
    ) -> None:
        super().__init__()
        # GPT-2 scales the init of the projections into the residual stream by 1/sqrt(2·layers):
        # each block adds two of them to the residual.
        residual_std = 0.02 / math.sqrt(2 * layers)
        self.embed: Embed | None = Embed(vocab, seq_len, hidden)
        self.layers = nn.ModuleDict(
            {str(i): Block(hidden, heads, mlp_ratio, dropout, residual_std) for i in range(layers)}
        )
        self.final: Final | None = Final(hidden, vocab)
        for module in self.modules():
            self.init_weights(module)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """Tokens in, logits out; a pipeline stage takes and returns hidden states where its
        first or last block is missing."""
        if self.embed is not None:
            h = self.embed(h)
        for block in self.layers.values():
            h = block(h)
        if self.final is not None:
            h = self.final(h)
        return h

    def pipeline_blocks(self) -> list[str]:
        """The blocks present, in the order data flows through them."""
        names = ["embed"] if self.embed is not None else []
        names += [f"layers.{key}" for key in self.layers]
        return names + (["final"] if self.final is not None else [])

    @staticmethod
    def init_weights(module: nn.Module) -> None:
        """GPT-2's initialisation of one module: normal(0, 0.02) weights (scaled down for the
        residual projections), zero biases; norms keep their defaults (ones and zeros)."""
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=getattr(module, "init_std", 0.02))
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def tp_plan(self, *, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
        """Megatron-style tensor parallelism (Shoeybi et al., 2019): query, key, value and the
        MLP's first layer split by output columns (so by heads), the attention output and the MLP's
        second layer by input rows, one all-reduce after each. With sequence parallelism
        (Korthikanti et al., 2022) the norms and dropouts between them work on a slice of the
        sequence instead of a replica, and the all-reduces become reduce-scatter + all-gather."""
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleInput,
            PrepareModuleOutput,
            RowwiseParallel,
            SequenceParallel,
        )

        seq = Shard(1)
        plan: dict[str, ParallelStyle] = {}
        if self.embed is not None:
            plan["embed.tok"] = RowwiseParallel(input_layouts=Replicate())
            if sequence_parallel:
                plan["embed"] = PrepareModuleOutput(
                    output_layouts=Replicate(), desired_output_layouts=seq
                )
        for key in self.layers:
            prefix = f"layers.{key}"
            out = seq if sequence_parallel else Replicate()
            plan.update(
                {
                    f"{prefix}.attn.q": ColwiseParallel(),
                    f"{prefix}.attn.k": ColwiseParallel(),
                    f"{prefix}.attn.v": ColwiseParallel(),
                    f"{prefix}.attn.proj": RowwiseParallel(output_layouts=out),
                    f"{prefix}.mlp.up": ColwiseParallel(),
                    f"{prefix}.mlp.down": RowwiseParallel(output_layouts=out),
                }
            )
            if not sequence_parallel:
                # query, key and value take the input as one DTensor, so backward sums their
                # gradients before a single all-reduce (rather than one each)
                plan[f"{prefix}.attn"] = PrepareModuleInput(
                    input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)
                )
            else:
                plan.update(
                    {
                        f"{prefix}.attn_norm": SequenceParallel(),
                        f"{prefix}.attn": _gather_sequence(),
                        f"{prefix}.mlp_norm": SequenceParallel(),
                        f"{prefix}.mlp": _gather_sequence(),
                    }
                )
        if self.final is not None:
            if sequence_parallel:
                plan["final.norm"] = SequenceParallel()
            plan["final.head"] = ColwiseParallel(
                input_layouts=seq if sequence_parallel else Replicate(),
                output_layouts=Replicate(),
            )
        return plan


def _gather_sequence() -> PrepareModuleInput:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput

    return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))


def build_gpt(
    *,
    layers: PositiveInt = 4,
    heads: PositiveInt = 4,
    hidden: PositiveInt = 128,
    seq_len: PositiveInt = 128,
    vocab: PositiveInt = 256,
    mlp_ratio: PositiveInt = 4,
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.0,
) -> GPT:
    """A byte-level GPT; `vocab = 256` covers every byte."""
    if hidden % heads:
        raise ValueError(f"model.args.hidden ({hidden}) must be a multiple of heads ({heads})")
    return GPT(
        vocab=vocab,
        seq_len=seq_len,
        layers=layers,
        heads=heads,
        hidden=hidden,
        mlp_ratio=mlp_ratio,
        dropout=dropout,
    )
