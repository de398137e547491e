"""N workers on this machine (and as many on each other node of a multi-node job) through
torch's elastic agent, the engine behind torchrun: `launch` starts them, restarts them all when
one fails (`fault.max_restarts`), and turns a worker's failure into an error that names the
rank whose own error ended the run (not a peer that lost it). training/run.py decides what to
launch; launch/outcome.py what the launch ended in.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed import DistNetworkError
from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous import RendezvousError
from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from shardwise.common.environment import LAUNCHER_PID, environment
from shardwise.common.errors import ConfigError, first_line
from shardwise.training.fault.watchdog import after_a_peer
from shardwise.training.launch.forkserver import fork_target, start_method
from shardwise.training.launch.outcome import Interrupted, WorkerFailed
from shardwise.training.launch.stores import (
    LOOPBACK,
    RENDEZVOUS,
    loopback_collectives,
    register_rendezvous,
)


@dataclass(frozen=True)
class Nodes:
    """A job across machines: one `shardwise train` per node, meeting at a c10d rendezvous that
    the node at `endpoint` hosts. Every node passes the same `count`, `endpoint` and `run_id`."""

    count: int
    endpoint: str
    """HOST:PORT of the rendezvous, on the node that hosts it."""
    run_id: str | None = None
    """The same on every node; None: the job's name."""
    local_addr: str | None = None
    """This node's address as the others reach it (default: resolved from the host name)."""

    def check(self) -> None:
        """Refuse, in one line and at once, an endpoint or address the agents could only wait
        on: a port out of range, a host name that does not resolve."""
        host, _, port = self.endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(
                f"--rdzv-endpoint {self.endpoint!r}: expected HOST:PORT with a port from 1 to "
                "65535 (one node's address and a free port on it; every node passes the same)"
            )
        for flag, name in (("--rdzv-endpoint", host), ("--local-addr", self.local_addr)):
            if name:
                try:
                    socket.getaddrinfo(name.strip("[]"), None)
                except (socket.gaierror, UnicodeError) as e:
                    raise ConfigError(
                        f"{flag} {name}: the host name does not resolve "
                        f"({getattr(e, 'strerror', None) or e}); give an address, or a name "
                        "every node resolves"
                    ) from None

    def rendezvous_options(self) -> dict[str, Any]:
        host = self.endpoint.rsplit(":", 1)[0]
        if self.local_addr is None:
            return {}  # torch tells the host by matching the endpoint against this machine
        return {"is_host": self.local_addr == host}

    def hosts_here(self) -> bool:
        """Whether this node hosts what the nodes meet at: its --local-addr is the endpoint's
        host, or without one, the endpoint names this machine (as torch's rendezvous tells)."""
        host = self.endpoint.rsplit(":", 1)[0]
        hosts = self.rendezvous_options().get("is_host")
        return bool(hosts) if hosts is not None else _matches_machine_hostname(host)


def launch(
    entry: Callable[..., Any],
    args: tuple[Any, ...],
    *,
    nproc: int,
    max_restarts: int = 0,
    nodes: Nodes | None = None,
) -> dict[int, Any]:
    """Run `entry(*args)` in `nproc` processes on this machine (and as many on each other node of
    `nodes`), restarting all of them up to `max_restarts` times when one fails; return each local
    rank's return value by global rank."""
    # the agent's directory for the workers' error files (read into ChildFailedError), removed
    # after the launch: torch's default is a new /tmp/torchelastic_* per launch, never removed
    logs = tempfile.TemporaryDirectory(prefix="shardwise-elastic-", ignore_cleanup_errors=True)
    config = LaunchConfig(
        min_nodes=nodes.count if nodes else 1,
        max_nodes=nodes.count if nodes else 1,
        nproc_per_node=nproc,
        run_id=(nodes and nodes.run_id) or f"shardwise-{uuid.uuid4().hex[:8]}",
        # torch's c10d rendezvous over a store bound to the endpoint's address (stores.py);
        # on one machine loopback, on port 0: the agent's store takes a free port.
        rdzv_backend=RENDEZVOUS,
        rdzv_endpoint=nodes.endpoint if nodes else f"{LOOPBACK}:0",
        rdzv_configs=nodes.rendezvous_options() if nodes else {},
        local_addr=nodes.local_addr if nodes else None,
        max_restarts=max_restarts,
        logs_specs=DefaultLogsSpecs(log_dir=logs.name),
    )
    register_rendezvous()
    listen = contextlib.nullcontext() if nodes else loopback_collectives()
    started = time.monotonic()
    try:
        with _fresh_worker_store(), listen, logs, environment({LAUNCHER_PID: str(os.getpid())}):
            # ranks forked from a server that imported torch and the trainer (launch/forkserver/)
            config.start_method = start_method()
            target, target_args = fork_target(entry, args)  # in this environment, as it is now
            # shardwise reports failures itself (WorkerFailed); the agent's own log would repeat
            # them (set after the server starts, which may be a fork of this process: the ranks
            # keep torch elastic's own log levels)
            for name in ("torch.distributed.elastic", "torchelastic-events-null"):
                logging.getLogger(name).setLevel(logging.CRITICAL)
            try:
                results: dict[int, Any] = elastic_launch(config, target)(*target_args)
            except ChildFailedError as e:  # read while the agent's error files are there
                raise _first_failure(e) from None
        return results
    except (DistNetworkError, RendezvousError) as e:  # only across machines: ours is local
        assert nodes is not None
        reason = first_line(e)
        raise ConfigError(
            f"the nodes could not meet at --rdzv-endpoint {nodes.endpoint} within "
            f"{time.monotonic() - started:.0f} s ({reason}); start "
            "shardwise train on the node at that address too, with the same --nnodes, and "
            "check that this node reaches it (address, port, firewall)"
        ) from None
    except SignalException as e:  # the agent has already stopped the workers
        raise Interrupted(e.sigval) from None


def _fresh_worker_store() -> contextlib.AbstractContextManager[None]:
    """Workers host their own TCPStore, a new one for every attempt, instead of sharing the
    agent's (torch's default since 2.4). The agent's store outlives attempts, so a restarted
    group would read the dead workers' addresses; torch separates attempts by the restart count,
    but that count is per node and differs across nodes after one node's workers fail."""
    return environment({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})


def _first_failure(error: ChildFailedError) -> Exception:
    """The failure to report: the earliest, preferring a rank's own error to one caused by a
    peer's death (the error files' timestamps have whole seconds, so a crash and its echo on the
    other ranks often tie)."""

    def order(item: tuple[int, ProcessFailure]) -> tuple[bool, int, int]:
        rank, failure = item
        return _echo(failure), failure.timestamp, rank

    failures = dict(error.failures)
    if all(_echo(f) for f in failures.values()):
        failures.update(_node_errors(failures))
    rank, failure = min(failures.items(), key=order)
    message = _failure_message(failure)
    data = failure.error_file_data.get("message", {}) if failure.error_file_data else {}
    traceback = data.get("extraInfo", {}).get("py_callstack", "") if isinstance(data, dict) else ""
    prefix = f"{ConfigError.__name__}: "
    if message.startswith(prefix):
        return ConfigError(f"rank {rank}: {message.removeprefix(prefix)}")
    return WorkerFailed(rank=rank, exitcode=failure.exitcode, message=message, traceback=traceback)


def _echo(failure: ProcessFailure) -> bool:
    """Whether the failure is a consequence of another rank's end (watchdog.after_a_peer)."""
    return after_a_peer(_failure_message(failure))


def _node_errors(failures: dict[int, ProcessFailure]) -> dict[int, ProcessFailure]:
    """The error files this node's other ranks wrote in the same attempt. torch's agent reports
    one failed process per node (the lowest local rank among those ended when it looked), so
    where a rank's own error ended it and its peers failed at once with it (their collectives
    lost it), the agent may report a peer's echo; each rank writes its own error before it
    leaves its group (worker.py), so the cause's file is there."""
    found: dict[int, ProcessFailure] = {}
    for rank, failure in failures.items():
        path = Path(failure.error_file)
        if path.name != "error.json" or not path.parent.name.isdigit():
            continue
        for other in path.parent.parent.iterdir():
            if other.name.isdigit() and (other / "error.json").is_file():
                local = int(other.name)
                global_rank = rank - failure.local_rank + local
                if global_rank not in failures:
                    found[global_rank] = ProcessFailure(  # an uncaught exception: exit code 1
                        local_rank=local, pid=0, exitcode=1, error_file=str(other / "error.json")
                    )
    return found


def _failure_message(failure: ProcessFailure) -> str:
    data = failure.error_file_data.get("message", {}) if failure.error_file_data else {}
    message = data.get("message", "") if isinstance(data, dict) else str(data)
    if message in ("", "<NONE>"):  # killed by a signal, or exited without raising: no error file
        message = (
            failure.message if failure.exitcode < 0 else f"exited with code {failure.exitcode}"
        )
    return str(message)
