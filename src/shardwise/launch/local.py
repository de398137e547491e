"""Start a training job: check it, start N workers on this machine through torch's elastic agent
(the engine behind torchrun) or join the workers torchrun/Slurm started, and turn a worker's
failure into an error that names the rank.

The path from the command line to `loss.backward()`: `cli.main` → `train` (here) → `run_worker`
(here, in every rank) → `trainer.loop.train` → `trainer.loop.train_step`.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import json
import logging
import signal
import socket
import time
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed import DistNetworkError, PrefixStore, Store, TCPStore  # type: ignore[attr-defined]
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from shardwise import builders
from shardwise.checkpoint.export import check_weights
from shardwise.checkpoint.layout import (
    MANIFEST,
    complete_checkpoints,
    is_complete,
    name_of,
    newest_good,
    probe_writable,
    problem,
    read_manifest,
)
from shardwise.checkpoint.safe import check_metadata
from shardwise.config import (
    ConfigError,
    JobConfig,
    apply_override,
    derive,
    load_config,
    shown,
    validate,
)
from shardwise.fault.watchdog import describe as describe_hang
from shardwise.launch.env import WorkerEnv, detect, environment, visible_cpus
from shardwise.launch.stores import (
    LOOPBACK,
    RENDEZVOUS,
    loopback_collectives,
    register_rendezvous,
    worker_store,
)
from shardwise.parallel.checks import check_layout
from shardwise.redact import redacting_output

if TYPE_CHECKING:
    from shardwise.trainer.loop import TrainSummary


@dataclass
class WorkerFailed(RuntimeError):
    """A worker process ended with an error; `rank` is the first rank that failed."""

    rank: int
    exitcode: int
    message: str
    traceback: str

    def __str__(self) -> str:
        return f"rank {self.rank} failed (exit code {self.exitcode}): {self.message}"


class Interrupted(Exception):
    """The launcher received a termination signal (Ctrl-C, `kill`); the workers were stopped."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


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
        start_method="spawn",
    )
    # shardwise reports failures itself (WorkerFailed); the agent's own log would repeat them.
    for name in ("torch.distributed.elastic", "torchelastic-events-null"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    register_rendezvous()
    listen = contextlib.nullcontext() if nodes else loopback_collectives()
    started = time.monotonic()
    try:
        with _fresh_worker_store(), listen:
            results: dict[int, Any] = elastic_launch(config, entry)(*args)
        return results
    except ChildFailedError as e:
        raise _first_failure(e) from None
    except (DistNetworkError, RendezvousError) as e:  # only across machines: ours is local
        assert nodes is not None
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
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
    rank, failure = error.get_first_failure()
    data = failure.error_file_data.get("message", {}) if failure.error_file_data else {}
    message = data.get("message", "") if isinstance(data, dict) else str(data)
    traceback = data.get("extraInfo", {}).get("py_callstack", "") if isinstance(data, dict) else ""
    if message in ("", "<NONE>"):  # killed by a signal, or exited without raising: no error file
        message = (
            failure.message if failure.exitcode < 0 else f"exited with code {failure.exitcode}"
        )
    prefix = f"{ConfigError.__name__}: "
    if message.startswith(prefix):
        return ConfigError(f"rank {rank}: {message.removeprefix(prefix)}")
    return WorkerFailed(rank=rank, exitcode=failure.exitcode, message=message, traceback=traceback)


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
    worker = detect()
    if worker is not None and nproc not in (None, worker.world_size):
        warnings.warn(
            f"--nproc {nproc} ignored: this process is rank {worker.rank} of {worker.world_size} "
            f"started by {worker.launcher}",
            stacklevel=2,
        )
    per_node = nproc or 1
    world_size = worker.world_size if worker else per_node * (nodes.count if nodes else 1)
    _check_job(config, world_size, worker.local_world_size if worker else per_node)
    if worker is not None:
        # Every rank runs this; the ranks decide where to start together, once joined.
        return run_worker(config.model_dump(mode="json"), resume, dry_run, decided=False)
    if nodes is not None:
        nodes.check()
    checkpoint = None if dry_run else resume_point(config, resume)
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
    except Interrupted as stop:
        preempted = _preempted_summary(config, since=started)
        if stop.signum != signal.SIGTERM or preempted is None:
            raise
        return preempted  # the workers saved a checkpoint at a step boundary and stopped
    except WorkerFailed as failure:
        hang = describe_hang(config.run_dir / "hangs", since=started)
        if hang is None:
            raise
        raise WorkerFailed(failure.rank, failure.exitcode, hang, traceback="") from None
    return summary


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


def _check_job(config: JobConfig, world_size: int, per_node: int) -> None:
    """Everything that can be checked before a worker starts, in this process."""
    derived = derive(config, world_size)
    builders.check(config)
    check_layout(config, derived)
    if config.model.init_from:
        with torch.device("meta"):
            check_weights(config.model.init_from, builders.build_model(config))
    check_devices(config.job.device, per_node)


def check_devices(choice: str, per_node: int, *, gpus: int | None = None) -> None:
    """Before launch: a job on GPUs needs one for each of a node's `per_node` ranks (`gpus`:
    how many this machine shows; CUDA's count by default). `auto` with no GPU is the CPU."""
    gpus = torch.cuda.device_count() if gpus is None else gpus
    if choice == "cuda" and gpus == 0:
        raise ConfigError("job.device = 'cuda' but no GPU is visible; use 'auto' or 'cpu'")
    if choice != "cpu" and 0 < gpus < per_node:
        shown = "1 GPU is visible" if gpus == 1 else f"{gpus} GPUs are visible"
        raise ConfigError(
            f"--nproc {per_node} ranks on this node but {shown} (one rank per GPU): "
            f"use --nproc {gpus}, or job.device = 'cpu' to train on the CPU"
        )


def _preempted_summary(config: JobConfig, *, since: float) -> TrainSummary | None:
    """The summary rank 0 wrote when it stopped on SIGTERM during this launch, if it did."""
    from shardwise.trainer.loop import TrainSummary

    path = config.run_dir / "summary.json"
    if not path.exists() or path.stat().st_mtime < since:
        return None
    data = json.loads(path.read_text())
    return TrainSummary(**data) if data.get("preempted") else None


def resume_point(config: JobConfig, resume: str) -> str | None:
    """The checkpoint to start from, or None for a fresh start; refuses to overwrite a run. The
    checkpoint directory must take a write (checked now, not at the first save an hour in)."""
    wrong = probe_writable(config.checkpoint_dir)
    if wrong is not None:
        raise ConfigError(
            f"checkpoint.dir = {config.checkpoint_dir!r}: {wrong}; check the path or URL, and "
            "for object stores the credentials and endpoint (AWS_ACCESS_KEY_ID, "
            "AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL)"
        )
    found = complete_checkpoints(config.checkpoint_dir)
    if resume == "never":
        if found:
            raise ConfigError(
                f"{config.checkpoint_dir} already holds checkpoints of an earlier run (newest: "
                f"{name_of(found[-1])}); pass --resume auto to continue it, or set job.run_dir "
                "to start a new run"
            )
        return None
    if resume == "auto":
        newest = _newest_good(config)
        if newest is not None:
            check_model(newest, config)
        return newest
    path = resume
    if not is_complete(path):
        raise ConfigError(
            f"--resume {resume}: not a complete checkpoint (expected a step_NNNNNNNN directory "
            f"with {MANIFEST}); use --resume auto to pick the newest one"
        )
    wrong = problem(path)
    if wrong is not None:
        raise ConfigError(
            f"--resume {resume}: {wrong}; use --resume auto to pick the newest good checkpoint"
        )
    check_metadata(path)
    check_model(path, config)
    return path


def check_model(path: str, config: JobConfig) -> None:
    """Refuse a checkpoint of another model (another builder, or other arguments) in one line,
    before DCP fails in every rank on the first name it cannot find."""
    saved = read_manifest(path).get("model")
    if not saved:
        return  # an older manifest: DCP's own check remains
    theirs, ours = _model_label(saved), _model_label(shown(config.model))
    if theirs != ours:
        raise ConfigError(
            f"{name_of(path)}: checkpoint is for model {theirs}, this job builds {ours}; resume "
            "with the job that wrote it, or start the new model from its weights "
            "(shardwise export, then model.init_from)"
        )


def _model_label(model: dict[str, Any]) -> str:
    """`cnn(channels=16)`: the builder and its arguments, defaults filled in where the builder
    can be found, so a default written out and one left out are the same model."""
    name, args = str(model.get("name")), dict(model.get("args") or {})
    try:
        builder = builders.resolve(name, builders.MODELS, "model.name")
        bound = inspect.signature(builder).bind_partial(**args)
        bound.apply_defaults()
        args = {k: v for k, v in bound.arguments.items() if not k.startswith("_")}
    except (ConfigError, TypeError, ValueError):
        pass  # compare as written
    return f"{name}({', '.join(f'{k}={v!r}' for k, v in sorted(args.items()))})"


def _newest_good(config: JobConfig) -> str | None:
    """The newest checkpoint whose files match its manifest; a warning names each one skipped."""
    path, skipped = newest_good(config.checkpoint_dir)
    for message in skipped:
        warnings.warn(
            f"{message}; resuming from {name_of(path) if path else 'the start'}", stacklevel=3
        )
    if path is not None:
        check_metadata(path)
    return path


def run_worker(
    config_data: dict[str, Any],
    resume: str | None,
    dry_run: bool = False,
    decided: bool = True,
    store_host: str | None = None,
) -> TrainSummary | None:
    """What every rank runs: join the process group on the right device, agree where to start,
    train, leave cleanly. `resume` is the checkpoint the launcher chose (`decided`), or, under
    torchrun/Slurm, the user's `--resume` request, which rank 0 resolves for everyone.
    `store_host`: shardwise's own launcher has rank 0 host the workers' store on that address
    only (loopback on one machine; "" for the address the agent gives, across machines)."""
    with redacting_output():  # what this rank prints, as the CLI does (redact.py)
        env = detect()
        assert env is not None, "run_worker runs under torch elastic or Slurm"
        config = JobConfig.model_validate(config_data)
        device = pick_device(config.job.device, local_rank=env.local_rank)
        threads = config.job.threads_per_rank or max(1, visible_cpus() // env.local_world_size)
        torch.set_num_threads(threads)
        # A backstop: the watchdog names a hang after fault.timeout_s, before gloo/NCCL give up.
        timeout = timedelta(seconds=config.fault.timeout_s + 60)
        _join(env, "nccl" if device.type == "cuda" else "gloo", timeout, store_host=store_host)
        from shardwise.trainer import loop  # here: the launching process never needs the trainer

        try:
            if dry_run:
                loop.dry_run(config, device)
                return None
            restarts = _agreed_restarts(env.restart_count)
            if restarts or not decided:
                resume = _decided_by_rank_0(lambda: _start_point(config, resume, restarts, decided))
            return loop.train(
                config, device=device, resume=resume, restarts=restarts, node=env.node
            )
        finally:
            # Free DDP's reducer (which holds the process group) while the group is still
            # registered: if the group's last reference died inside the reducer's destructor,
            # gloo's destructor would run holding the GIL while its worker thread waits for the
            # GIL (pytorch#56297).
            gc.collect()
            dist.destroy_process_group()


def _join(env: WorkerEnv, backend: str, timeout: timedelta, *, store_host: str | None) -> None:
    """Join the job's process group."""
    if env.restart_count and env.agent_store:
        # Under torchrun, after a restart the agent's store still holds the previous attempt's
        # addresses and gloo would dial the dead workers: give every attempt its own key space.
        # (shardwise's own launcher gives every attempt a new store: see _fresh_worker_store.)
        store: Store = PrefixStore(
            f"shardwise/attempt_{env.restart_count}/",
            TCPStore(env.master_addr, env.master_port, env.world_size, False, timeout=timeout),
        )
    elif store_host is not None:  # shardwise's launcher: rank 0's store, on that address only
        store = worker_store(
            rank=env.rank,
            world_size=env.world_size,
            host=store_host or env.master_addr,
            port=env.master_port,
            timeout=timeout,
        )
    else:  # torchrun, srun: as they set it up
        dist.init_process_group(
            backend,
            init_method=env.init_method,
            rank=env.rank,
            world_size=env.world_size,
            timeout=timeout,
        )
        return
    dist.init_process_group(
        backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout
    )


def _agreed_restarts(mine: int) -> int:
    """How many times the group has been restarted, as every rank agrees. Each node's agent
    counts only the restarts its own workers' failures caused, so after one node's workers fail
    the other nodes' workers start again with a count of 0: take the largest."""
    counts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(counts, mine)
    return int(max(counts))


def _start_point(config: JobConfig, resume: str | None, restarts: int, decided: bool) -> str | None:
    """The checkpoint to start from: after a restart the newest good one (the warnings name any
    skipped), else what the launcher chose or what the `--resume` request resolves to."""
    if restarts and (newest := _newest_good(config)):
        return newest
    return resume if decided else resume_point(config, resume or "never")


def _decided_by_rank_0(decide: Callable[[], str | None]) -> str | None:
    """What `decide` returns (or raises, for a ConfigError) on rank 0, on every rank: one look at
    the checkpoints, one set of warnings, the same answer everywhere."""
    outcome: list[str | ConfigError | None] = [None]
    if dist.get_rank() == 0:
        try:
            outcome[0] = decide()
        except ConfigError as e:
            outcome[0] = e
    dist.broadcast_object_list(outcome, src=0)
    if isinstance(outcome[0], ConfigError):
        raise outcome[0]
    return outcome[0]


def pick_device(choice: str, *, local_rank: int) -> torch.device:
    """`auto`: this rank's GPU when CUDA is present, else the CPU."""
    check_devices(choice, local_rank + 1)  # also where the launcher is not shardwise's
    if choice == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)
