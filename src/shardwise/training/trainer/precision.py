"""Mixed precision: autocast for bf16/fp16 forward passes, a gradient scaler for fp16, and which
precision `train.precision = "auto"` means on this device.

Parameters and optimizer state stay fp32 in every mode (master weights); only the forward and
backward compute run in the lower precision.

`auto` is bf16 on a CUDA device that supports it, and on a CPU only where bf16 matrix multiplies
run at least as fast as fp32's here: some CPUs have bf16 instructions (AVX512-BF16, AMX) and run
it faster, others emulate it 25 times slower. The rates come from a short probe (devices.py's
measurement at one small shape, every rank at once, averaged over ranks so that every rank
chooses the same). The same probe tells a job that asked for bf16 or fp16 on a CPU where it
runs below half of fp32's rate, in one line at start.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from shardwise.common.devices import matmul_peak

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
PROBE = (256,)
"""The probe's square size: enough to rank the precisions, quick on a slow path."""


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager[None]:
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[precision])


def grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler:
    """A scaler that is a pass-through unless the precision is fp16 (bf16 has fp32's range)."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")


@dataclass(frozen=True)
class Chosen:
    """The precision a run trains in, and what it said about it at start."""

    name: str
    """fp32, bf16 or fp16."""
    notes: list[str] = field(default_factory=list)


def choose(asked: str, device: torch.device) -> Chosen:
    """What `train.precision = asked` trains in on `device` (see the module docstring)."""
    if device.type == "cuda":
        if asked != "auto":
            return Chosen(asked)
        name = "bf16" if torch.cuda.is_bf16_supported() else "fp32"
        return Chosen(name, [f"train.precision = 'auto': {name} on {_gpu(device)}"])
    if asked == "fp32":
        return Chosen("fp32")
    return decide(asked, probe(device, ["fp32", "bf16" if asked == "auto" else asked]))


def decide(asked: str, rates: dict[str, float]) -> Chosen:
    """On a CPU: the precision `asked` means given the measured matrix-multiply `rates` (FLOP/s
    by precision, fp32's among them), and what to say about it."""
    fp32 = rates["fp32"]
    if asked == "auto":
        name = "bf16" if rates["bf16"] >= fp32 else "fp32"
        return Chosen(
            name,
            [
                f"train.precision = 'auto': {name} (matrix multiplies here: bf16 "
                f"{rates['bf16'] / 1e9:.3g} GFLOP/s, fp32 {fp32 / 1e9:.3g} GFLOP/s)"
            ],
        )
    if rates[asked] < 0.5 * fp32:
        return Chosen(
            asked,
            [
                f"train.precision = '{asked}' runs matrix multiplies at "
                f"{rates[asked] / 1e9:.3g} GFLOP/s on this CPU, below half of fp32's "
                f"{fp32 / 1e9:.3g}: set train.precision = 'auto' (or 'fp32')"
            ],
        )
    return Chosen(asked)


def probe(device: torch.device, names: list[str]) -> dict[str, float]:
    """Matrix-multiply FLOP/s in each precision at the probe's shape, averaged over the ranks of
    the default group (all measure at once)."""
    if dist.is_initialized():
        dist.barrier()
    rates = [matmul_peak(device, DTYPES.get(n, torch.float32), PROBE) for n in names]
    if dist.is_initialized() and dist.get_world_size() > 1:
        mean = torch.tensor(rates, dtype=torch.float64)
        dist.all_reduce(mean)
        rates = [r / dist.get_world_size() for r in mean.tolist()]
    return dict(zip(names, rates, strict=True))


def _gpu(device: torch.device) -> str:
    return torch.cuda.get_device_name(device)
