"""Utilisation, honestly: the FLOPs a step does, and the rate this device can do them at.

FLOPs are counted, not estimated from a formula: the model is built on the meta device (no
memory, no time) and one micro-batch's forward, loss and backward run on fake tensors under
torch's `FlopCounterMode`, which counts every matrix multiply, convolution and attention call by
its shape; whatever the model is (transformers skips its value checks on fake tensors). A model
whose forward reads values cannot run so: it is counted on one real micro-batch through the
run's own model instead, leaving training as it was (random states and buffers restored,
gradients dropped). A step is that count × the micro-batches of the global batch.
Recomputation (activation checkpointing) is not counted: MFU is model FLOPs over time, as in
PaLM (Chowdhery et al., 2022), so recomputing costs utilisation rather than hiding in it.

The peak is devices.py's: the best matrix-multiply rate in the precision the model's matrix
multiplies run in, the same measurement `shardwise plan --calibrate` and `bench/` make, taken
from the calibrated profile where it was measured on this device; otherwise measured at start
on all ranks at once (ranks sharing a machine's cores share it as training does). On a GPU whose
data sheet shardwise knows, MFU is also given against the data sheet's figure, as torchtitan
reports it. An MFU above 100% is never reported: it means the peak is wrong, and the run says so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.data import default_collate
from torch.utils.flop_counter import FlopCounterMode

from shardwise.common.devices import calibrated_peak, datasheet, matmul_peak, profile_path
from shardwise.training.job_names import LossFn
from shardwise.training.parallel.compilation import eager
from shardwise.training.trainer.precision import autocast


def count_flops(model: nn.Module, loss_fn: LossFn, inputs: Any, target: Any) -> float:
    """Forward, loss and backward FLOPs of one batch through `model` (on the meta device: pass a
    meta model and meta tensors)."""
    with FlopCounterMode(display=False) as counter:
        loss_fn(model(inputs), target).backward()
    return float(counter.get_total_flops())


def meta_batch(sample: Any, size: int) -> tuple[Any, Any]:
    """`size` copies of one training item (inputs, target) on the meta device."""
    inputs, target = sample if isinstance(sample, tuple | list) else (sample, None)

    def batch(value: Any) -> Any:
        value = torch.as_tensor(value)
        return value.unsqueeze(0).expand(size, *value.shape).to("meta")

    return batch(inputs), None if target is None else batch(target)


def transformer_flops(*, params: int, layers: int, hidden: int, seq: int, tokens: int) -> float:
    """The usual closed form, to check the count against: 6 FLOPs per matrix parameter per token
    (forward 2, backward 4), and 12 per layer per token per hidden unit per earlier position for
    attention's two matrix products (computed whole, as kernels do, not halved for the mask)."""
    return tokens * (6 * params + 12 * layers * hidden * seq)


@dataclass(frozen=True)
class Peak:
    """This device's matrix-multiply rate (FLOP/s), and its data-sheet figure if known."""

    measured: float
    dtype: torch.dtype
    vendor: tuple[str, float] | None = None
    source: str = "measured"
    """Where the figure comes from: `measured` at start, or the calibrated profile's path."""
    unused: str = ""
    """Why a calibrated profile on this machine was not used, where one exists."""

    def mfu_text(self, achieved: float) -> str:
        """`achieved` FLOP/s per device as MFU against the measured peak (and the data sheet's
        where known)."""
        text = f"MFU {100 * achieved / self.measured:.1f}%"
        if self.vendor is not None:
            text += f" ({100 * achieved / self.vendor[1]:.1f}% of the data sheet's)"
        return text

    def describe(self) -> str:
        name = str(self.dtype).removeprefix("torch.")
        source = "measured" if self.source == "measured" else f"from {self.source}"
        if self.unused:
            source += f" ({self.unused})"
        text = f"peak {self.measured / 1e12:.3g} TFLOP/s {source} ({name} matrix multiply)"
        if self.vendor is not None:
            text += f"; data sheet {self.vendor[1] / 1e12:.0f} TFLOP/s ({self.vendor[0]})"
        return text


def measure_peak(device: torch.device, dtype: torch.dtype) -> Peak:
    """The calibrated profile's peak where it fits this device and precision; otherwise the
    peak measured now, on every rank of the default group at once, averaged over ranks."""
    vendor = datasheet(device)
    profiled, unused = calibrated_peak(device, dtype)
    if profiled is not None:
        return Peak(profiled, dtype, vendor, source=f"the calibrated profile {profile_path()}")
    if dist.is_initialized():
        dist.barrier()
    best = matmul_peak(device, dtype)
    if dist.is_initialized() and dist.get_world_size() > 1:
        mean = torch.tensor([best], dtype=torch.float64, device=device)
        dist.all_reduce(mean)
        best = float(mean) / dist.get_world_size()
    return Peak(measured=best, dtype=dtype, vendor=vendor, unused=unused)


@dataclass(frozen=True)
class Utilisation:
    """A run's FLOPs per step and its devices' peak: what MFU is computed from."""

    flops_per_step: float
    peak: Peak
    counted: str = "counted"
    """How the FLOPs were counted: on the meta device, or on one real micro-batch."""

    def window(self, steps: int, seconds: float, devices: int) -> dict[str, float]:
        """A reporting window's achieved TFLOP/s per device and MFU (%), against the peak and,
        where known, the data sheet (`mfu_datasheet`)."""
        achieved = self.flops_per_step * steps / seconds / devices
        found = {"tflops": achieved / 1e12, "mfu": 100 * achieved / self.peak.measured}
        if self.peak.vendor is not None:
            found["mfu_datasheet"] = 100 * achieved / self.peak.vendor[1]
        return found

    def describe(self) -> str:
        return f"{self.flops_per_step:.3g} FLOPs per step ({self.counted}); {self.peak.describe()}"


def for_run(
    build: Callable[[], nn.Module],
    loss_fn: LossFn,
    sample: Any,
    *,
    micro_batch: int,
    global_batch: int,
    peak: Callable[[], Peak],
    real: Callable[[], float | str] | None = None,
) -> Utilisation | str:
    """Count a step's FLOPs on the model `build` makes on the meta device; where its code cannot
    run there, with `real` (one real micro-batch: `count_real`) or, without, say why MFU will not
    be reported. `peak` measures the peak, only where there are FLOPs to set against it."""
    per_micro: float | str
    counted = "counted"

    def on_meta() -> float | str:
        try:
            with torch.device("meta"):
                model = build()
            # fake tensors over the meta model: transformers skips the checks that read values
            with FakeTensorMode(allow_non_fake_inputs=True) as fake:
                inputs, target = (
                    None if v is None else fake.from_tensor(v)
                    for v in meta_batch(sample, micro_batch)
                )
                return count_flops(model, loss_fn, inputs, target)
        except Exception as e:  # any model's code can fail on meta tensors: say why, go on
            return f"its FLOPs could not be counted on the meta device ({type(e).__name__}: {e})"

    per_micro = on_rank_0(on_meta)
    if isinstance(per_micro, str) and real is not None:
        found = real()
        per_micro = found if isinstance(found, float) else f"{per_micro}; {found}"
        counted = "counted on one real micro-batch"
    if isinstance(per_micro, str):
        return per_micro
    return Utilisation(per_micro * global_batch / micro_batch, peak(), counted=counted)


def on_rank_0(count: Callable[[], float | str]) -> float | str:
    """`count` run by the default group's rank 0 only and its result given to every rank: each
    rank builds the same model and batch on the meta device, so the others would only repeat it
    (on a shared machine's cores, at the cost of the run's start)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return count()
    box: list[float | str | None] = [count() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    found = box[0]
    assert found is not None
    return found


def count_real(
    model: nn.Module,
    loss_fn: LossFn,
    dataset: Any,
    *,
    micro_batch: int,
    device: torch.device,
    precision: str,
) -> float:
    """Forward, loss and backward FLOPs of one real micro-batch (the dataset's first items)
    through `model`, leaving training as it was: torch's random states (dropout) and every buffer
    (BatchNorm's statistics) restored, gradients dropped. Every rank of a sharded model runs it
    together (FSDP gathers its parameters)."""
    batch = default_collate([dataset[i] for i in range(micro_batch)])
    inputs, target = (_to(v, device) for v in batch)
    cuda = device.type == "cuda"
    states = (torch.get_rng_state(), torch.cuda.get_rng_state_all() if cuda else None)
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        with eager(), FlopCounterMode(display=False) as counter:
            with autocast(precision, device):
                loss = loss_fn(model(inputs), target)
            loss.backward()
    finally:
        torch.set_rng_state(states[0])
        if states[1] is not None:
            torch.cuda.set_rng_state_all(states[1])
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
        for p in model.parameters():
            p.grad = None
    return float(counter.get_total_flops())


def _to(value: Any, device: torch.device) -> Any:
    return value.to(device) if isinstance(value, torch.Tensor) else value
