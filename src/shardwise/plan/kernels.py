"""What a training step asks of a GPU besides its matrix multiplies, counted, not assumed: the
operators the host dispatches (each a launch it must make before the device can run it) and the
bytes the memory-bound operators read and write (layer norms, activations, residual adds,
autocast's casts, the loss), at the planned model's width.

They are counted on shardwise's own GPT block: one block and the parts around the blocks
(embedding, head, loss) run forward and backward on fake CPU tensors of the planned width with a
few tokens (torch's FakeTensorMode: CPU tensors to every operator, autocast's included, that
hold no data and compute nothing; under bf16 autocast where the plan's precision autocasts),
every dispatched operator counted and, for those that are neither matrix multiplies nor
attention (whose traffic their FLOP rate covers) nor views, the bytes of their inputs and
outputs summed. The counts are those of real tensors (a test compares them), which took a
2048-wide GPT with a 32,000-token vocabulary 73 s and 3.9 GB on a 2-core CPU (bf16 autocast on
a CPU is slow), where fake ones take about a second and no memory of the model's size. Bytes split
into a part per token (activations) and a part per micro-batch (the weights autocast casts) by
counting at two micro-batches; dispatches do not depend on the batch. The optimizer step's and
gradient clipping's dispatches, which depend on how many parameters there are and not on their
width, are counted on real tensors of a narrow model of the same two blocks.

This module must not import the trainer's loop; it builds the model from models/gpt.py.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 (the conventional name)
from torch.utils._python_dispatch import TorchDispatchMode

COMPUTE = ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "convolution", "attention")
"""Operators whose traffic the FLOP rate already covers (a substring of the operator's name)."""
TOKENS = 8
"""Tokens per traced micro-batch (a short sequence: the counts scale with tokens exactly)."""


@dataclass(frozen=True)
class Work:
    """Per micro-batch, forward and backward: dispatches and bytes of one layer and of the rest;
    per step: the optimizer's and clipping's dispatches."""

    layer_ops: float
    other_ops: float
    step_ops: float
    layer_bytes_per_token: float
    layer_bytes: float
    """Per layer and micro-batch, whatever the tokens (autocast's casts of the weights)."""
    other_bytes_per_token: float
    other_bytes: float

    def ops(self, *, layers: int, microbatches: int) -> float:
        return microbatches * (layers * self.layer_ops + self.other_ops) + self.step_ops

    def bytes(self, *, layers: int, microbatches: int, tokens: int) -> float:
        """Memory-bound bytes of a step: `tokens` per micro-batch."""
        layer = tokens * self.layer_bytes_per_token + self.layer_bytes
        other = tokens * self.other_bytes_per_token + self.other_bytes
        return microbatches * (layers * layer + other)


class _Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ops, self.bytes = 0, 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.namespace == "prim":  # a fake tensor's `.device`, asked of it, not dispatched
            return out
        self.ops += 1
        name = func.overloadpacket.__name__
        if not any(word in name for word in COMPUTE):
            inputs = _tensors((args, kwargs))
            outputs = _tensors(out)
            storages = {_storage(t) for t in inputs}
            view = not name.endswith("_") and all(_storage(t) in storages for t in outputs)
            if not view:
                self.bytes += sum(_nbytes(t) for t in inputs + outputs)
        return out


def _storage(t: torch.Tensor) -> int:
    """Which storage `t` views (a fake tensor's has no data pointer to compare)."""
    return int(t.untyped_storage()._cdata)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    return []


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@lru_cache(maxsize=64)
def work(*, hidden: int, heads: int, ffn: int, vocab: int, autocast: bool) -> Work:
    """What one micro-batch of the built-in GPT at this shape asks of the host and memory (see
    the module docstring); `autocast`: under bf16 autocast."""
    return _work(hidden=hidden, heads=heads, ffn=ffn, vocab=vocab, autocast=autocast, fake=True)


def _work(*, hidden: int, heads: int, ffn: int, vocab: int, autocast: bool, fake: bool) -> Work:
    """`work`, on fake tensors or real ones. The optimizer step's dispatches depend on how many
    parameters there are, not on their width: with fake tensors they are counted on real ones
    of a narrow model of the same blocks (torch's foreach kernels take no fake tensor: its
    gradient norm came to one operator per parameter)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() if fake else contextlib.nullcontext():
        model = _gpt(hidden=hidden, heads=heads, ffn=ffn, vocab=vocab)
        one = _counted(model, layers=1, batch=1, autocast=autocast)
        two = _counted(model, layers=2, batch=1, autocast=autocast)
        two_batches = _counted(model, layers=2, batch=2, autocast=autocast)
        one_two_batches = _counted(model, layers=1, batch=2, autocast=autocast)
    step_ops = _step_ops(_gpt(hidden=heads, heads=heads, ffn=heads, vocab=2) if fake else model)
    layer = (two[0] - one[0], two[1] - one[1])
    layer_2 = two_batches[1] - one_two_batches[1]  # the layer's bytes at two micro-batches' tokens
    per_token = (layer_2 - layer[1]) / TOKENS
    other_bytes_1 = one[1] - layer[1]
    other_bytes_2 = one_two_batches[1] - layer_2
    other_per_token = (other_bytes_2 - other_bytes_1) / TOKENS
    return Work(
        layer_ops=layer[0],
        other_ops=one[0] - layer[0],
        step_ops=step_ops,
        layer_bytes_per_token=per_token,
        layer_bytes=max(0.0, layer[1] - per_token * TOKENS),
        other_bytes_per_token=other_per_token,
        other_bytes=max(0.0, other_bytes_1 - other_per_token * TOKENS),
    )


def _gpt(*, hidden: int, heads: int, ffn: int, vocab: int) -> Any:
    """The built-in GPT of two blocks at this shape, on the current mode's tensors."""
    from shardwise.models.gpt import build_gpt

    return build_gpt(
        layers=2,
        heads=heads,
        hidden=hidden,
        seq_len=TOKENS,
        vocab=vocab,
        mlp_ratio=max(1, ffn // hidden),
    )


def _counted(model: Any, *, layers: int, batch: int, autocast: bool) -> tuple[int, int]:
    """Dispatches and memory-bound bytes of a forward and backward through the first `layers`
    blocks, the embedding, the head and the loss."""
    tokens = torch.zeros(batch, TOKENS, dtype=torch.long)
    blocks = list(model.layers.values())[:layers]
    cast = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    counter = _Counter()
    with counter:
        with cast:
            h = model.embed(tokens)
            for block in blocks:
                h = block(h)
            loss = F.cross_entropy(model.final(h).flatten(0, -2).float(), tokens.flatten())
        loss.backward()
    model.zero_grad(set_to_none=True)
    return counter.ops, counter.bytes


def _step_ops(model: Any) -> int:
    """Dispatches of gradient clipping and a fused AdamW step (two parameter groups, as the
    trainer's)."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    groups: list[dict[str, Any]] = [
        {"params": [p for p in model.parameters() if p.dim() >= 2]},
        {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, fused=True)
    optimizer.step()  # the state exists: a step's work, not its first step's
    counter = _Counter()
    with counter:
        norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        torch._foreach_mul_([p.grad for p in model.parameters()], torch.clamp(1 / norm, max=1.0))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return counter.ops


def dispatch_seconds(device: torch.device, *, autocast: bool = True) -> float:
    """Seconds the host takes per operator it dispatches, on `device`: a GPT block too small to
    keep a GPU busy (width 64, 16 tokens) run forward and backward 50 times without waiting, its
    time over its dispatches (counted apart: counting costs time too); the best of three."""
    from shardwise.common.devices import best_seconds
    from shardwise.models.gpt import build_gpt

    block = build_gpt(layers=1, heads=4, hidden=64, seq_len=16).layers["0"].to(device)
    x = torch.randn(1, 16, 64, device=device, requires_grad=True)
    cast = (
        torch.autocast(device.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    )

    def once() -> None:
        with cast:
            y = block(x)
        y.float().sum().backward()

    counter = _Counter()
    with counter:
        once()

    def fifty() -> None:
        for _ in range(50):
            once()

    return best_seconds(fifty, repeats=3, inner=1, device=device) / (50 * counter.ops)
