"""Ranks are forked from a server that has imported the trainer (launch/forkserver.py): one
server per launching process, started again when the environment changed, so that a rank sees the
variables of the process that launched it, as a spawned one does."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from multiprocessing import forkserver

import pytest

from shardwise.training.launch.forkserver import start_method

pytestmark = pytest.mark.slow


def _seen(name: str, results) -> None:
    results.put((os.environ.get(name), "shardwise.training.trainer.loop" in sys.modules))


def _started_child(name: str) -> tuple[str | None, bool]:
    ctx = mp.get_context(start_method())
    results = ctx.Queue()
    child = ctx.Process(target=_seen, args=(name, results))
    child.start()
    seen = results.get(timeout=120)
    child.join()
    return seen


def test_ranks_see_the_launchers_environment_and_start_with_the_trainer_imported(monkeypatch):
    name = "SHARDWISE_TEST_FORKSERVER"
    monkeypatch.setenv(name, "first")
    assert _started_child(name) == ("first", True)  # forked from a preloaded server
    server = forkserver._forkserver._forkserver_pid
    assert _started_child(name) == ("first", True)
    assert forkserver._forkserver._forkserver_pid == server  # reused while nothing changed
    monkeypatch.setenv(name, "second")
    assert _started_child(name) == ("second", True)
    assert forkserver._forkserver._forkserver_pid != server  # started again for the new value
