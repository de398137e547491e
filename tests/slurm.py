"""A real Slurm cluster on this machine for a test: munged with a fresh key, slurmctld and one
slurmd per node (Debian's packages), every daemon on a free port of loopback, all state under a
temp directory, and everything stopped (jobs cancelled first) when the test ends."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")


def missing() -> str | None:
    """Why no cluster can be started here, or None."""
    absent = [d for d in (*DAEMONS, "sbatch", "scontrol") if shutil.which(d) is None]
    if absent:
        return f"Slurm is not installed ({', '.join(absent)} missing; make install adds them)"
    if os.geteuid() != 0:
        return "Slurm's daemons are started as root here, and this is not root"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Slurm:
    root: Path
    env: dict[str, str]
    """The environment for Slurm's commands (SLURM_CONF) and what sbatch passes to jobs."""

    def run(self, *command: str, check: bool = True) -> str:
        done = subprocess.run(
            command, env=self.env, capture_output=True, text=True, timeout=60, check=False
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip()}")
        return done.stdout

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job`'s fields."""
        out = self.run("scontrol", "--oneliner", "show", "job", job_id)
        return dict(field.split("=", 1) for field in out.split() if "=" in field)

    def controller_log(self, job_id: str, lines: int = 60) -> str:
        """The last `lines` lines of slurmctld's log about job `job_id` (why it was signalled,
        requeued, started or ended), for a failing test's message."""
        log = self.root / "log" / "slurmctld.log"
        mine = [
            line
            for line in log.read_text(errors="replace").splitlines()
            if f"JobId={job_id} " in line or f"JobId={job_id}\n" in line + "\n"
            or f"job {job_id}" in line or f"StepId={job_id}." in line
        ]  # fmt: skip
        return "\n".join(mine[-lines:])

    def wait(self, job_id: str, states: set[str], timeout: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if job.get("JobState") in states:
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} is {job.get('JobState')}, not {states}")
            time.sleep(0.5)


@contextlib.contextmanager
def cluster(root: Path, nodes: int = 2, cpus: int = 1) -> Iterator[Slurm]:
    """`nodes` Slurm nodes of `cpus` CPUs each on this machine, in one partition."""
    for name in ("munge", "state", "spool", "log"):
        (root / name).mkdir(parents=True)
    os.chmod(root / "munge", 0o700)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    socket_path = root / "munge" / "socket"
    host = socket.gethostname()
    conf = root / "slurm.conf"
    conf.write_text(
        "\n".join(
            [
                "ClusterName=shardwise-test",
                f"SlurmctldHost={host}(127.0.0.1)",
                f"SlurmctldPort={_free_port()}",
                f"SlurmdPort={_free_port()}",
                "AuthType=auth/munge",
                "CredType=cred/munge",
                # a requeued job may start again once its credential has expired (Slurm holds
                # it back that long: 120 s by default); forcing it earlier fails its launch
                f"AuthInfo=socket={socket_path},cred_expire=10",
                "SlurmUser=root",
                "SlurmdUser=root",
                f"StateSaveLocation={root / 'state'}",
                f"SlurmdSpoolDir={root / 'spool'}/%n",
                f"SlurmctldPidFile={root / 'slurmctld.pid'}",
                f"SlurmdPidFile={root / 'slurmd'}-%n.pid",
                f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
                f"SlurmdLogFile={root / 'log'}/slurmd-%n.log",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_Core",
                "ReturnToService=2",
                "MpiDefault=none",
                "JobAcctGatherType=jobacct_gather/none",
                "AccountingStorageType=accounting_storage/none",
                "KillWait=30",
                # a pending job starts within a second or two of becoming eligible (Slurm's
                # scheduling passes otherwise come every 30 s (backfill) and 60 s (main))
                "SchedulerParameters=bf_interval=1,sched_interval=2",
                "MinJobAge=600",
                *(
                    f"NodeName=n{i} NodeHostname={host} NodeAddr=127.0.0.1 "
                    f"Port={_free_port()} CPUs={cpus} State=UNKNOWN"
                    for i in range(1, nodes + 1)
                ),
                "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
            ]
        )
        + "\n"
    )
    env = {**os.environ, "SLURM_CONF": str(conf)}
    daemons: list[subprocess.Popen[bytes]] = []
    slurm = Slurm(root, env)

    def start(*command: str) -> None:
        log = open(root / "log" / f"{Path(command[0]).name}-{len(daemons)}.out", "wb")  # noqa: SIM115
        daemons.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))

    try:
        start(
            "munged", "--foreground", "--force", f"--key-file={key}", f"--socket={socket_path}",
            f"--pid-file={root / 'munge' / 'pid'}", f"--seed-file={root / 'munge' / 'seed'}",
            f"--log-file={root / 'log' / 'munged.log'}",
        )  # fmt: skip
        _wait_for(lambda: socket_path.exists(), "munged's socket", 20)
        start("slurmctld", "-D", "-c", "-i", "-f", str(conf))
        for i in range(1, nodes + 1):
            start("slurmd", "-D", "-f", str(conf), "-N", f"n{i}")
        _wait_for(lambda: _idle(slurm) == nodes, f"{nodes} idle Slurm nodes", 60)
        yield slurm
    finally:
        with contextlib.suppress(Exception):
            slurm.run("scancel", "--full", "--user=root", check=False)
            _wait_for(lambda: not slurm.run("squeue", "--noheader").strip(), "no jobs", 60)
        for daemon in reversed(daemons):
            daemon.terminate()
        for daemon in reversed(daemons):
            try:
                daemon.wait(timeout=20)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()


def _idle(slurm: Slurm) -> int:
    try:
        out = slurm.run("sinfo", "--noheader", "--Node", "--format=%T", check=False)
    except subprocess.TimeoutExpired:
        return 0
    return sum(line.strip() == "idle" for line in out.splitlines())


def _wait_for(ready: object, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ready():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not ready after {timeout:.0f} s")
        time.sleep(0.2)
