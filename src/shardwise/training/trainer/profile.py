"""A short torch.profiler window at a chosen step (`tracking.profile_step`, for
`tracking.profile_steps` steps): where a step's time goes on each rank, for the run report, and
what a step asks of the device and of torch.

The split is of the training thread's wall time over the window's steps (`shardwise.step`
ranges): `data` is time in the loader (`shardwise.data`), `communication` time inside
collectives and their waits (`c10d::…` calls, gloo and NCCL ranges) wherever they sit (DDP's
all-reduce runs inside backward), `compute` the rest (forward, backward, optimizer). That is
exposed communication: what overlaps with compute costs nothing and is not counted. On a GPU the
device's own split is added: time in NCCL kernels and in all other kernels.

Per step it also counts (`steps` in the file, each marked `reporting` where the ranks meet
anyway: a log, checkpoint or evaluation step):
- `operators`: aten operators dispatched (those not called by another operator), on any thread;
- `syncs`: reads of a tensor's value by the host that dispatch an operator
  (`aten::_local_scalar_dense`, behind `.item()`, `bool()`, `float()`; not those a CPU kernel
  makes of its own inputs, as fused AdamW's of its step count), and on CUDA the
  runtime's synchronisations (stream, device and event synchronise, synchronous copies): each
  one a wait for the device;
- `kernels` (CUDA): kernels launched;
- `compiled_regions` and `operators_outside`: under `train.compile`, the compiled graphs entered
  (forward and backward) and the operators that ran outside them;
- `phases`: seconds in each of shardwise's own ranges (`shardwise.<part>`: the data, the model's
  forward and backward, the gradient norm, the non-finite check, the optimizer, the loop's
  accounting, health checks, logging), so what shardwise adds to a step shows part by part.

Ranges cost a dispatched call each, so they are entered only while the profiler records.

The steps right after the profiler's (as many again) count every read of a tensor's value by
the host, with where it happened (`host_reads` in the file: host_reads.py, which also sees
`.tolist()` and `.cpu()`, and on CUDA what torch's sync debug mode reports). Not under
`train.compile`, where entering its modes would make dynamo compile again.

Each rank writes `profile/rank<r>.json` in the run directory; `shardwise report` reads them.

A window the run ends inside of (fewer steps than its end, a preemption, a failure) is closed
when the loop ends, and in any case before the process exits: a process that exits while torch's
profiler records dies of SIGSEGV in its teardown, after its work is done. A window a process
starts inside of (a resume, a restart) is not profiled.

On CUDA, Kineto leaves NVIDIA's profiling library (CUPTI) attached after the window unless
`TEARDOWN_CUPTI=1`, and an attached CUPTI slows every later kernel launch by 10-20%
(pytorch/pytorch#144455): the window sets it, unless the user did.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import statistics
import sys
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType  # type: ignore[attr-defined]
from torch.profiler import ProfilerActivity, profile, record_function

from shardwise.common.host_reads import HostReads

COMMUNICATION = ("c10d::", "nccl", "gloo", "record_param_comms")
STEP, DATA = "shardwise.step", "shardwise.data"
PHASE = "shardwise."
HOST_READS = (
    "aten::_local_scalar_dense",
    "aten::item",
    "aten::is_nonzero",
    "aten::equal",
    "aten::nonzero",
    "aten::masked_select",
)
"""Operators that read a value on the host (counted where no other operator called them)."""
CUDA_SYNCS = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",  # the synchronous copy; cudaMemcpyAsync is not one
)
COMPILED = ("Torch-Compiled Region", "CompiledFunction")


def profiling() -> bool:
    """Whether torch's profiler records now (a cheap check of a flag)."""
    return bool(torch._C._autograd._profiler_enabled())


def phase(name: str) -> contextlib.AbstractContextManager[Any]:
    """The range one part of a step runs in (`shardwise.<name>`), entered only while profiling."""
    return record_function(PHASE + name) if profiling() else contextlib.nullcontext()


def data_range() -> contextlib.AbstractContextManager[Any]:
    """The range the loader's work is recorded in (free when nothing profiles)."""
    return phase("data")


class StepProfiler:
    """Profiles steps `first` … `first + count - 1` (none when `first` is 0), then counts the
    host's reads of tensor values over as many steps again (`host_reads`, not under
    `train.compile`: entering the counter's modes would make dynamo compile again), and writes
    what it found after each window."""

    def __init__(
        self, run_dir: Path, rank: int, *, first: int, count: int, count_reads: bool = True
    ) -> None:
        self.path = run_dir / "profile" / f"rank{rank}.json"
        self.first, self.last = first, first + count - 1
        self.reads_last = self.last + (count if count_reads else 0)
        self._profile: profile | None = None
        self._reporting: dict[int, bool] = {}
        self._summary: dict[str, Any] = {}

    def wants(self, step: int) -> bool:
        return self.first > 0 and self.first <= step <= self.reads_last

    @contextlib.contextmanager
    def step(self, step: int, *, reporting: bool = False) -> Iterator[None]:
        """Around one whole training step (`reporting`: one where the ranks meet anyway). A
        window this process starts inside of (a resume, a restart) is not profiled; one the run
        ends inside of is closed by `close`."""
        if not self.wants(step):
            yield
        elif step > self.last:
            with _reads_counted(self._summary, step, reporting):
                yield
            if step == self.reads_last:
                self._write()
        elif step == self.first or self._profile is not None:
            if step == self.first:
                self._start()
            self._reporting[step] = reporting
            with record_function(f"{STEP}#{step}"):
                yield
            if step == self.last:
                self._stop()
        else:
            yield

    def close(self) -> None:
        """The run ends (or fails): a profiler still recording stops, and what it saw is
        written."""
        if self._profile is not None:
            self._stop()

    def _start(self) -> None:
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
            os.environ.setdefault("TEARDOWN_CUPTI", "1")  # see the module docstring
        self._profile = profile(activities=activities)
        with _native_stderr_muted():
            self._profile.__enter__()
        # A process that exits while torch's profiler records dies of SIGSEGV in its teardown
        # (torch 2.13, CPU or CUDA): whatever ends this process, the window is closed first.
        atexit.register(self.close)

    def _stop(self) -> None:
        assert self._profile is not None, "stopped only while recording"
        atexit.unregister(self.close)
        with _native_stderr_muted():
            self._profile.__exit__(None, None, None)
        events = self._profile.events()
        self._profile = None
        self._summary = {
            "first_step": self.first,
            **time_split(events, steps=max(len(self._reporting), 1)),
            "steps": step_counts(events, self._reporting),
            "host_reads": [],
        }
        self._write()

    def _write(self) -> None:
        """Write what was found; a process that profiled nothing (it resumed inside the window)
        keeps what an earlier process of the run profiled and adds its host reads."""
        found = self._summary
        if "steps" not in found and self.path.exists():
            with contextlib.suppress(ValueError):  # a file cut short by a crash: replaced
                found = {**json.loads(self.path.read_text()), "host_reads": found["host_reads"]}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(found, indent=2))


@contextlib.contextmanager
def _reads_counted(summary: dict[str, Any], step: int, reporting: bool) -> Iterator[None]:
    """Count the host's reads in one step into `summary["host_reads"]`; on CUDA also the
    synchronisations torch's sync debug mode reports (those inside C++ code included)."""
    cuda = torch.cuda.is_available()
    previous = torch.cuda.get_sync_debug_mode() if cuda else 0
    with warnings.catch_warnings(record=True) as caught, HostReads() as reads:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode(previous)
    synced = [w for w in caught if "synchroniz" in str(w.message)]
    for w in caught:
        if w not in synced:  # anything else is the run's own business: pass it on
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    where = dict(reads.found)
    for w in synced:
        key = f"{Path(w.filename).name}:{w.lineno}: CUDA synchronisation"
        where[key] = where.get(key, 0) + 1
    summary.setdefault("host_reads", []).append(
        {"step": step, "reporting": reporting, "count": sum(where.values()), "where": where}
    )


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


def _is_step(name: str) -> bool:
    return name == STEP or name.startswith(STEP + "#")


def time_split(events: Any, *, steps: int) -> dict[str, float]:
    """Seconds per step in data loading, exposed communication and compute on the training
    thread (and, on a GPU, in NCCL and other kernels)."""
    main = {e.thread for e in events if _is_step(e.name)}
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
        if _is_step(event.name):
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


def step_counts(events: Any, reporting: dict[int, bool]) -> list[dict[str, Any]]:
    """Per profiled step: operators, host reads, kernels, compiled regions, operators outside
    them and seconds per part (see the module docstring). Events belong to the step during
    whose range on the training thread they started (backward runs on another thread on a GPU,
    while the training thread waits in it)."""
    spans = sorted(
        (e.time_range.start, e.time_range.end, int(e.name.partition("#")[2]))
        for e in events
        if e.name.startswith(STEP + "#")
    )
    steps: dict[int, dict[str, Any]] = {
        s: {"step": s, "reporting": reporting.get(s, False), **_zero()} for _, _, s in spans
    }
    for event in events:
        owner = _owner(spans, event.time_range.start)
        if owner is None:
            continue
        _count(steps[owner], event)
    return [steps[s] for _, _, s in spans]


def _zero() -> dict[str, Any]:
    return {
        "operators": 0,
        "syncs": 0,
        "kernels": 0,
        "compiled_regions": 0,
        "operators_outside": 0,
        "phases": {},
    }


def _owner(spans: list[tuple[int, int, int]], at: int) -> int | None:
    for start, end, step in spans:
        if start <= at <= end:
            return step
    return None


def _count(counts: dict[str, Any], event: Any) -> None:
    name: str = event.name
    if getattr(event, "device_type", None) == DeviceType.CUDA:
        if event.name and not event.name.startswith(("Memcpy", "Memset")):
            counts["kernels"] += 1
        return
    if name.startswith("aten::") and not _under(event, "aten::"):
        counts["operators"] += 1
        if not _under(event, *COMPILED):
            counts["operators_outside"] += 1
    if (name in HOST_READS and not _under(event, "aten::")) or name in CUDA_SYNCS:
        counts["syncs"] += 1  # an operator's own read inside a CPU kernel waits for nothing
    if name.startswith(COMPILED) and not _under(event, *COMPILED):
        counts["compiled_regions"] += 1
    if name.startswith(PHASE) and not _is_step(name):
        key = name.removeprefix(PHASE)
        counts["phases"][key] = counts["phases"].get(key, 0.0) + event.time_range.elapsed_us() / 1e6


def _under(event: Any, *prefixes: str) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(prefixes):
            return True
        parent = parent.cpu_parent
    return False


def summarise(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """The medians over the steps that are not reporting steps (all of them if none is): what a
    step between two log steps asks for."""
    plain = [s for s in steps if not s["reporting"]] or steps
    out: dict[str, Any] = {
        key: statistics.median(s[key] for s in plain)
        for key in ("operators", "syncs", "kernels", "compiled_regions", "operators_outside")
    }
    phases = Counter[str]()
    for s in plain:
        phases.update(s["phases"])
    out["phases"] = {k: v / len(plain) for k, v in phases.items()}
    return out


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
