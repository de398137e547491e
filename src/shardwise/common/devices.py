"""What a device can do: the data-sheet figures shardwise knows, and the matrix-multiply peak
measured one way for every user of it (a run's MFU, `bench/`, `shardwise plan --calibrate`).

The peak is the best rate of a matrix multiply in the precision the model's own run in (bf16 on
a GPU under `train.precision = "bf16"`, fp32 otherwise), through the operators the model's
layers call (`torch.mm` and `F.linear`, whichever this device runs faster: a CPU's oneDNN may
take one path and not the other), at square shapes large enough to reach the device's peak
(4096 and 8192 on a GPU; 512 on a CPU core, within a few percent of its best square), each
timed as the best of a few short bursts after a warm-up (a burst long enough to heat the chip
measures its throttled clock, not its peak). On a GPU the data sheet's dense 16-bit figure is
known for the devices below; MFU against it is what torchtitan reports.

This module must not import anything of shardwise's.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from shardwise.common.environment import cache_dir

if TYPE_CHECKING:  # torch is imported where it is used: the CLI's parser reads this module
    import torch

DATASHEET_TFLOPS = {"h200": 989.0, "h100": 989.0, "a100": 312.0, "l40s": 362.0}
"""Dense bf16/fp16 tensor-core TFLOP/s from NVIDIA's data sheets (H100 SXM and H200: 989;
A100: 312; L40S: 362), by the name torch reports, lowercased."""

SIZES = {"cuda": (4096, 8192), "cpu": (512,)}
"""Square matrix sizes the peak is measured at, per device type (the best is kept)."""

BURST = {"cuda": 3, "cpu": 1}
"""Calls per timed burst, per device type: a GPU's are timed in threes (one 4096² multiply is
a fraction of a millisecond, near the cost of the synchronisation around it); a CPU core's
512² multiply takes milliseconds, against a timer's microsecond, so each call is timed alone:
bursts of three tripled the measurement's cost at every rank's start, and measured a lower and
less steady peak (in 8 tries: 63-80 GFLOP/s in bursts, 78-81 singly; tests/DURATIONS.md)."""


def datasheet(device: torch.device) -> tuple[str, float] | None:
    """The GPU's name and its data sheet's dense 16-bit FLOP/s, where shardwise knows it."""
    if device.type != "cuda":
        return None
    import torch

    name = torch.cuda.get_device_name(device)
    for key, tflops in DATASHEET_TFLOPS.items():
        if key in name.lower():
            return name, tflops * 1e12
    return None


def device_name(device: torch.device) -> str:
    """What a calibrated profile records as its device: the GPU's name, or "cpu"."""
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def matmul_peak(device: torch.device, dtype: torch.dtype, sizes: tuple[int, ...] = ()) -> float:
    """The best FLOP/s of `torch.mm` and `F.linear` on `dtype` operands over `sizes` (SIZES for
    the device by default), each the best of five bursts (BURST calls each) after a warm-up;
    one call after the warm-up where a call takes over 50 ms (a slow path: its peak is not in
    doubt, and a run should not wait seconds for it)."""
    import torch
    import torch.nn.functional as F  # noqa: N812 (the conventional name)

    best = 0.0
    inner = BURST.get(device.type, BURST["cuda"])
    for n in sizes or SIZES.get(device.type, SIZES["cuda"]):
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        for op in (torch.mm, F.linear):
            once = best_seconds(lambda: op(a, b), repeats=1, inner=1, device=device)  # noqa: B023
            if once < 0.05:
                burst = best_seconds(lambda: op(a, b), inner=inner, device=device)  # noqa: B023
                once = min(once, burst)
            best = max(best, 2 * n**3 / once)
    return best


def profile_path() -> Path:
    """Where `shardwise plan --calibrate` keeps this machine's profile."""
    return cache_dir() / "this-machine.json"


def profile_dtype(device: str) -> torch.dtype:
    """The precision a calibrated profile's peak was measured in: bf16 on a GPU, fp32 on a CPU
    core."""
    import torch

    return torch.float32 if device == "cpu" else torch.bfloat16


def calibrated_peak(device: torch.device, dtype: torch.dtype) -> tuple[float | None, str]:
    """The calibrated profile's peak, where it was measured on this device in `dtype` (on a CPU:
    per core, so only for a rank of one thread); otherwise None and why not ("" where there is
    no profile), for the run to say why it measures the peak instead."""
    import torch

    path = profile_path()
    try:
        profile = json.loads(path.read_text())
    except FileNotFoundError:
        return None, ""
    except (OSError, ValueError) as e:
        return None, f"the calibrated profile {path} cannot be read ({type(e).__name__})"
    unused = f"the calibrated profile {path} is not used"
    peak = profile.get("peak_flops") if isinstance(profile, dict) else None
    if not isinstance(peak, int | float) or peak <= 0 or profile.get("calibrated") is not True:
        return None, f"{unused}: it holds no calibrated peak"
    name = device_name(device)
    why = ""
    if profile.get("device") != name:
        why = f"it was measured on {profile.get('device')}, not {name}"
    elif profile_dtype(name) != dtype:
        why = f"its peak is in {profile_dtype(name)}, this run multiplies in {dtype}"
    elif device.type == "cpu" and torch.get_num_threads() != 1:
        why = f"its peak is per core, and this rank runs {torch.get_num_threads()} threads"
    return (None, f"{unused}: {why}") if why else (float(peak), "")


def best_seconds(
    fn: Callable[[], object], repeats: int = 5, inner: int = 3, device: torch.device | None = None
) -> float:
    """The fastest of `repeats` runs of `inner` calls, per call, after one to warm up; on a CUDA
    `device`, from the queue empty to the last kernel done."""
    import torch

    cuda = device is not None and device.type == "cuda"
    fn()
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize(device)
        began = time.perf_counter()
        for _ in range(inner):
            fn()
        if cuda:
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - began) / inner)
    return min(times)
