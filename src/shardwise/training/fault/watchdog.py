"""Hangs named, not silent: a watchdog thread on every rank notices when the rank has made no
progress for `fault.timeout_s`, writes where each of its threads is (Python stacks) and which
step it last started and finished to `<run_dir>/hangs/rank<r>.txt`, and ends the rank; the
launcher then turns the ranks' reports into one message (`describe`) naming which ranks are stuck
where and which never started the step the others wait in.

The training loop calls `started(step)` and `finished(step)`; long phases that are not steps
(evaluation, checkpoint saves, the run's end) call `beat()`.

After SIGTERM the ranks must meet at their next check to stop together (health.py). A rank that
cannot, because a rank it waits for is gone, would sit in its collective until the launcher's
SIGKILL: torch's agent sends SIGTERM to the survivors when a rank dies (to restart them, or at the
end) and waits 30 s. So once told to `hurry`, the watchdog ends a rank that waits longer than
that patience in a step or between steps (not in a save, an evaluation or the run's end),
saying so.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
import time
from pathlib import Path

HANG_EXIT = 75
"""The exit code of a rank the watchdog ended."""
_MARGIN_S = 3.0
"""How long a rank that detected a hang waits for the other ranks to write their reports."""

AFTER_A_PEER = (
    "closed by peer",
    "reset by peer",
    "remote worker crashing",
    "remote process exited",
    "broken pipe",
    "failed to recv, got 0 bytes",
    "communicator was aborted",
)
"""What a rank reports when another rank died under it (gloo, NCCL, the TCPStore): a
consequence, not the cause, whenever a rank also failed for a reason of its own."""


def after_a_peer(message: str) -> bool:
    """Whether an error's message says another rank died under this one (AFTER_A_PEER)."""
    return any(p in message.lower() for p in AFTER_A_PEER)


class Watchdog:
    def __init__(self, directory: Path, *, rank: int, timeout_s: float) -> None:
        self.directory, self.rank, self.timeout_s = directory, rank, timeout_s
        self.last_started = self.last_finished = 0
        self._beat = time.monotonic()
        self._training = True
        self._patience_s: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="shardwise-watchdog", daemon=True)
        self._thread.start()

    def started(self, step: int) -> None:
        self.last_started, self._beat = step, time.monotonic()
        self._training = True

    def finished(self, step: int) -> None:
        self.last_finished, self._beat = step, time.monotonic()
        self._training = True

    def beat(self) -> None:
        """A phase that is not training starts: a save, an evaluation (until the step is
        finished), the run's end."""
        self._beat = time.monotonic()
        self._training = False

    def hurry(self, patience_s: float) -> None:
        """SIGTERM came: from now on a rank idle for `patience_s` outside a save, an evaluation
        or the run's end ends."""
        self._patience_s = patience_s

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        period = min(1.0, self.timeout_s / 4)
        while not self._stop.wait(period):
            idle = time.monotonic() - self._beat
            if idle > self.timeout_s:
                self._report(idle)
                time.sleep(_MARGIN_S)
                os._exit(HANG_EXIT)
            patience = self._patience_s
            if patience is not None and idle > patience and self._training:
                self._end(idle)

    def peer_gone(self, error: BaseException) -> None:
        """After SIGTERM, a step that failed because a rank it waited for is gone (gloo or NCCL
        say so) ends the rank as running out of patience would have, saying the same. A rank
        waiting in a collective cannot run Python's signal handler until the collective returns,
        so its patience may start only when the peer's end breaks the collective."""
        if self._patience_s is None or not self._training:
            return
        if after_a_peer(str(error)):
            self._end(time.monotonic() - self._beat)

    def _end(self, idle: float) -> None:
        where = (
            f"inside step {self.last_started}"
            if self.last_started > self.last_finished
            else f"after step {self.last_finished}"
        )
        print(
            f"rank {self.rank}: SIGTERM, but the rank has waited {idle:.0f} s {where}: a rank it "
            "waits for is gone; ending without a checkpoint (the newest saved one stays)",
            file=sys.stderr,
            flush=True,
        )
        os._exit(HANG_EXIT)

    def _report(self, idle: float) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"rank{self.rank}.txt"
        status = {
            "rank": self.rank,
            "last_started": self.last_started,
            "last_finished": self.last_finished,
            "idle_s": round(idle, 1),
            "time": time.time(),
        }
        with open(path, "w") as f:
            f.write(json.dumps(status) + "\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)


def describe(directory: Path, *, since: float) -> str | None:
    """One message from the ranks' hang reports written after `since`, or None if there are
    none: which ranks wait inside a step, which never started it, and where each one is."""
    reports = []
    for path in sorted(directory.glob("rank*.txt")):
        if path.stat().st_mtime < since:
            continue
        head, _, stacks = path.read_text().partition("\n")
        status = json.loads(head)
        status["where"] = _main_frame(stacks)
        reports.append(status)
    if not reports:
        return None
    newest = max(r["last_started"] for r in reports)
    waiting = [r for r in reports if r["last_started"] == newest and r["last_finished"] < newest]
    behind = [r for r in reports if r not in waiting]
    parts = [f"no progress for {max(r['idle_s'] for r in reports):.0f} s (fault.timeout_s)"]
    if waiting and behind:
        parts.append(
            f"{'ranks' if len(waiting) > 1 else 'rank'} {_ranks(waiting)} "
            f"{'wait' if len(waiting) > 1 else 'waits'} inside step {newest}, "
            f"which rank{'s' if len(behind) > 1 else ''} {_ranks(behind)} never started"
        )
    for r in reports:
        parts.append(f"rank {r['rank']} after step {r['last_finished']} is at {r['where']}")
    return "; ".join(parts) + f" (stacks in {directory})"


def _ranks(reports: list[dict[str, object]]) -> str:
    return ", ".join(str(r["rank"]) for r in reports)


def _main_frame(stacks: str) -> str:
    """The innermost frame of the main thread in a faulthandler dump."""
    lines = stacks.splitlines()
    # faulthandler lists each thread as a header line followed by its frames, innermost first;
    # the main thread is the one whose outermost frame is not a threading bootstrap.
    threads: list[list[str]] = []
    for line in lines:
        if line.startswith(("Thread ", "Current thread ")):
            threads.append([])
        elif line.strip().startswith("File ") and threads:
            threads[-1].append(line.strip())
    for frames in threads:
        if frames and "threading.py" not in frames[-1]:
            return frames[0].removeprefix("File ")
    return "an unknown place"
