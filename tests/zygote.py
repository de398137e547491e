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
leaves it), the server is started again with it. `SHARDWISE_TESTS_ZYGOTE_LOG=PATH` appends to
PATH each command left to exec and the variables that kept it from the server.

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

PRELOAD = (
    "shardwise.cli",
    "shardwise.training.launch.local",
    "shardwise.training.launch.server_signals",
    "torch._dynamo",
    "shardwise.training.launch.worker",
    "shardwise.training.trainer.loop",
)
"""What a `shardwise train` imports in its launcher and its ranks' server (forkserver.PRELOAD,
checked by a test)."""

RUNTIME = (
    "SHARDWISE_",
    "MLFLOW_",
    "AWS_",
    "PYTEST_CURRENT_TEST",
    "TORCHELASTIC_",
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
    "GLOO_SOCKET_IFNAME",
    "TORCHINDUCTOR_CACHE_DIR",  # set by torch in this process where it compiled something
    "TRITON_CACHE_DIR",
)
"""Variables (or prefixes) that nothing the server imports reads at import: a command whose
environment differs from the server's only in these is forked."""

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
    own = [listener.fileno(), select.fileno(), sys.stdin.fileno()]  # closed in every command
    while True:
        for key, _ in select.select():
            if key.data == "parent":  # the pytest worker closed its end: it is gone
                return
            if key.data == "accept":
                connection, _ = listener.accept()
                message, fds, _, _ = socket.recv_fds(connection, _MESSAGE, 3)
                request = json.loads(message)
                pid = os.fork()
                if pid == 0:  # the server's descriptors are not the command's
                    registered = [k.fd for k in select.get_map().values()]
                    for fd in [*own, connection.fileno(), *registered]:
                        with contextlib.suppress(OSError):
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
            os.close(fd)
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
        self.name = f"shardwise-tests-zygote-{os.getpid()}-{time.monotonic_ns()}"
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

    def run(
        self, argv: list[str], env: dict[str, str], cwd: str, timeout: float
    ) -> subprocess.CompletedProcess[str]:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        null = os.open(os.devnull, os.O_RDONLY)
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as connection:
            connection.connect(self.address)
            request = json.dumps({"argv": argv, "env": env, "cwd": cwd}).encode()
            socket.send_fds(connection, [request], [null, out_w, err_w])
            for fd in (null, out_w, err_w):
                os.close(fd)
            pid = json.loads(connection.recv(_MESSAGE))["pid"]
            deadline = time.monotonic() + timeout
            outputs = _read_until_closed([out_r, err_r], deadline)
            connection.settimeout(max(deadline - time.monotonic(), 0.001))
            try:
                reply = connection.recv(_MESSAGE) if outputs is not None else b""
            except TimeoutError:
                reply = b""
            if not reply:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, 9)
                raise subprocess.TimeoutExpired(argv, timeout)
        status = json.loads(reply)["status"]
        assert outputs is not None
        stdout, stderr = (_text(b) for b in outputs)
        return subprocess.CompletedProcess(argv, os.waitstatus_to_exitcode(status), stdout, stderr)

    def stop(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=30)


def _read_until_closed(fds: list[int], deadline: float) -> list[bytes] | None:
    """Everything written to the pipes `fds` until every writer closed them (as
    `communicate` reads); None at `deadline`."""
    chunks: dict[int, list[bytes]] = {fd: [] for fd in fds}
    with selectors.DefaultSelector() as select:
        for fd in fds:
            select.register(fd, selectors.EVENT_READ)
        try:
            while select.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                for key, _ in select.select(left):
                    data = os.read(key.fd, 1 << 16)
                    if data:
                        chunks[key.fd].append(data)
                    else:
                        select.unregister(key.fd)
        finally:
            for fd in fds:
                os.close(fd)
    return [b"".join(chunks[fd]) for fd in fds]


def _text(data: bytes) -> str:
    """As `subprocess.run(text=True)` decodes: the locale's encoding, universal newlines."""
    decoded = data.decode(locale.getpreferredencoding(False))
    return decoded.replace("\r\n", "\n").replace("\r", "\n")


_server: _Server | None = None


def run(
    argv: list[str], *, env: dict[str, str], cwd: Path | str, timeout: float
) -> subprocess.CompletedProcess[str] | None:
    """`argv` (a console script and its arguments) forked from this worker's server, as
    `subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout,
    stdin=DEVNULL)` would run it; None where it must run by exec instead (see the module)."""
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
        if os.environ.get("SHARDWISE_TESTS_ZYGOTE_LOG"):
            with open(os.environ["SHARDWISE_TESTS_ZYGOTE_LOG"], "a") as log:
                print(" ".join(argv[1:3]), sorted(refused), file=log)
        return None
    return _server.run(argv, env, str(cwd), timeout)


def stop() -> None:
    """Stop this worker's server, if it runs."""
    global _server
    if _server is not None:
        _server.stop()
        _server = None


if __name__ == "__main__":
    _serve("\0" + sys.argv[1])
