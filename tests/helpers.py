"""Helpers for tests: small jobs, a multi-process harness, and readers for run outputs."""

from __future__ import annotations

import contextlib
import importlib.util
import multiprocessing as mp
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import polars as pl
import tomli_w
import torch

from shardwise.common.job_files import validate_as
from shardwise.manymodel.config import ManyModelsConfig
from shardwise.training.config.load import validate
from shardwise.training.config.schema import JobConfig
from shardwise.training.launch.forkserver import fork_target, start_method

REPO = Path(__file__).resolve().parents[1]


_SERVER = b"multiprocessing.forkserver"
_COMMAND_SERVER = b"tests/command_server.py"  # the server of the tests' `shardwise` commands
_LONG_LIVED = (b"multiprocessing.resource_tracker", _SERVER, _COMMAND_SERVER)


def children_of(pid: int) -> list[int]:
    """Live children of a process, from /proc, except multiprocessing's resource tracker and
    the ranks' server (one each per parent process, meant to live as long as the parent) and the
    tests' server of `shardwise` commands (command_server.py); the processes those servers forked
    for it (ranks, commands) count as its own."""
    direct, forked = _children(pid)
    return direct + forked


def ranks_of(launcher: int) -> list[int]:
    """The ranks a `shardwise train` process started: its forkserver's children (the launcher
    forks its ranks from one: launch/forkserver/)."""
    return _children(launcher)[1]


def _children(pid: int) -> tuple[list[int], list[int]]:
    """A process's live children that are not long-lived, and those its forkserver forked. A
    `shardwise` command forks its server from itself (launch/forkserver/): a child with the
    parent's own command line is that server."""
    live = {p: int(stat[1]) for p, stat in _stats().items() if stat[0] != "Z"}
    own = _cmdline(pid)
    mine = {p: _cmdline(p) for p, parent in live.items() if parent == pid}
    servers = {
        p
        for p, cmdline in mine.items()
        if _SERVER in cmdline or _COMMAND_SERVER in cmdline or cmdline == own
    }
    direct = [
        p
        for p, cmdline in mine.items()
        if p not in servers and not any(m in cmdline for m in _LONG_LIVED)
    ]
    return direct, [p for p, parent in live.items() if parent in servers]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _stats() -> dict[int, list[str]]:
    """Every live process's /proc/PID/stat fields after its name (state, parent, group,
    session, …)."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                found[int(entry)] = (
                    Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                )
            except OSError:
                continue
    return found


def session_processes(sid: int) -> list[int]:
    """The processes of session `sid` that are not zombies."""
    return [pid for pid, stat in _stats().items() if int(stat[3]) == sid and stat[0] != "Z"]


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it, from /proc."""
    parents = {child: int(stat[1]) for child, stat in _stats().items()}
    found, frontier = [pid], [pid]
    while frontier:
        frontier = [child for child, parent in parents.items() if parent in frontier]
        found += frontier
    return found


def listening_sockets(pid: int) -> list[tuple[str, int, int]]:
    """(address, port, pid) of every TCP socket listening in `pid` and the processes below it,
    read from /proc (what `ss -ltnp` shows), in whichever network namespace each process is."""
    owners: dict[str, int] = {}
    for proc in descendants(pid):
        try:
            for fd in os.listdir(f"/proc/{proc}/fd"):
                link = os.readlink(f"/proc/{proc}/fd/{fd}")
                if link.startswith("socket:["):
                    owners[link[8:-1]] = proc
        except OSError:
            continue
    found = set()
    for proc in set(owners.values()):  # each process's own network namespace
        for table, width in (("tcp", 8), ("tcp6", 32)):
            try:
                lines = Path(f"/proc/{proc}/net/{table}").read_text().splitlines()[1:]
            except OSError:
                continue
            for line in lines:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == "0A" and inode in owners:  # 0A: LISTEN
                    address, port = local.split(":")
                    found.add((_address(address, width), int(port, 16), owners[inode]))
    return sorted(found)


def _address(hexed: str, width: int) -> str:
    """An address as /proc/net/tcp{,6} writes it (little-endian words)."""
    import ipaddress

    raw = bytes.fromhex(hexed)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words if width == 32 else raw[::-1]))


def digits_job(run_dir: Path, **sections: dict[str, Any]) -> JobConfig:
    """A small, fast digits job (MLP, no MLflow) writing into `run_dir`; sections override. Like
    `gpt_job` it records no profiler window (a test of the profile asks for one): reading the
    window's trace back takes a small run longer than its training."""
    raw: dict[str, Any] = {
        "job": {"name": "test", "run_dir": str(run_dir), "seed": 0},
        "model": {"name": "mlp", "args": {"hidden": 32}},
        "data": {"name": "digits"},
        "train": {"steps": 20, "global_batch": 32, "lr": 1e-2, "warmup_steps": 2},
        "tracking": {"mlflow": False, "log_every": 1, "report": False, "profile_step": 0},
    }
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return validate(raw)


def gpt_job(run_dir: Path, **sections: dict[str, Any]) -> JobConfig:
    """A tiny GPT with dropout on a slice of the stdlib corpus (40 steps cross an epoch)."""
    raw: dict[str, Any] = {
        "job": {"name": "gpt-test", "run_dir": str(run_dir), "seed": 3},
        "model": {
            "name": "gpt",
            "args": {"layers": 1, "heads": 2, "hidden": 32, "seq_len": 32, "dropout": 0.1},
        },
        "data": {"name": "text", "args": {"seq_len": 32, "max_bytes": 20_000}},
        "train": {"steps": 40, "global_batch": 16, "micro_batch": 4, "lr": 3e-3},
        "eval": {"max_samples": 64},
        "tracking": {"mlflow": False, "log_every": 1, "report": False, "profile_step": 0},
    }
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return validate(raw)


def load_params(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    """The model parameters of a shardwise checkpoint (a path or an fsspec URL), consolidated in
    this process."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    with warnings.catch_warnings():  # "no process group: loading in a single process", as meant
        warnings.simplefilter("ignore", UserWarning)
        state = _load_state_dict_from_keys(keys={"model"}, checkpoint_id=str(checkpoint))
    return dict(state["model"])


def losses(run_dir: Path) -> dict[int, float]:
    from shardwise.training.tracking.metrics import read_metrics

    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r}


def outcome(runs: dict[str, Any], name: str, step: int) -> tuple[dict[int, float], dict]:
    """A run of a shared-worker fixture (`{"root": dir, "failures": {name: traceback}}`): its
    losses by step and the model state of its checkpoint at `step`; fails the test with the
    run's traceback if it failed."""
    import pytest

    if name in runs["failures"]:
        pytest.fail(f"{name} failed:\n{runs['failures'][name]}")
    run_dir = runs["root"] / name
    return losses(run_dir), load_params(run_dir / "checkpoints" / f"step_{step:08d}")


def assert_same_training(
    got: tuple[dict[int, float], dict],
    want: tuple[dict[int, float], dict],
    steps: range,
    *,
    loss_rtol: float = 1e-5,
    param_atol: float = 2e-5,
) -> None:
    """The same losses at `steps` (relative tolerance) and the same parameters and buffers
    (absolute): layouts add in different orders, so fp32 results differ in the last bits."""
    import pytest

    got_losses, got_state = got
    want_losses, want_state = want
    assert [got_losses[s] for s in steps] == pytest.approx(
        [want_losses[s] for s in steps], rel=loss_rtol
    )
    assert got_state.keys() == want_state.keys()
    for name, value in want_state.items():
        torch.testing.assert_close(got_state[name], value, rtol=0, atol=param_atol, msg=name)


def assert_bitwise_same_run(got: Path, want: Path, steps: int) -> None:
    """Two runs' directories: the same loss at every step and the same parameters at the end,
    bit for bit."""
    want_losses, got_losses = losses(want), losses(got)
    assert [got_losses[s] for s in range(1, steps + 1)] == [
        want_losses[s] for s in range(1, steps + 1)
    ]
    final = f"checkpoints/step_{steps:08d}"
    want_params, got_params = load_params(want / final), load_params(got / final)
    assert got_params.keys() == want_params.keys()
    for name, value in want_params.items():
        assert torch.equal(got_params[name], value), name


SHARDWISE = str(Path(sys.executable).parent / "shardwise")
"""The `shardwise` command of this virtualenv."""


def write_job(config: JobConfig, job: Path) -> Path:
    """`config` as a job file a user would write, at `job`."""
    job.write_text(tomli_w.dumps(config.model_dump(mode="json", exclude_none=True)))
    return job


def launch_on_two_nodes(
    target: str,
    config: JobConfig,
    job: Path,
    *flags: str,
    env: dict[str, str],
    listening: dict[tuple[str, int], str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """`shardwise launch TARGET` of `config` (written to `job`) on two nodes of one rank each,
    their storage shared, from the repository as a user runs it. With `listening`, every socket
    that listens in the launch or a process below it at any time while it runs goes into it:
    (address, port) -> the command line of its process."""
    args = ["launch", target, str(write_job(config, job))]
    args += ["--nodes", "2", "--nproc-per-node", "1", "--shared-storage", *flags]
    if listening is None:
        return shardwise_command(*args, env=env, timeout=300)
    return run_listening([SHARDWISE, *args], listening, env=env, timeout=300)


def run_listening(
    command: list[str],
    listening: dict[tuple[str, int], str],
    *,
    env: dict[str, str],
    timeout: float,
) -> subprocess.CompletedProcess[str]:
    """`command` run to its end (as subprocess.run with captured output), while every socket
    that listens in it or a process below it is recorded in `listening` (read from /proc every
    0.2 s: what `ss -ltnp` shows), with its process's command line."""
    import threading

    process = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    outputs: list[str] = []
    reader = threading.Thread(target=lambda: outputs.extend(process.communicate()), daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    while reader.is_alive() and time.monotonic() < deadline:
        for address, port, pid in listening_sockets(process.pid):
            if (address, port) not in listening:
                with contextlib.suppress(OSError):
                    listening[address, port] = (
                        Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
                    )
        reader.join(0.2)
    if reader.is_alive():
        process.kill()
        reader.join()
        raise subprocess.TimeoutExpired(command, timeout, *outputs)
    return subprocess.CompletedProcess(command, process.returncode, *outputs)


def not_on_loopback(addresses: Iterable[tuple[str, int]]) -> list[tuple[str, int]]:
    """The (address, port)s of `addresses` that listen on an address other than loopback."""
    import ipaddress

    found = []
    for address, port in addresses:
        ip = ipaddress.ip_address(address)
        mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1
        if not (ip.is_loopback or (mapped is not None and mapped.is_loopback)):
            found.append((address, port))
    return found


def kill_session(sid: int) -> None:
    """SIGKILL whatever is left of a process session, and wait until it is gone."""
    import contextlib
    import signal
    import time

    deadline = time.monotonic() + 30
    while (left := session_processes(sid)) and time.monotonic() < deadline:
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
    assert not session_processes(sid), f"processes of session {sid} survived"


def free_port() -> int:
    """A port that was free a moment ago (for launchers that need one up front, like srun)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_distributed(
    fn: Callable[..., Any], nproc: int, *args: Any, timeout: float = 120
) -> list[Any]:
    """Run `fn(*args)` in `nproc` processes joined in one gloo process group through a file
    rendezvous (no ports); return each rank's result, or raise with the failing rank's traceback.
    The processes start as shardwise's launcher starts its ranks (forked from a server that has
    imported the trainer: launch/forkserver/)."""
    ctx = mp.get_context(start_method())
    results: Any = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = []
        for rank in range(nproc):
            target, target_args = fork_target(_entry, (fn, rank, nproc, store, results, args))
            procs.append(ctx.Process(target=target, args=target_args))
        for p in procs:
            p.start()
        try:
            collected = {}
            for _ in procs:
                rank, ok, value = results.get(timeout=timeout)
                if not ok:
                    raise AssertionError(f"rank {rank} failed:\n{value}")
                collected[rank] = value
            return [collected[r] for r in range(nproc)]
        except queue.Empty:
            raise AssertionError(f"ranks did not finish within {timeout}s") from None
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
                    p.join()


def train_in_workers(
    nproc: int, jobs: list[tuple[str, dict[str, Any], str | None]], timeout: float = 900
) -> dict[str, str]:
    """Train each `(name, config as JSON, resume)` in turn in one set of `nproc` workers (the
    start-up cost is paid once); returns the traceback of every job that failed, by name."""
    per_rank = run_distributed(_train_each, nproc, jobs, timeout=timeout)
    return {name: tb for failures in per_rank for name, tb in failures.items()}


def _train_each(jobs: list[tuple[str, dict[str, Any], str | None]]) -> dict[str, str]:
    """In every rank: train each job in turn; a failure is recorded and the next job runs."""
    from shardwise.training.config.schema import JobConfig
    from shardwise.training.trainer.loop import train

    failures = {}
    for name, config, resume in jobs:
        try:
            train(JobConfig.model_validate(config), device=torch.device("cpu"), resume=resume)
        except Exception:
            failures[name] = traceback.format_exc()
    return failures


def _entry(fn, rank, world_size, store, results, args):  # runs in each started process
    import gc

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        results.put((rank, True, fn(*args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        gc.collect()
        dist.destroy_process_group()


SHOPS = [
    ("CA", "north", "s1"), ("CA", "north", "s2"), ("CA", "south", "s3"),
    ("NY", "east", "s4"), ("NY", "east", "s5"), ("NY", "west", "s6"),
]  # fmt: skip
HIERARCHY_LEVELS = [["state"], ["state", "region"]]


def hierarchical_job(tmp_path, *, months: int = 60, **sections) -> ManyModelsConfig:
    """Six shops in four regions of two states, monthly, as a many-models job with the
    hierarchy state > region > shop."""
    rng = np.random.default_rng(1)
    rows = []
    for k, (state, region, shop) in enumerate(SHOPS):
        t = np.arange(months)
        y = 20 + 3 * k + 0.2 * t + 4 * np.sin(2 * np.pi * t / 12 + k) + rng.normal(0, 1, months)
        rows += [
            (state, region, shop, f"{2015 + i // 12}-{i % 12 + 1:02d}-01", float(v))
            for i, v in enumerate(y)
        ]
    path = tmp_path / "shops.csv"
    columns = ["state", "region", "shop", "month", "units"]
    pl.DataFrame(rows, orient="row", schema=columns).write_csv(path)
    raw = {
        "job": {"run_dir": str(tmp_path / "run")},
        "data": {"source": str(path), "id_columns": ["state", "region", "shop"],
                 "timestamp": "month", "target": "units"},
        "models": {"names": ["seasonal_naive", "ridge"]},
        "backtest": {"horizon": 6, "n_windows": 2},
        "hierarchy": {"levels": HIERARCHY_LEVELS},
        "tracking": {"mlflow": False},
    }  # fmt: skip
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    return validate_as(ManyModelsConfig, raw)


def docs_generator() -> ModuleType:
    """docs/generate_configuration.py, imported as a module (docs/ is not a package): the
    configuration reference's generator, and the heading anchors GitHub gives a page."""
    path = Path(__file__).resolve().parents[1] / "docs" / "generate_configuration.py"
    spec = importlib.util.spec_from_file_location("generate_configuration", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def mlflow_server(root: Path) -> Iterator[int]:
    """A real `mlflow server` on a free loopback port (yielded), its store and artifacts under
    `root`; stopped, with its workers, when the block ends. Without MLflow's job execution (its
    server's own background jobs, which no test uses): it started a job runner and seven Huey
    consumers per server, 100 CPU-s of the whole suite's run on the slower machine."""
    port = free_port()
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1",
         "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{root / 'store.db'}",
         "--artifacts-destination", str(root / "artifacts")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
        start_new_session=True, env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, "no MLflow server"
                time.sleep(0.5)
        yield port
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)


def shardwise_process(
    *args: str,
    env: dict[str, str] | None = None,
    stdout: Any = None,
    stderr: Any = None,
    netns: str | None = None,
    fresh: bool = False,
) -> Any:
    """`shardwise ARGS` started as `subprocess.Popen` starts it (text streams; stdin
    /dev/null), from the repository, with `env` added to this process's environment; in the
    network namespace `netns` as `ip netns exec` runs it. Forked from the worker's server of
    commands (command_server.py), which has imported torch and the launcher, where the
    environment allows (a command_server.Forked: what the tests use of Popen); with `fresh`, or
    where it does not, the console script in a new interpreter."""
    import command_server

    environment = {**os.environ, **(env or {})}
    command = [SHARDWISE, *args]
    if not fresh:
        forked = command_server.start(
            command, env=environment, cwd=REPO, stdout=stdout, stderr=stderr, netns=netns
        )
        if forked is not None:
            return forked
    if netns is not None:
        command = ["ip", "netns", "exec", netns, *command]
    return subprocess.Popen(
        command, cwd=REPO, env=environment, stdin=subprocess.DEVNULL, stdout=stdout,
        stderr=stderr, text=True,
    )  # fmt: skip


def shardwise_command(
    *args: str, env: dict[str, str] | None = None, timeout: float = 600, fresh: bool = False
) -> subprocess.CompletedProcess[str]:
    """`shardwise ARGS` as a user runs it (as `subprocess.run` with captured output), started
    as `shardwise_process` starts it."""
    import command_server

    pipe = subprocess.PIPE
    process = shardwise_process(*args, env=env, stdout=pipe, stderr=pipe, fresh=fresh)
    return command_server.completed(process, timeout)
