"""The model being planned: a decoder-only transformer's shape, and the counts that follow from
it (parameters, FLOPs per token) in the notation of Narayanan et al., "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM" (SC'21, arXiv:2104.04473), §5.1 and
Appendix: l layers, h hidden size, a attention heads, s sequence length, V vocabulary, B batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Transformer:
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    ffn: int = 0
    """The MLP's inner size; 0 means 4 × hidden."""
    tied_embeddings: bool = True
    """The output layer reuses the token embedding (Megatron, GPT-2); False adds V·h."""
    measured_params: int | None = None
    """The exact count when the model was built (from a job file); overrides the formula."""
    assumed_shape: bool = False
    """The shape was guessed from a bare parameter count (only activations depend on it)."""

    @property
    def ffn_size(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def layer_params(self) -> int:
        """One block: q, k, v, output projections with biases (4h² + 4h), the MLP with biases
        (2·h·f + f + h) and two layer norms (4h) — 12h² + 13h for f = 4h (Megatron's count)."""
        h, f = self.hidden, self.ffn_size
        return 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h

    @property
    def embedding_params(self) -> int:
        """Token and position embeddings (V·h + s·h), plus the output layer when untied."""
        h = self.hidden
        return (self.vocab + self.seq) * h + (0 if self.tied_embeddings else self.vocab * h)

    @property
    def params(self) -> int:
        if self.measured_params is not None:
            return self.measured_params
        return self.layers * self.layer_params + self.embedding_params

    def forward_flops_per_token(self) -> float:
        """Matrix-multiply FLOPs of one token's forward pass: per layer 2·(4h² + 2hf) for the
        projections and MLP plus 4·s·h for attention scores and their weighted sum, and 2·h·V for
        the logits (Narayanan et al., Appendix: 24h² + 4sh per layer for f = 4h)."""
        h, f, s = self.hidden, self.ffn_size, self.seq
        return self.layers * (2 * (4 * h * h + 2 * h * f) + 4 * s * h) + 2 * h * self.vocab

    def train_flops_per_token(self, recompute: str = "none") -> float:
        """Forward + backward (backward costs twice the forward): 3 × forward; full recomputation
        runs each layer's forward again (4 × for the layers, 3 × for the logits); selective
        recomputation re-runs only the attention core (the 4·s·h term) — Korthikanti et al.
        2022, §5."""
        h, s, v = self.hidden, self.seq, self.vocab
        logits = 2 * h * v
        layers = self.forward_flops_per_token() - logits
        extra = {"none": 0.0, "selective": self.layers * 4 * s * h, "full": layers}[recompute]
        return 3 * (layers + logits) + extra

    def stage_params(self, pp: int, tp: int) -> float:
        """Ψ of one device of the most loaded pipeline stage: its share of the layers and the
        embeddings, split across `tp`; a built model's exact count scales the formula."""
        formula = self.layers * self.layer_params + self.embedding_params
        scale = 1.0 if self.measured_params is None else self.measured_params / formula
        return scale * (self.layers_per_stage(pp) * self.layer_params + self.embedding_params) / tp

    def layers_per_stage(self, pp: int) -> int:
        """Layers on the most loaded of `pp` pipeline stages."""
        return -(-self.layers // pp)


def megatron_params(layers: int, hidden: int, vocab: int, seq: int) -> float:
    """Narayanan et al. 2021, §5.1: P = 12·l·h²·(1 + 13/(12h) + (V + s)/(12·l·h))."""
    h = hidden
    return 12 * layers * h * h * (1 + 13 / (12 * h) + (vocab + seq) / (12 * layers * h))


def megatron_flops_per_iteration(
    batch: int, layers: int, hidden: int, vocab: int, seq: int
) -> float:
    """Narayanan et al. 2021, §5.1 (with activation recomputation):
    F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))."""
    b, s, h = batch, seq, hidden
    return 96 * b * s * layers * h * h * (1 + s / (6 * h) + vocab / (16 * layers * h))


def megatron_training_days(tokens: float, params: float, gpus: int, flops_per_gpu: float) -> float:
    """Narayanan et al. 2021, §5.1: end-to-end time ≈ 8·T·P / (n·X) (with recomputation)."""
    return 8 * tokens * params / (gpus * flops_per_gpu) / 86_400


def shape_for(params: float, *, seq: int = 2048, vocab: int = 32_000) -> Transformer:
    """A plausible shape for a bare parameter count, so activations can be estimated: the
    hidden size about 128 × the layer count (GPT-3 175B: h = 12288, l = 96; LLaMA 7B: 4096, 32),
    rounded to a multiple of 512 (256 below 2048), heads of 128. Model-state memory does not
    depend on it."""
    ideal = (params * 128 / 12) ** (1 / 3)
    step = 512 if ideal >= 2048 else 256
    hidden = max(256, round(ideal / step) * step)
    layers = max(1, round((params - vocab * hidden) / (12 * hidden * hidden)))
    return Transformer(
        layers=layers,
        hidden=hidden,
        heads=max(1, hidden // 128),
        vocab=vocab,
        seq=seq,
        measured_params=int(params),
        assumed_shape=True,
    )


def describe(model: Transformer) -> str:
    billions = model.params / 1e9
    size = f"{billions:.2f}B" if billions >= 0.1 else f"{model.params / 1e6:.2f}M"
    shape = (
        f"{model.layers} layers, hidden {model.hidden}, {model.heads} heads, "
        f"vocab {model.vocab}, seq {model.seq}"
    )
    if model.assumed_shape:
        shape = f"shape assumed for activations: {shape}"
    return f"{size} parameters ({shape})"


def divisors(n: int) -> list[int]:
    """The divisors of `n` in increasing order, found in √n steps (in pairs d, n/d)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]
