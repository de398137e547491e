"""`shardwise` commands for the tests, forked from a process that has imported torch and the
launcher once, instead of a new interpreter per command.

A `shardwise` command spends its first seconds importing torch (2.3-3.4 CPU-s on this project's
machines) and its launcher's server imports torch._dynamo and the trainer after it (about 2 more):
the e2e tests run about a hundred commands, so a fifth of their CPU went to those imports. Here
one server per pytest worker (this file, run as a script by `run`) imports them once and forks a
child per command that runs the console script as the interpreter would: the command's argv,
environment, working directory and standard streams (`/dev/null`, two pipes), `sys.path` with
the script's directory first, `__main__` the script (multiprocessing's spawned children re-import
it from there), exit code from `SystemExit`, then threads joined and atexit handlers run.

What a new interpreter reads once, the child cannot change. A command whose environment differs
from the server's in a variable read at import (`TORCH_*`, `OMP_*`, `TMPDIR`…: anything not in
`RUNTIME`) runs by exec as before, but for `PYTHONPATH`, which the server has not set: the child
puts its entries where the interpreter would, after the script's directory. Every command of a
test that asks for the console script itself (`helpers.shardwise_command(fresh=True)`) runs by
exec, and so does every command with `SHARDWISE_TESTS_EXEC=1`. The server refuses to serve if
its imports printed anything (a warning a new interpreter would print to the command's stderr)
or started a thread. Where this process's own environment changes (a test sets a variable and
leaves it), the server is started again with it. `SHARDWISE_TESTS_COMMAND_SERVER_LOG=PATH`
appends to PATH each command left to exec and the variables that kept it from the server.

Protocol: a SEQPACKET Unix socket in the abstract namespace; one connection per command: the
request (JSON: argv, env, cwd) with the three descriptors; the reply the child's pid, then its
exit status when it ends. The server ends when the pytest worker closes its stdin.
"""

from __future__ import annotations

import json
import os
import sys

if __name__ == "__main__":  # as the console script sees it: its own directory first, not tests/
    sys.path[0] = os.path.dirname(sys.executable)

import contextlib
import locale
import selectors
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from shardwise.training.launch import forkserver

PRELOAD = ("shardwise.cli", "shardwise.training.run", *forkserver.PRELOAD)
"""What a `shardwise train` imports in its launcher and its ranks' server."""

RUNTIME = (
    *forkserver.RUNTIME_ONLY,
    "MLFLOW_",
    "AWS_",
    "TORCHINDUCTOR_CACHE_DIR",  # set by torch in this process where it compiled something
    "TRITON_CACHE_DIR",
    "RAY_",  # Ray is imported by the commands that use it, never by the server
)
"""Variables (or prefixes) that nothing the server imports reads at import (the ranks' server's
own, and those of libraries it does not import): a command whose environment differs from the
server's only in these is forked."""

_MESSAGE = 1 << 20


# ---- the server (this file as a script) ----


def _serve(address: str) -> None:
    import importlib
    import io
    import threading

    stderr = io.StringIO()
    real_stderr, sys.stderr = sys.stderr, stderr
    try:
        for name in PRELOAD:
            importlib.import_module(name)
    finally:
        sys.stderr = real_stderr
    if stderr.getvalue() or threading.active_count() != 1:
        print(f"not serving: imports printed {stderr.getvalue()!r}, threads", threading.enumerate())
        sys.stdout.flush()
        return
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(address)
    listener.listen(16)
    select = selectors.DefaultSelector()
    select.register(listener, selectors.EVENT_READ, "accept")
    select.register(sys.stdin, selectors.EVENT_READ, "parent")
    print("ready", flush=True)
    while True:
        for key, _ in select.select():
            if key.data == "parent":  # the pytest worker closed its end: it is gone
                return
            if key.data == "accept":
                connection, _ = listener.accept()
                message, fds, _, _ = socket.recv_fds(connection, _MESSAGE, 3)
                request = json.loads(message)
                pid = os.fork()
                if pid == 0:  # the server's descriptors (all it selects on) are not the command's
                    registered = [k.fd for k in select.get_map().values()]
                    for fd in [select.fileno(), connection.fileno(), *registered]:
                        os.close(fd)
                    _command(request, fds)  # never returns
                for fd in fds:
                    os.close(fd)
                connection.send(json.dumps({"pid": pid}).encode())
                done = os.pidfd_open(pid)
                select.register(done, selectors.EVENT_READ, (pid, connection))
            else:
                pid, connection = key.data
                select.unregister(key.fd)
                os.close(key.fd)
                _, status = os.waitpid(pid, 0)
                with contextlib.suppress(OSError):
                    connection.send(json.dumps({"status": status}).encode())
                connection.close()


def _command(request: dict[str, Any], fds: list[int]) -> None:
    """In the forked child: become the console script's process and run it."""
    import atexit
    import runpy
    import signal
    import tempfile
    import threading

    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in set(fds) - {0, 1, 2}:
            os.close(fd)
        if request["netns"]:  # as `ip netns exec NAME` enters it
            _enter_network_namespace(request["netns"])
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        tempfile.tempdir = None
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        script = request["argv"][0]
        sys.argv = list(request["argv"])
        extra = [
            os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p
        ]
        sys.path[:1] = [os.path.dirname(script), *extra]
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:
            code = _exit_code(e.code)
        except KeyboardInterrupt:  # as the interpreter does: die of SIGINT
            sys.excepthook(*sys.exc_info())
            code = -signal.SIGINT
        except BaseException:
            sys.excepthook(*sys.exc_info())
            code = 1
        threading._shutdown()  # type: ignore[attr-defined]  # as the interpreter's exit does
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        if code < 0:
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        os._exit(code)


def _enter_network_namespace(name: str) -> None:
    import ctypes

    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            raise OSError(ctypes.get_errno(), f"setns into network namespace {name}")
    finally:
        os.close(fd)


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


# ---- the client (the pytest worker) ----


class _Server:
    def __init__(self) -> None:
        self.name = f"shardwise-tests-commands-{os.getpid()}-{time.monotonic_ns()}"
        self.address = "\0" + self.name  # the abstract namespace: no file to remove
        self.env = dict(os.environ)
        self.process = subprocess.Popen(
            [sys.executable, __file__, self.name],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert self.process.stdout is not None
        self.ready = self.process.stdout.readline().strip() == "ready"

    def refuses(self, env: dict[str, str]) -> set[str]:
        """Why a command of environment `env` cannot be forked: the variables read at import
        that differ from the server's ("" where the server does not run)."""
        if not self.ready or self.process.poll() is not None:
            return {""}
        differ = {k for k in env.keys() | self.env.keys() if env.get(k) != self.env.get(k)}
        refused = {k for k in differ if not k.startswith(RUNTIME)}
        if "PYTHONPATH" not in self.env:  # where the server has it, it cannot be taken out
            refused.discard("PYTHONPATH")
        return refused

    def start(
        self, argv: list[str], env: dict[str, str], cwd: str, streams: list[int], netns: str | None
    ) -> Forked:
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        connection.connect(self.address)
        request = {"argv": argv, "env": env, "cwd": cwd, "netns": netns}
        socket.send_fds(connection, [json.dumps(request).encode()], streams)
        pid = json.loads(connection.recv(_MESSAGE))["pid"]
        return Forked(argv, pid, connection)

    def stop(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=30)


class Forked:
    """A command forked from the server: what the tests use of `subprocess.Popen` (its pid,
    `poll`, `wait`, `communicate`, `send_signal`, `kill`, `returncode`, `stdout`/`stderr` where
    they are pipes). The command is the server's child: its exit status comes over the
    connection."""

    def __init__(self, args: list[str], pid: int, connection: socket.socket) -> None:
        self.args, self.pid, self._connection = args, pid, connection
        self.returncode: int | None = None
        self.stdout: Any = None
        self.stderr: Any = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._receive(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and not self._receive(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def _receive(self, timeout: float | None) -> bool:
        """Whether the exit status came within `timeout` (0: at once; None: whenever)."""
        self._connection.settimeout(timeout)
        try:
            reply = self._connection.recv(_MESSAGE)
        except (BlockingIOError, TimeoutError):
            return False
        self._connection.close()
        if not reply:
            raise RuntimeError(f"the tests' server of commands ended before {self.args} did")
        self.returncode = os.waitstatus_to_exitcode(json.loads(reply)["status"])
        return True

    def communicate(self, timeout: float | None = None) -> tuple[str | None, str | None]:
        """The rest of what the command's pipes hold, until every writer closed them (its
        ranks and servers too, as `Popen.communicate`), then its exit."""
        import threading

        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        read: dict[int, str] = {}
        pipes = [(i, p) for i, p in enumerate((self.stdout, self.stderr)) if p is not None]
        readers = [
            threading.Thread(target=lambda i=i, p=p: read.__setitem__(i, p.read()), daemon=True)
            for i, p in pipes
        ]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join(max(deadline - time.monotonic(), 0))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        self.wait(max(deadline - time.monotonic(), 0.001))
        for _, pipe in pipes:
            pipe.close()
        self.stdout = self.stderr = None
        return read.get(0), read.get(1)

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(9)


_server: _Server | None = None


def start(
    argv: list[str],
    *,
    env: dict[str, str],
    cwd: Path | str,
    stdout: Any = None,
    stderr: Any = None,
    netns: str | None = None,
) -> Forked | None:
    """`argv` (a console script and its arguments) forked from this worker's server, as
    `subprocess.Popen(argv, env=env, cwd=cwd, stdin=DEVNULL, stdout=…, stderr=…, text=True)`
    starts it (`ip netns exec NETNS …` with `netns`: in that network namespace); each stream
    `subprocess.PIPE`, `subprocess.DEVNULL`, a file, or None (this process's). None where it
    must run by exec instead (see the module)."""
    global _server
    if os.environ.get("SHARDWISE_TESTS_EXEC") == "1":
        return None
    if _server is None:
        _server = _Server()
    if _server.refuses(dict(os.environ)):  # this process's own environment changed: follow it
        _server.stop()
        _server = _Server()
    refused = _server.refuses(env)
    if refused:
        if os.environ.get("SHARDWISE_TESTS_COMMAND_SERVER_LOG"):
            with open(os.environ["SHARDWISE_TESTS_COMMAND_SERVER_LOG"], "a") as log:
                print(" ".join(argv[1:3]), sorted(refused), file=log)
        return None
    with contextlib.ExitStack() as closing:
        null = os.open(os.devnull, os.O_RDWR)
        closing.callback(os.close, null)
        streams: list[int] = [null]
        pipes: list[Any] = []
        for target in (stdout, stderr):
            if target == subprocess.PIPE:
                read, write = os.pipe()
                closing.callback(os.close, write)
                streams.append(write)
                # text, as subprocess decodes it: the locale's encoding, universal newlines
                pipes.append(os.fdopen(read, encoding=locale.getpreferredencoding(False)))
            elif target == subprocess.DEVNULL:
                streams.append(null)
                pipes.append(None)
            else:
                streams.append(target.fileno() if target is not None else len(streams))
                pipes.append(None)
        forked = _server.start(argv, env, str(cwd), streams, netns)
    forked.stdout, forked.stderr = pipes
    return forked


def run(
    argv: list[str], *, env: dict[str, str], cwd: Path | str, timeout: float
) -> subprocess.CompletedProcess[str] | None:
    """`argv` forked from this worker's server, as `subprocess.run(argv, env=env, cwd=cwd,
    capture_output=True, text=True, timeout=timeout, stdin=DEVNULL)` runs it; None where it
    must run by exec instead (see the module)."""
    forked = start(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return None if forked is None else completed(forked, timeout)


def completed(process: Any, timeout: float) -> subprocess.CompletedProcess[str]:
    """What `subprocess.run` does with the process it started (a Popen, or a Forked with both
    streams piped): its output and exit code; killed, waited for and TimeoutExpired raised at
    `timeout`."""
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def stop() -> None:
    """Stop this worker's server, if it runs."""
    global _server
    if _server is not None:
        _server.stop()
        _server = None


if __name__ == "__main__":
    _serve("\0" + sys.argv[1])
