"""Start a training job: check it, start N workers on this machine through torch's elastic agent
(the engine behind torchrun) or join the workers torchrun/Slurm started, and turn a worker's
failure into an error that names the rank.

The path from the command line to `loss.backward()`: `cli._train` → `train` (here) →
`worker.run_worker` (in every rank) → `trainer.loop.train` → `trainer.step.train_step`. Where a
run starts is checkpoint/resume.py's decision, shared with every other launcher.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.distributed import DistNetworkError
from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous import RendezvousError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from shardwise.common.console import warn
from shardwise.common.environment import LAUNCHER_PID, environment
from shardwise.common.errors import ConfigError, first_line
from shardwise.common.job_files import apply_override
from shardwise.training import builders
from shardwise.training.checkpoint.export import check_weights
from shardwise.training.checkpoint.resume import resume_point
from shardwise.training.config.derive import derive
from shardwise.training.config.load import load_config, validate
from shardwise.training.config.schema import JobConfig
from shardwise.training.fault.watchdog import after_a_peer
from shardwise.training.launch.env import WorkerEnv, detect
from shardwise.training.launch.forkserver import discard_unused_server, fork_target, start_method
from shardwise.training.launch.outcome import Interrupted, WorkerFailed, outcome
from shardwise.training.launch.stores import (
    LOOPBACK,
    RENDEZVOUS,
    loopback_collectives,
    register_rendezvous,
)
from shardwise.training.launch.worker import check_devices, run_worker
from shardwise.training.parallel.checks import check_layout

if TYPE_CHECKING:
    from shardwise.training.trainer.train_summary import TrainSummary


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


def train(
    config: JobConfig | str | Path,
    *,
    nproc: int | None = None,
    resume: str = "never",
    overrides: list[str] | tuple[str, ...] = (),
    dry_run: bool = False,
    nodes: Nodes | None = None,
) -> TrainSummary | None:
    """Train a job: start `nproc` local workers (on each of `nodes`, when given), or join the job
    torchrun/Slurm already started.

    `config` is a `JobConfig` or the path of a job file; `resume` is `never` (refuse to overwrite
    an earlier run's checkpoints), `auto` (continue from the newest complete checkpoint, if any) or
    the path of a checkpoint. Returns rank 0's summary (None where rank 0 does not run: other
    ranks under torchrun/Slurm, other nodes).
    With `dry_run`, the workers build the layout on the meta device and rank 0 prints what each
    rank would hold; nothing is trained or written, and None is returned.
    """
    config = _with_overrides(config, overrides)
    worker = _started_by_a_launcher(nodes)
    if worker is not None:
        if nproc not in (None, worker.world_size):
            warn(
                f"--nproc {nproc} ignored: this process is rank {worker.rank} of "
                f"{worker.world_size} started by {worker.launcher}",
                stacklevel=2,
            )
        check_job(config, worker.world_size, worker.local_world_size)
        # Every rank runs this; the ranks decide where to start together, once joined.
        return publish(
            config, run_worker(config.model_dump(mode="json"), resume, dry_run, decided=False)
        )
    # The ranks' server, before the checks below run anything of the job here (a data source's
    # client, a user's module): a `shardwise` command forks it from this process, which must not
    # have started a runtime that a fork breaks (launch/forkserver/).
    start_method()
    per_node = nproc or 1
    checkpoint = _checked_here(config, per_node, nodes, None if dry_run else resume)
    store_host = LOOPBACK if nodes is None else ""
    args = (config.model_dump(mode="json"), checkpoint, dry_run, True, store_host)
    started = time.time()
    try:
        summary: TrainSummary | None = launch(
            run_worker,
            args,
            nproc=per_node,
            max_restarts=config.fault.max_restarts,
            nodes=nodes and replace(nodes, run_id=nodes.run_id or config.job.name),
        ).get(0)
    except (Interrupted, WorkerFailed) as failure:
        summary = outcome(config.run_dir, started, failure=failure)
    return publish(config, summary)


def publish(config: JobConfig, summary: TrainSummary | None) -> TrainSummary | None:
    """Under `tracking.log_model`, the finished run's final checkpoint logged to MLflow (and
    registered) by this process once the ranks are done; a store that is down is said in the
    summary (`model_error`), the checkpoint left as it is."""
    if summary is None or summary.preempted or not config.tracking.log_model:
        return summary
    from shardwise.common.model_registry import RegistryError
    from shardwise.training.tracking.registered_model import log_checkpoint

    assert summary.checkpoint is not None  # the last step always saves
    try:
        logged = log_checkpoint(
            summary.checkpoint,
            name=config.tracking.registered_model,
            uri=config.tracking_uri,
            run_id=summary.mlflow_run_id,
            metrics=summary.metrics,
        )
    except RegistryError as e:
        summary.model_error = (
            f"{e}; the checkpoint {summary.checkpoint} is intact: `shardwise export "
            f"{summary.checkpoint} --mlflow {config.tracking.registered_model or 'NAME'}` logs "
            "it later"
        )
        return summary
    summary.model_uri = logged.model_uri
    return summary


def _checked_here(
    config: JobConfig, per_node: int, nodes: Nodes | None, resume: str | None
) -> str | None:
    """The job checked for a launch from this process, and the checkpoint it resumes from (none
    for a dry run: `resume` None). A refused job stops the server started for it, which would
    otherwise import the trainer for nothing on the cores the refusal's message waits on."""
    try:
        check_job(config, per_node * (nodes.count if nodes else 1), per_node)
        if nodes is not None:
            nodes.check()
        return None if resume is None else resume_point(config, resume)
    except BaseException:
        discard_unused_server()
        raise


def _started_by_a_launcher(nodes: Nodes | None) -> WorkerEnv | None:
    """This process's rank where torchrun or Slurm started it as one; None where it launches."""
    worker = detect()
    if worker is not None and worker.launcher == "slurm" and nodes is not None:
        return None  # srun started one shardwise agent per node (launch/slurm.py), not ranks
    return worker


def _with_overrides(
    config: JobConfig | str | Path, overrides: list[str] | tuple[str, ...]
) -> JobConfig:
    """The job, from its file or object, with the `--set` overrides applied and validated."""
    if not isinstance(config, JobConfig):
        return load_config(config, overrides)
    if not overrides:
        return config
    raw = config.model_dump(mode="json")
    for item in overrides:
        apply_override(raw, item)
    return validate(raw)


def check_job(
    config: JobConfig, world_size: int, per_node: int, *, devices_here: bool = True
) -> None:
    """Everything that can be checked before a worker starts, in this process (`devices_here`:
    also this machine's GPUs, where the job runs here)."""
    derived = derive(config, world_size)
    builders.check(config)
    check_layout(config, derived)
    if config.model.init_from:
        check_weights(config.model.init_from, builders.build_on_meta(config))
    if devices_here:
        check_devices(config.job.device, per_node)


def report_result(summary: TrainSummary | None) -> int:
    """What a finished launch prints, and its exit code: the summary; and where the model was
    not logged (the MLflow store down), why, in one line, with exit code 2."""
    if summary is None:
        return 0
    print_summary(summary)
    if summary.model_error:
        print(f"shardwise: {summary.model_error}", file=sys.stderr)
        return 2
    return 0


def print_summary(summary: TrainSummary) -> None:
    """What a finished (or preempted) training run prints: its metrics and checkpoint."""
    metrics = "  ".join(
        f"{k} {v:.4f}" for k, v in summary.metrics.items() if k.startswith(("loss", "eval/"))
    )
    if summary.preempted:
        print(f"preempted (SIGTERM): stopped at step {summary.step}  {metrics}")
        print(f"checkpoint: {summary.checkpoint} (--resume auto continues from it)")
    else:
        print(f"done: step {summary.step}  {metrics}")
        print(f"checkpoint: {summary.checkpoint}")
    if summary.mlflow_run_id:
        print(f"mlflow run: {summary.mlflow_run_id}")
    if summary.model_uri:
        print(f"mlflow model: {summary.model_uri}")
