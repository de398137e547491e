"""The time and peak memory of a call in this process, for the bench scripts that measure
memory: the peak resident set (sampled every 10 ms on a thread) above what the process held
before the call; and each measurement run in a fresh process."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def resident_mib() -> int:
    """This process's resident set now, in MiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) // 1024


def measured(call: Callable[[], T]) -> tuple[T, float, int]:
    """`call()`'s result, its seconds, and the MiB its peak held above the resident set
    before it."""
    peak = [0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], resident_mib())
            stop.wait(0.01)

    before = resident_mib()
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    began = time.perf_counter()
    try:
        got = call()
    finally:
        seconds = time.perf_counter() - began
        stop.set()
        watcher.join()
    return got, seconds, max(peak[0], resident_mib()) - before


def in_fresh_process(command: list[str]) -> dict[str, Any] | None:
    """The last line of `command`'s output (a measurement in a fresh process), read as JSON;
    None where the kernel's out-of-memory killer ended it. Any other failure ends the bench
    with the command's error."""
    child = subprocess.run(command, capture_output=True, text=True, check=False)
    if child.returncode == -signal.SIGKILL:
        return None
    if child.returncode:
        raise SystemExit(child.stderr)
    got: dict[str, Any] = json.loads(child.stdout.strip().splitlines()[-1])
    return got
