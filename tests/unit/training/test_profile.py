"""The profile window never takes a process down (issue 35): a process that exits while torch's
profiler records dies of SIGSEGV in the profiler's teardown, after its work is done (a run whose
last step fell inside the window: `--set train.steps=10` with the default window at 10-11). The
window is closed when the loop ends and, whatever ends the process, before it exits."""

from __future__ import annotations

import subprocess
import sys
import textwrap

EXIT_INSIDE = textwrap.dedent(
    """
    import torch
    from pathlib import Path
    from torch.profiler import profile, ProfilerActivity
    if {bare}:
        profile(activities=[ProfilerActivity.CPU]).__enter__()  # torch's, left recording
    else:
        from shardwise.training.trainer.profile import StepProfiler
        StepProfiler(Path({run_dir!r}), 0, first=1, count=3).step(1).__enter__()
    torch.randn(50, 50) @ torch.randn(50, 50)
    """
)


def _exits(tmp_path, *, bare: bool) -> int:
    code = EXIT_INSIDE.format(bare=bare, run_dir=str(tmp_path))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120).returncode


def test_a_process_that_exits_while_torchs_profiler_records_crashes(tmp_path):
    """Why the window must be closed: torch's own profiler, left recording at exit."""
    assert _exits(tmp_path, bare=True) == -11  # SIGSEGV


def test_a_process_that_exits_inside_the_window_exits_cleanly_with_the_window_written(tmp_path):
    assert _exits(tmp_path, bare=False) == 0
    assert (tmp_path / "profile" / "rank0.json").exists()
