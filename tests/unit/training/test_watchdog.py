"""The watchdog's end of a rank after SIGTERM, when a rank it waits for is gone."""

from __future__ import annotations

import subprocess
import sys

from shardwise.training.fault.watchdog import HANG_EXIT

_RANK = """
import sys
from pathlib import Path
from shardwise.training.fault.watchdog import Watchdog
dog = Watchdog(Path(sys.argv[1]), rank=0, timeout_s=600)
dog.finished(4)
dog.started(5)
{hurried}
dog.peer_gone(RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:4242"))
dog.peer_gone(RuntimeError("a rank's own error"))
dog.close()
print("went on")
"""


def _run(tmp_path, hurried: str) -> subprocess.CompletedProcess[str]:
    script = _RANK.format(hurried=hurried)
    command = [sys.executable, "-c", script, str(tmp_path)]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def test_after_sigterm_a_collective_broken_by_a_peers_end_ends_the_rank_saying_so(tmp_path):
    """A rank waiting in a collective runs its SIGTERM handler only once the collective returns,
    broken by the peer that ran out of patience first: it ends with the same words."""
    done = _run(tmp_path, "dog.hurry(10.0)")
    assert done.returncode == HANG_EXIT, done.stderr
    assert "rank 0: SIGTERM, but the rank has waited 0 s inside step 5: a rank it waits for " in (
        done.stderr
    )
    assert "went on" not in done.stdout


def test_without_sigterm_a_broken_collective_is_left_to_the_launcher(tmp_path):
    """No SIGTERM, no patience: the error goes on up (the launcher names the first failure)."""
    done = _run(tmp_path, "")
    assert done.returncode == 0 and "went on" in done.stdout, done.stderr
    assert "SIGTERM" not in done.stderr
