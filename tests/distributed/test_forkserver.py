"""Ranks are forked from a server that has imported the trainer (launch/forkserver.py): one
server per launching process, started again when the environment changed, so that a rank sees the
variables of the process that launched it, as a spawned one does."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
from multiprocessing import forkserver

import pytest

from shardwise.common.environment import LAUNCHER_PID
from shardwise.training.launch.forkserver import restore_sigterm, start_method

pytestmark = pytest.mark.slow


def _seen(name: str, results) -> None:
    results.put(
        (os.environ.get(name), "shardwise.training.trainer.loop" in sys.modules, os.getcwd())
    )


def _started_child(name: str) -> tuple[str | None, bool, str]:
    ctx = mp.get_context(start_method())
    results = ctx.Queue()
    child = ctx.Process(target=_seen, args=(name, results))
    child.start()
    seen = results.get(timeout=120)
    child.join()
    return seen


def test_ranks_see_the_launchers_environment_and_start_with_the_trainer_imported(
    monkeypatch, tmp_path
):
    name = "SHARDWISE_TEST_FORKSERVER"
    here = os.getcwd()
    monkeypatch.setenv(name, "first")
    assert _started_child(name) == ("first", True, here)  # forked from a preloaded server
    server = forkserver._forkserver._forkserver_pid
    assert _started_child(name) == ("first", True, here)
    assert forkserver._forkserver._forkserver_pid == server  # reused while nothing changed
    monkeypatch.setenv(name, "second")
    assert _started_child(name) == ("second", True, here)
    assert forkserver._forkserver._forkserver_pid != server  # started again for the new value
    monkeypatch.chdir(tmp_path)
    assert _started_child(name) == ("second", True, str(tmp_path))


def _terminated(results) -> None:
    restore_sigterm()
    results.put(signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)


def test_the_server_outlives_a_sigterm_to_the_whole_job_and_ranks_restore_it(monkeypatch):
    """Slurm and systemd send SIGTERM to every process of a job: the server ignores it (the
    launcher learns through it how ranks that are still saving end), a rank does not."""
    monkeypatch.setenv(LAUNCHER_PID, str(os.getpid()))
    ctx = mp.get_context(start_method())
    results = ctx.Queue()
    for signalled in (False, True):  # the first rank: the server has done its imports
        if signalled:
            os.kill(forkserver._forkserver._forkserver_pid, signal.SIGTERM)
        child = ctx.Process(target=_terminated, args=(results,))
        child.start()
        assert results.get(timeout=120) is True
        child.join()
        assert child.exitcode == 0
