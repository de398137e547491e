"""Mixed precision: autocast for bf16/fp16 forward passes, a gradient scaler for fp16.

Parameters and optimizer state stay fp32 in every mode (master weights); only the forward and
backward compute run in the lower precision.
"""

from __future__ import annotations

import contextlib

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager[None]:
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[precision])


def grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler:
    """A scaler that is a pass-through unless the precision is fp16 (bf16 has fp32's range)."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")
