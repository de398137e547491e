"""Ranks are forked from a server that has imported the trainer (launch/forkserver/): one
server per launching process, started again when the environment changed in a way its imports
could have read, and a rank sees the variables of the process that launched it as they are at
the launch, as a spawned one does."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import signal
import subprocess
import sys
from multiprocessing import forkserver

import pytest

from shardwise.common.environment import LAUNCHER_PID
from shardwise.training.launch.forkserver import (
    _in_environment,
    fork_target,
    restore_sigterm,
    start_method,
)

pytestmark = pytest.mark.slow


def _seen(name: str, results) -> None:
    results.put(
        (
            os.environ.get(name),
            "shardwise.training.trainer.loop" in sys.modules,
            os.getcwd(),
            gc.get_freeze_count() > 100_000,  # the server's imports, out of the collector's way
        )
    )


def _started_child(name: str) -> tuple[str | None, bool, str, bool]:
    ctx = mp.get_context(start_method())
    results = ctx.Queue()
    target, args = fork_target(_seen, (name, results))
    child = ctx.Process(target=target, args=args)
    child.start()
    seen = results.get(timeout=120)
    child.join()
    return seen


def test_ranks_see_the_launchers_environment_and_start_with_the_trainer_imported(
    monkeypatch, tmp_path
):
    name = "TEST_FORKSERVER_VARIABLE"  # any variable: what the server imported may read it
    here = os.getcwd()
    monkeypatch.setenv(name, "first")
    # forked from a preloaded server whose imports the garbage collector never walks
    assert _started_child(name) == ("first", True, here, True)
    server = forkserver._forkserver._forkserver_pid
    assert _started_child(name) == ("first", True, here, True)
    assert forkserver._forkserver._forkserver_pid == server  # reused while nothing changed
    monkeypatch.setenv(name, "second")
    assert _started_child(name) == ("second", True, here, True)
    assert forkserver._forkserver._forkserver_pid != server  # started again for the new value
    monkeypatch.chdir(tmp_path)
    assert _started_child(name) == ("second", True, str(tmp_path), True)


def test_variables_read_only_as_ranks_run_reach_them_from_the_same_server(monkeypatch):
    """shardwise's own (SHARDWISE_FAULT …), torch elastic's and pytest's marker of the running
    test, which changes with every test: set, changed and unset, each rank sees them as the
    launcher has them, and the server that imported torch stays."""
    name = "SHARDWISE_TEST_FORKSERVER"
    monkeypatch.setenv(name, "first")
    assert _started_child(name)[0] == "first"
    server = forkserver._forkserver._forkserver_pid
    monkeypatch.setenv(name, "second")
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "another test")
    monkeypatch.setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM")  # as elastic's first launch
    assert _started_child(name)[0] == "second"
    assert _started_child("PYTEST_CURRENT_TEST")[0] == "another test"
    monkeypatch.delenv(name)
    assert _started_child(name)[0] is None
    assert forkserver._forkserver._forkserver_pid == server


def test_a_variable_set_for_the_rank_itself_is_kept(monkeypatch):
    """torch elastic sets each rank's RANK, MASTER_PORT … in the forked process before the
    entry runs: the launcher's changes since the server started do not undo them (here a
    launcher that itself runs under torchrun, whose MASTER_PORT changed)."""
    monkeypatch.setenv("MASTER_PORT", "40000")  # as elastic set it in the rank
    monkeypatch.setenv("SHARDWISE_TEST_CHANGED", "server")
    changes = {"MASTER_PORT": ("29500", "29501"), "SHARDWISE_TEST_CHANGED": ("server", "now")}
    seen = _in_environment(
        changes, lambda: (os.environ["MASTER_PORT"], os.environ["SHARDWISE_TEST_CHANGED"])
    )
    assert seen == ("40000", "now")


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
        target, args = fork_target(_terminated, (results,))
        child = ctx.Process(target=target, args=args)
        child.start()
        assert results.get(timeout=120) is True
        child.join()
        assert child.exitcode == 0


FORKED_BY_A_COMMAND = """
import gc, multiprocessing as mp, os, signal, sys, threading
from multiprocessing import forkserver
import torch
from shardwise.cli import owned_process
from shardwise.training.launch.forkserver import fork_target, restore_sigterm, start_method

def seen(results):
    restore_sigterm()
    main = sys.modules["__main__"]
    results.put((
        os.environ.get("TEST_FORKSERVER_VARIABLE"), os.getcwd(),
        "shardwise.training.trainer.loop" in sys.modules, sys.argv, hasattr(main, "__file__"),
        signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
        signal.getsignal(signal.SIGINT) is signal.default_int_handler,
        sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
        gc.get_freeze_count(),
    ))

def rank(ctx):
    results = ctx.Queue()
    target, args = fork_target(seen, (results,))
    child = ctx.Process(target=target, args=args)
    child.start()
    got = results.get(timeout=120)
    child.join()
    assert child.exitcode == 0
    return got

if __name__ == "__main__":
    if sys.argv[1] == "command":
        owned_process()  # what the console script and `python -m shardwise` do
    else:
        threading.Thread(target=threading.Event().wait, daemon=True).start()
    os.environ["SHARDWISE_LAUNCHER_PID"] = str(os.getpid())
    os.environ["TEST_FORKSERVER_VARIABLE"] = "set"
    ctx = mp.get_context(start_method())
    seen_by_rank = rank(ctx)  # first: a server started by exec has exec'd once it has forked
    server = forkserver._forkserver._forkserver_pid
    command = open(f"/proc/{server}/cmdline").read().split("\\0")
    print(repr((any("forkserver import main" in part for part in command), seen_by_rank)))
"""


@pytest.mark.parametrize("caller", ["command", "threaded"])
def test_a_shardwise_command_forks_its_server_from_itself_and_its_ranks_start_as_before(
    tmp_path, caller
):
    """Under a `shardwise` command (one Python thread, a CPU build of torch) the server is a fork
    of the launcher, which has imported torch already, not a new interpreter; a caller with
    threads of its own gets a new interpreter. Either way a rank sees the same: the launcher's
    environment, directory, arguments and `__main__` (multiprocessing's own preparation of a
    rank), the trainer imported and frozen (gc.freeze), SIGTERM's and SIGINT's defaults, and no
    descriptor of the launcher's."""
    script = tmp_path / "launcher.py"
    script.write_text(FORKED_BY_A_COMMAND)
    done = subprocess.run(
        [sys.executable, str(script), caller], capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr
    execd, (variable, directory, preloaded, argv, main_file, term, interrupt, fds, frozen) = eval(
        done.stdout.strip().splitlines()[-1]
    )
    assert execd is (caller == "threaded")
    assert (variable, directory, preloaded) == ("set", os.getcwd(), True)
    assert argv == [str(script), caller] and main_file and term and interrupt  # as spawned
    # standard streams, the pipes multiprocessing gave the rank, the queue's, the tracker's
    assert len(fds) < 12, fds
    assert frozen > 100_000  # the server's imports: a rank's collections never walk them


DISCARDED = """
import os, sys
from multiprocessing import forkserver
import torch
from shardwise.cli import owned_process
from shardwise.training.launch.forkserver import discard_unused_server, fork_target, start_method

owned_process()
start_method()
refused = forkserver._forkserver._forkserver_pid
discard_unused_server()  # the job failed its checks
gone = forkserver._forkserver._forkserver_pid is None and not os.path.exists(f"/proc/{refused}")
start_method()
used = forkserver._forkserver._forkserver_pid
fork_target(print, ())  # a rank is about to be forked from it
discard_unused_server()
print(repr((gone, used not in (None, refused), forkserver._forkserver._forkserver_pid == used)))
"""


def test_a_job_refused_before_its_launch_stops_the_server_forked_for_it(tmp_path):
    """A job that fails its checks leaves no server importing the trainer behind it; a server
    that ranks are forked from is left alone."""
    script = tmp_path / "refused.py"
    script.write_text(DISCARDED)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr
    assert eval(done.stdout.strip().splitlines()[-1]) == (True, True, True)


def test_ranks_are_spawned_where_asked_or_where_the_server_is_not_the_known_one(monkeypatch):
    """`SHARDWISE_FORKSERVER=0`, or a Python whose ForkServer holds other fields than 3.11's
    (this module sets and calls them): the ranks are spawned, as they would be without it, and
    still see the launcher's environment."""
    from shardwise.training.launch import forkserver as ours

    monkeypatch.setenv(ours.OPT_OUT, "0")
    assert start_method() == "spawn"
    monkeypatch.setenv("TEST_FORKSERVER_VARIABLE", "spawned")
    assert _started_child("TEST_FORKSERVER_VARIABLE")[0] == "spawned"
    monkeypatch.delenv(ours.OPT_OUT)

    class Newer:
        """A server as a later Python might hold it: an authentication key more."""

        def __init__(self) -> None:
            self.__dict__.update(dict.fromkeys(ours._SERVER_FIELDS))
            self._forkserver_authkey = b"key"

        def _stop(self) -> None:
            raise AssertionError("an unknown server is never stopped or started by us")

    monkeypatch.setattr(forkserver, "_forkserver", Newer())
    assert not ours.known_server() and start_method() == "spawn"
