"""A short torch.profiler window at a chosen step (`tracking.profile_step`, for
`tracking.profile_steps` steps): where a step's time goes on each rank, for the run report.

The split is of the training thread's wall time over the window's steps (`shardwise.step`
ranges): `data` is time in the loader (`shardwise.data`), `communication` time inside
collectives and their waits (`c10d::…` calls, gloo and NCCL ranges) wherever they sit (DDP's
all-reduce runs inside backward), `compute` the rest (forward, backward, optimizer). That is
exposed communication: what overlaps with compute costs nothing and is not counted. On a GPU the
device's own split is added: time in NCCL kernels and in all other kernels.

Each rank writes `profile/rank<r>.json` in the run directory; `shardwise report` reads them.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType  # type: ignore[attr-defined]
from torch.profiler import ProfilerActivity, profile, record_function

COMMUNICATION = ("c10d::", "nccl", "gloo", "record_param_comms")
STEP, DATA = "shardwise.step", "shardwise.data"


class StepProfiler:
    """Profiles steps `first` … `first + count - 1` (none when `first` is 0) and writes the
    split when the last of them ends."""

    def __init__(self, run_dir: Path, rank: int, *, first: int, count: int) -> None:
        self.path = run_dir / "profile" / f"rank{rank}.json"
        self.first, self.last = first, first + count - 1
        self._profile: profile | None = None

    def wants(self, step: int) -> bool:
        return self.first > 0 and self.first <= step <= self.last

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Around one whole training step."""
        if step == self.first and self.first > 0:
            activities = [ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(ProfilerActivity.CUDA)
            self._profile = profile(activities=activities)
            with _native_stderr_muted():
                self._profile.__enter__()
        with record_function(STEP):
            yield
        if step == self.last and self._profile is not None:
            with _native_stderr_muted():
                self._profile.__exit__(None, None, None)
            split = time_split(self._profile.events(), steps=self.last - self.first + 1)
            self._profile = None
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps({"first_step": self.first, **split}, indent=2))


@contextlib.contextmanager
def _native_stderr_muted() -> Iterator[None]:
    """Kineto (torch's profiler library) writes a `USDT: … profiler_start` line to the process's
    stderr at every start and stop, whatever its log level; this silences file descriptor 2 for
    that moment only, so every run's output does not carry them."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def time_split(events: Any, *, steps: int) -> dict[str, float]:
    """Seconds per step in data loading, exposed communication and compute on the training
    thread (and, on a GPU, in NCCL and other kernels)."""
    main = {e.thread for e in events if e.name == STEP}
    total = data = comm = 0.0
    gpu_comm = gpu_compute = 0.0
    for event in events:
        seconds = event.time_range.elapsed_us() / 1e6
        if getattr(event, "device_type", None) == DeviceType.CUDA:
            if "nccl" in event.name.lower():
                gpu_comm += seconds
            else:
                gpu_compute += seconds
            continue
        if event.thread not in main:
            continue
        if event.name == STEP:
            total += seconds
        elif event.name == DATA:
            data += seconds
        elif _communication(event.name) and not _inside_communication(event):
            comm += seconds
    split = {
        "step_s": total / steps,
        "data_s": data / steps,
        "communication_s": comm / steps,
        "compute_s": max(total - data - comm, 0.0) / steps,
    }
    if gpu_comm or gpu_compute:
        split |= {"gpu_nccl_s": gpu_comm / steps, "gpu_kernels_s": gpu_compute / steps}
    return split


def _communication(name: str) -> bool:
    lowered = name.lower()
    return any(word in lowered for word in COMMUNICATION)


def _inside_communication(event: Any) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if _communication(parent.name):
            return True
        parent = parent.cpu_parent
    return False


def data_range() -> contextlib.AbstractContextManager[Any]:
    """The range the loader's work is recorded in (free when nothing profiles)."""
    return record_function(DATA)
