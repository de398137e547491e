"""Models written the way users write them, not the way shardwise's built-ins are: BatchNorm,
tied weights, blocks called in a hand-written `forward` with a reshape between them, half of a
contract. The tests name them by import path (`tests.foreign_models:...`), as a user's job file
would."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import pipe_split
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel


class FailsInEvaluation(nn.Module):
    """Trains like any small classifier; its forward raises in eval mode."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            raise RuntimeError("injected failure in evaluation")
        out: torch.Tensor = self.body(x)
        return out


def fails_in_evaluation() -> nn.Module:
    return FailsInEvaluation()


def bn_cnn(*, channels: int = 8) -> nn.Sequential:
    """The tutorial CNN for 8×8 digits, with batch normalisation after each convolution (whose
    bias BatchNorm would cancel: left out, as ResNets do)."""
    return nn.Sequential(
        nn.Conv2d(1, channels, 3, padding=1, bias=False),
        nn.BatchNorm2d(channels),
        nn.ReLU(),
        nn.Conv2d(channels, 2 * channels, 3, padding=1, bias=False),
        nn.BatchNorm2d(2 * channels),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(2 * channels * 16, 10),
    )


def embed_layers_final(model: Any) -> list[str]:
    """The blocks of a language model with `embed`, `layers` and `final` that a pipeline stage
    may lack."""
    names = ["embed"] if model.embed is not None else []
    names += [f"layers.{k}" for k in model.layers]
    return names + (["final"] if model.final is not None else [])


class TiedLM(nn.Module):
    """A small language model whose output layer shares the embedding's weight (GPT-2's and most
    Hugging Face models' `tie_word_embeddings`), a sequence of blocks for pipelines."""

    def __init__(self, vocab: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.embed: nn.Embedding | None = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleDict(
            {
                str(i): nn.Sequential(
                    nn.LayerNorm(hidden),
                    nn.Linear(hidden, 2 * hidden),
                    nn.GELU(),
                    nn.Linear(2 * hidden, hidden),
                )
                for i in range(layers)
            }
        )
        self.final: nn.Sequential | None = nn.Sequential(
            nn.LayerNorm(hidden), nn.Linear(hidden, vocab, bias=False)
        )
        self.final[1].weight = self.embed.weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            h = self.embed(h)
        for layer in self.layers.values():
            h = h + layer(h)
        if self.final is not None:
            h = self.final(h)
        return h

    def pipeline_blocks(self) -> list[str]:
        return embed_layers_final(self)


def tied_lm(*, vocab: int = 256, hidden: int = 32, layers: int = 2) -> nn.Module:
    return TiedLM(vocab, hidden, layers)


def tied_lm_tp_plan(model: nn.Module, *, sequence_parallel: bool = False) -> dict[str, Any]:
    """The embedding split by vocabulary rows, the tied output layer by the same rows (its
    output columns), Megatron's MLP split in between."""
    del sequence_parallel
    plan: dict[str, Any] = {}
    if getattr(model, "embed", None) is not None:
        plan["embed"] = RowwiseParallel(input_layouts=Replicate())
    for key in getattr(model, "layers", {}):
        plan[f"layers.{key}.1"] = ColwiseParallel()
        plan[f"layers.{key}.3"] = RowwiseParallel()
    if getattr(model, "final", None) is not None:
        plan["final.1"] = ColwiseParallel(output_layouts=Replicate())
    return plan


class ModelParallelCNN(nn.Module):
    """Shaped like PyTorch's model-parallel tutorial: two parts called in `forward`, a reshape
    between them, BatchNorm in one and dropout in the other; no pipeline contract at all."""

    def __init__(self, channels: int = 8, marked: bool = False) -> None:
        super().__init__()
        self.marked = marked
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Linear(channels * 16, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        x = x.view(x.size(0), -1)
        if self.marked:
            pipe_split()  # where torch's tracer cuts the pipeline
        out: torch.Tensor = self.classifier(x)
        return out


def model_parallel_cnn(*, channels: int = 8) -> nn.Module:
    return ModelParallelCNN(channels)


class LateNormCNN(ModelParallelCNN):
    """ModelParallelCNN with a batch norm in its classifier too, so that a pipeline split at
    the classifier has running statistics in its last stage."""

    def __init__(self, channels: int = 8) -> None:
        super().__init__(channels)
        self.classifier = nn.Sequential(
            nn.Linear(channels * 16, 64, bias=False),
            nn.BatchNorm1d(64),
            nn.ReLU(),
            nn.Linear(64, 10),
        )


def late_norm_cnn(*, channels: int = 8) -> nn.Module:
    return LateNormCNN(channels)


def marked_cnn(*, channels: int = 8) -> nn.Module:
    return ModelParallelCNN(channels, marked=True)


class ResidualMLP(nn.Module):
    """Repeated layers in a ModuleList, called in a loop with a residual: no pipeline contract,
    but layers a pipeline, FSDP and activation checkpointing can find."""

    def __init__(self, hidden: int, layers: int) -> None:
        super().__init__()
        self.inp = nn.Linear(64, hidden)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, hidden), nn.GELU())
            for _ in range(layers)
        )
        self.out = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x.flatten(1))
        for layer in self.layers:
            h = h + layer(h)
        out: torch.Tensor = self.out(h)
        return out


def residual_mlp(*, hidden: int = 32, layers: int = 4) -> nn.Module:
    return ResidualMLP(hidden, layers)


class BiasFreeBlocks(ResidualMLP):
    """ResidualMLP whose repeated layers are bias-free linears alone (no norm): as FSDP units
    under float8's all-gather, all float8 weights, which gloo cannot all-gather."""

    def __init__(self, hidden: int, layers: int) -> None:
        super().__init__(hidden, layers)
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden, bias=False) for _ in range(layers))


def bias_free_blocks(*, hidden: int = 32, layers: int = 2) -> nn.Module:
    return BiasFreeBlocks(hidden, layers)


class HalfContract(nn.Module):
    """Names its blocks for pipelines but its forward does not skip the ones a stage lacks."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Sequential(nn.Flatten(), nn.Linear(64, 32))
        self.second = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.second(self.first(x))
        return out

    def pipeline_blocks(self) -> list[str]:
        return ["first", "second"]


def half_contract() -> nn.Module:
    return HalfContract()


class NamesAMissingBlock(HalfContract):
    def pipeline_blocks(self) -> list[str]:
        return ["first", "head"]


def names_a_missing_block() -> nn.Module:
    return NamesAMissingBlock()


def conv_tp_plan(model: nn.Module, *, sequence_parallel: bool = False) -> dict[str, Any]:
    """A plan that asks for a style on a layer type it does not support."""
    del model, sequence_parallel
    return {"0": ColwiseParallel()}


def loss_that_reads_a_value(outputs: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy that checks its value on the host every call, as a careful user might: on a
    GPU each call waits for the device."""
    loss = nn.functional.cross_entropy(outputs.flatten(0, -2), target.flatten())
    if not torch.isfinite(loss):  # bool(): a read of the value
        raise ValueError("non-finite loss")
    return loss


def norm_blocks(*, channels: int = 4) -> nn.Sequential:
    """Four blocks for 8×8 digits, each with one of torch's own normalisations that keep running
    statistics: BatchNorm2d, BatchNorm2d with momentum=None (a cumulative average),
    InstanceNorm2d with track_running_stats, and BatchNorm1d before the head; no bias before a
    norm (it cancels it: Adam would turn its zero gradient's rounding into full steps). Under a
    pipeline of two stages the first and the last stage both hold a batch norm."""
    c = channels
    return nn.Sequential(
        OrderedDict(
            first=nn.Sequential(
                nn.Conv2d(1, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU()
            ),
            second=nn.Sequential(
                nn.Conv2d(c, c, 3, padding=1, bias=False),
                nn.BatchNorm2d(c, momentum=None),
                nn.ReLU(),
            ),
            third=nn.Sequential(
                nn.Conv2d(c, c, 3, padding=1, bias=False),
                nn.InstanceNorm2d(c, affine=True, track_running_stats=True),
                nn.ReLU(),
            ),
            last=nn.Sequential(
                nn.Flatten(),
                nn.Linear(c * 64, 32, bias=False),
                nn.BatchNorm1d(32),
                nn.ReLU(),
                nn.Linear(32, 10),
            ),
        )
    )


class CountsCalls(nn.Module):
    """A layer that counts its forward calls in a buffer, in place, as some users' do."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x


def counts_calls() -> nn.Sequential:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), CountsCalls(), nn.Linear(32, 10))


def sync_batch_norm() -> nn.Sequential:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.SyncBatchNorm(32), nn.Linear(32, 10))


def record_ids(inputs: torch.Tensor, tags: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A streamed table's batch transform for tests: the target column `tag` is id·10 + label;
    each micro-batch's ids are appended, one line, to `$SHARDWISE_TEST_IDS/rank<RANK>.txt` (the
    samples each rank trained on, in order), and the labels are the target."""
    import os
    from pathlib import Path

    folder = os.environ.get("SHARDWISE_TEST_IDS")
    if folder:
        line = " ".join(str(int(i)) for i in tags // 10)
        with (Path(folder) / f"rank{os.environ.get('RANK', '0')}.txt").open("a") as f:
            f.write(line + "\n")
    return inputs, tags % 10


class DigitsStream(torch.utils.data.IterableDataset):
    """The digits as a user's own IterableDataset: this rank's share (every dp_size-th sample
    from dp_rank), in a fixed order; it keeps its position and says it (`state_dict`)."""

    def __init__(self, dp_rank: int, dp_size: int) -> None:
        from shardwise.training.data.digits import build_digits

        train, _ = build_digits()
        self.items = [train[i] for i in range(dp_rank, len(train), dp_size)]
        self.position = 0

    def __iter__(self):
        while self.position < len(self.items):
            self.position += 1
            yield self.items[self.position - 1]
        self.position = 0  # the next epoch starts over

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])


def digits_stream(*, dp_rank: int = 0, dp_size: int = 1) -> tuple[Any, Any]:
    from shardwise.training.data.digits import build_digits

    return DigitsStream(dp_rank, dp_size), build_digits()[1]


class Rotary(nn.Module):
    """Rotary position embedding's frequencies, computed once in `__init__` as a buffer that
    is not saved (Llama's `inv_freq`): no initialiser sets it again."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        inv_freq = 1.0 / (10_000 ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        angles = torch.arange(h.shape[1], dtype=torch.float)[:, None] * self.inv_freq
        return torch.cat([angles.cos(), angles.sin()], dim=-1)


class RopeLM(nn.Module):
    """A small language model shaped like Llama as users write it by hand: a rotary-embedding
    module outside the blocks that every block reads (so every pipeline stage holds its
    buffer), blocks named by `pipeline_blocks()`, and nanoGPT's `init_weights`, which sets the
    linear and embedding weights only."""

    def __init__(self, vocab: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.rotary = Rotary(hidden)
        self.embed: nn.Embedding | None = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleDict({str(i): nn.Linear(hidden, hidden) for i in range(layers)})
        self.final: nn.Linear | None = nn.Linear(hidden, vocab)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            h = self.embed(h)
        rope = self.rotary(h)
        for layer in self.layers.values():
            h = h + torch.tanh(layer(h * rope))
        if self.final is not None:
            h = self.final(h)
        return h

    def pipeline_blocks(self) -> list[str]:
        return embed_layers_final(self)

    def init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)


def rope_lm(*, vocab: int = 256, hidden: int = 16, layers: int = 4) -> nn.Module:
    return RopeLM(vocab, hidden, layers)


class GatedResidualMLP(ResidualMLP):
    """ResidualMLP whose every layer is gated by a value computed once from the input before
    the first layer (as BERT's layers all read the attention mask made from its input): traced
    into stages, the later stages take it from the first."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.flatten(1)
        gate = torch.sigmoid(flat.mean(1, keepdim=True)).expand(-1, self.out.in_features)
        h = self.inp(flat)
        for layer in self.layers:
            h = h + layer(h) * gate
        out: torch.Tensor = self.out(h)
        return out


def gated_residual_mlp(*, hidden: int = 32, layers: int = 4) -> nn.Module:
    return GatedResidualMLP(hidden, layers)


def torchvision_resnet18(*, classes: int = 10) -> nn.Module:
    """torchvision's resnet18 as users build it: not a sequence of blocks (a pipeline traces
    it), batch norms throughout."""
    from torchvision.models import resnet18

    model: nn.Module = resnet18(num_classes=classes)
    return model


def torchvision_problem() -> str | None:
    """Why torchvision's models cannot be imported here, or None where they can. PyPI's
    torchvision wheels for Linux are built against torch's CUDA build (`libc10_cuda.so`); on
    torch's CPU build its import fails."""
    try:
        import torchvision.models  # noqa: F401
    except ImportError:
        return (
            "torchvision is not installed: PyPI's torchvision for Linux loads only beside "
            "torch's CUDA build, and make installs torch's CPU build (constraints.txt)"
        )
    except (OSError, RuntimeError) as e:
        return f"torchvision does not load beside this torch ({type(e).__name__}: {e})"
    return None


class SharedScale(nn.Module):
    """One parameter given to two modules as they are built (not tied afterwards)."""

    def __init__(self) -> None:
        super().__init__()
        scale = nn.Parameter(torch.ones(4))
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)
        self.first.scale = scale
        self.second.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.second(self.first(x) * self.first.scale) * self.second.scale
        return out


def shared_scale() -> nn.Module:
    return SharedScale()
