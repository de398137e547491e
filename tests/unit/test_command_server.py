"""The tests' server of `shardwise` commands (tests/command_server.py) runs a console script as a
new interpreter does: the same argv, sys.path, `__main__`, environment, directory, standard
streams, exit code and exit handlers, and spawned children that re-import `__main__`; and it
leaves to exec the commands whose environment it could not give them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import command_server
import helpers

pytestmark = pytest.mark.slow  # starts a server that imports torch

SCRIPT = """\
#!{python}
import atexit, json, multiprocessing, os, sys, threading, time

def child(queue):
    queue.put(os.environ.get("SHARDWISE_PROBE"))

def late():
    time.sleep(0.3)
    print("thread joined", flush=True)

if __name__ == "__main__":
    atexit.register(lambda: print("atexit ran", flush=True))
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=child, args=(queue,))
    process.start()
    spawned = queue.get(timeout=60)
    process.join()
    threading.Thread(target=late).start()
    print(json.dumps({{
        "argv": sys.argv, "path0": sys.path[0], "path1": sys.path[1], "cwd": os.getcwd(),
        "probe": os.environ.get("SHARDWISE_PROBE"), "stdin": sys.stdin.read(),
        "main": sys.modules["__main__"].__file__, "spawned": spawned,
    }}))
    print("to stderr", file=sys.stderr)
    sys.exit(int(sys.argv[1]))
"""


@pytest.fixture
def script(tmp_path) -> Path:
    path = tmp_path / "probe-script"
    path.write_text(SCRIPT.format(python=sys.executable))
    path.chmod(0o755)
    return path


def test_a_forked_command_runs_as_the_interpreter_runs_it(script, tmp_path):
    env = {**os.environ, "SHARDWISE_PROBE": "seen", "PYTHONPATH": str(tmp_path)}
    argv = [str(script), "3", "an argument"]
    forked = command_server.run(argv, env=env, cwd=tmp_path, timeout=120)
    assert forked is not None  # the server takes a change of a runtime variable and PYTHONPATH
    executed = subprocess.run(
        argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert executed.returncode == 3, executed.stderr
    assert (forked.returncode, forked.stdout, forked.stderr) == (
        executed.returncode,
        executed.stdout,
        executed.stderr,
    )
    assert '"spawned": "seen"' in forked.stdout and "atexit ran" in forked.stdout
    assert forked.stdout.index("thread joined") < forked.stdout.index("atexit ran")


def test_a_started_command_is_what_the_tests_use_of_popen(script, tmp_path):
    """Pipes in text, read in part then to the end by communicate; poll, wait, the exit code."""
    env = {**os.environ, "SHARDWISE_PROBE": "seen"}
    argv = [str(script), "0"]
    forked = command_server.start(
        argv, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert forked is not None
    first = forked.stdout.readline()
    out, err = forked.communicate(timeout=120)
    assert forked.returncode == 0 and forked.poll() == 0 and forked.wait() == 0
    executed = subprocess.run(
        argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert (first + out, err) == (executed.stdout, executed.stderr)


def test_a_command_in_a_network_namespace_sees_only_that_namespace(tmp_path):
    from netns import two_nodes

    probe = tmp_path / "interfaces"
    probe.write_text(
        f"#!{sys.executable}\nimport socket\nprint(sorted(n for _, n in socket.if_nameindex()))\n"
    )
    probe.chmod(0o755)
    with two_nodes() as (a, _):
        forked = command_server.start(
            [str(probe)], env=dict(os.environ), cwd=tmp_path, stdout=subprocess.PIPE,
            netns=a.namespace,
        )  # fmt: skip
        assert forked is not None
        out, _ = forked.communicate(timeout=60)
        executed = subprocess.run(
            ["ip", "netns", "exec", a.namespace, str(probe)], capture_output=True, text=True,
            timeout=60,
        )  # fmt: skip
    assert forked.returncode == 0 and out == executed.stdout
    assert a.interface in out and "eth0" not in out


def test_a_shardwise_command_prints_and_exits_as_the_console_script_does(tmp_path):
    for args in (["--help"], ["train", str(tmp_path / "missing.toml")]):
        forked = helpers.shardwise_command(*args, timeout=120)
        executed = helpers.shardwise_command(*args, timeout=120, fresh=True)
        assert (forked.returncode, forked.stdout, forked.stderr) == (
            executed.returncode,
            executed.stdout,
            executed.stderr,
        )
    assert forked.returncode == 2 and "does not exist" in forked.stderr


def test_an_environment_read_at_import_is_left_to_exec(script, tmp_path):
    for changed in ({"TORCH_SHOW_CPP_STACKTRACES": "1"}, {"TMPDIR": str(tmp_path)}):
        env = {**os.environ, **changed}
        assert command_server.run([str(script), "0"], env=env, cwd=tmp_path, timeout=60) is None


def test_a_command_past_its_time_is_killed(tmp_path):
    sleeper = tmp_path / "sleeper"
    sleeper.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(600)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        command_server.run([str(sleeper)], env=dict(os.environ), cwd=tmp_path, timeout=2)
    # the leak guard (conftest) fails the test if the command still runs
