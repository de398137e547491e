"""A byte-level GPT (decoder-only transformer, pre-norm), after nanoGPT.

Blocks live in a `ModuleDict` keyed by their index and every top-level part may be absent, so a
pipeline stage can delete the parts it does not own and keep the others' names (the torchtitan
convention); checkpoints then use the same names under every layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812 (the conventional name)
from torch import nn


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.heads, -1).transpose(1, 3).unbind(2)
        drop = self.dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=drop)
        out = out.transpose(1, 2).reshape(batch, seq, -1)
        projected: torch.Tensor = self.proj(out)
        return projected


class MLP(nn.Module):
    def __init__(self, hidden: int, ratio: int) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, ratio * hidden)
        self.down = nn.Linear(ratio * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(F.gelu(self.up(x)))
        return out


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, mlp_ratio: int, dropout: float) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads, dropout)
        self.mlp_norm = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden, mlp_ratio)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.attn_norm(x)))
        out: torch.Tensor = x + self.drop(self.mlp(self.mlp_norm(x)))
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
        self.seq_len = seq_len
        self.tok_emb: nn.Embedding | None = nn.Embedding(vocab, hidden)
        self.pos_emb: nn.Embedding | None = nn.Embedding(seq_len, hidden)
        self.layers = nn.ModuleDict(
            {str(i): Block(hidden, heads, mlp_ratio, dropout) for i in range(layers)}
        )
        self.norm: nn.LayerNorm | None = nn.LayerNorm(hidden)
        self.head: nn.Linear | None = nn.Linear(hidden, vocab, bias=False)
        self.apply(_init_weights)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = tokens
        if self.tok_emb is not None and self.pos_emb is not None:
            seq = tokens.shape[1]
            if seq > self.seq_len:
                raise ValueError(
                    f"input of {seq} tokens is longer than the model's seq_len {self.seq_len}; "
                    "raise model.args.seq_len or lower data.args.seq_len"
                )
            positions = torch.arange(seq, device=tokens.device)
            h = self.tok_emb(tokens) + self.pos_emb(positions)
        for block in self.layers.values():
            h = block(h)
        if self.norm is not None:
            h = self.norm(h)
        if self.head is not None:
            h = self.head(h)
        return h


def _init_weights(module: nn.Module) -> None:
    # GPT-2's initialisation: normal(0, 0.02) for weights, zero biases.
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def build_gpt(
    *,
    layers: int = 4,
    heads: int = 4,
    hidden: int = 128,
    seq_len: int = 128,
    vocab: int = 256,
    mlp_ratio: int = 4,
    dropout: float = 0.0,
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
