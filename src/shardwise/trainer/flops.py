"""Utilisation, honestly: the FLOPs a step does, and the rate this device can do them at.

FLOPs are counted, not estimated from a formula: the model is built on the meta device (no
memory, no time) and one micro-batch's forward, loss and backward run under torch's
`FlopCounterMode`, which counts every matrix multiply, convolution and attention call by its
shape; whatever the model is. A step is that count × the micro-batches of the global batch.
Recomputation (activation checkpointing) is not counted: MFU is model FLOPs over time, as in
PaLM (Chowdhery et al., 2022), so recomputing costs utilisation rather than hiding in it.

The peak is measured at start: the best rate of a large matrix multiply in the run's precision
on this device, all ranks at once (so ranks sharing a machine's cores share it as training
does). For a GPU whose data-sheet figure shardwise knows, that figure is shown beside it; MFU is
always against the measured peak, never against a table.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from shardwise.builders import LossFn

SIZES = {"cuda": (4096, 8192), "cpu": (512,)}
"""Square matrix sizes the peak is measured over, per device type (the best is kept): on a CPU
one size, as every run pays for the measurement (about 0.15 s); 512 reaches within a few percent
of the best square size here (`shardwise plan --calibrate` measures 256-1024)."""
SECONDS = {"cuda": 0.3, "cpu": 0.15}


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
    """This device's measured matrix-multiply rate (FLOP/s), and its data-sheet figure if known."""

    measured: float
    dtype: torch.dtype
    vendor: tuple[str, float] | None = None

    def mfu_text(self, achieved: float) -> str:
        """`achieved` FLOP/s per device as MFU against the measured peak (and the data sheet's
        where known)."""
        text = f"MFU {100 * achieved / self.measured:.1f}%"
        if self.vendor is not None:
            text += f" ({100 * achieved / self.vendor[1]:.1f}% of the data sheet's)"
        return text

    def describe(self) -> str:
        name = str(self.dtype).removeprefix("torch.")
        text = f"peak {self.measured / 1e12:.3g} TFLOP/s measured ({name} matrix multiply)"
        if self.vendor is not None:
            text += f"; data sheet {self.vendor[1] / 1e12:.0f} TFLOP/s ({self.vendor[0]})"
        return text


def measure_peak(device: torch.device, dtype: torch.dtype) -> Peak:
    """The best matrix-multiply rate over a few square sizes (each timed for a fraction of a
    second), on every rank of the default group at once, averaged over ranks."""
    if dist.is_initialized():
        dist.barrier()
    sizes, seconds = SIZES.get(device.type, SIZES["cuda"]), SECONDS.get(device.type, 0.3)
    best = max(_rate(n, device, dtype, seconds) for n in sizes)
    if dist.is_initialized() and dist.get_world_size() > 1:
        mean = torch.tensor([best], dtype=torch.float64, device=device)
        dist.all_reduce(mean)
        best = float(mean) / dist.get_world_size()
    return Peak(measured=best, dtype=dtype, vendor=vendor_peak(device))


def _rate(n: int, device: torch.device, dtype: torch.dtype, seconds: float) -> float:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    torch.mm(a, b)
    _sync(device)
    runs, began = 0, time.perf_counter()
    while True:
        torch.mm(a, b)
        runs += 1
        if runs % 4 == 0:
            _sync(device)
            took = time.perf_counter() - began
            if took >= seconds:
                return 2 * n**3 * runs / took


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def vendor_peak(device: torch.device) -> tuple[str, float] | None:
    """The data-sheet dense 16-bit FLOP/s of a GPU shardwise knows (plan/hardware.py's presets)."""
    if device.type != "cuda":
        return None
    from shardwise.plan.hardware import PRESETS

    name = torch.cuda.get_device_name(device).lower()
    for key in ("h200", "h100", "a100", "l40s"):
        if key in name:
            preset = "a100-80gb" if key == "a100" else key
            return torch.cuda.get_device_name(device), PRESETS[preset].peak_flops
    return None


@dataclass(frozen=True)
class Utilisation:
    """A run's FLOPs per step and its devices' peak: what MFU is computed from."""

    flops_per_step: float
    peak: Peak

    def window(self, steps: int, seconds: float, devices: int) -> dict[str, float]:
        """A reporting window's achieved TFLOP/s per device and MFU (%)."""
        achieved = self.flops_per_step * steps / seconds / devices
        return {"tflops": achieved / 1e12, "mfu": 100 * achieved / self.peak.measured}

    def describe(self) -> str:
        return f"{self.flops_per_step:.3g} FLOPs per step (counted); {self.peak.describe()}"


def for_run(
    build: Callable[[], nn.Module],
    loss_fn: LossFn,
    sample: Any,
    *,
    micro_batch: int,
    global_batch: int,
    device: torch.device,
    dtype: torch.dtype,
) -> Utilisation | str:
    """Count a step's FLOPs (the model `build` makes, on the meta device) and measure the peak;
    or, where the model cannot run on the meta device, why MFU will not be reported."""
    try:
        with torch.device("meta"):
            model = build()
        inputs, target = meta_batch(sample, micro_batch)
        flops = count_flops(model, loss_fn, inputs, target) * global_batch / micro_batch
    except Exception as e:  # any model's code can fail on meta tensors: say why, go on
        return f"its FLOPs could not be counted on the meta device ({type(e).__name__}: {e})"
    return Utilisation(flops_per_step=flops, peak=measure_peak(device, dtype))
