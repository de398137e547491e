"""`shardwise launch slurm JOB.toml`: an sbatch script that runs the job on a Slurm allocation with
Slurm's own machinery, and (`--submit`) its submission.

The script asks for `--nodes` nodes with one task each; `srun` starts one shardwise agent per node
(`shardwise train --nproc P --nnodes N`), and the agents meet at a c10d rendezvous on the
allocation's first node, whose address `scontrol` gives (port: 20000 + job id mod 20000, or
`--port`). Each agent starts and restarts its node's ranks as on one machine (`fault.
max_restarts`), so checkpoints must be on storage every node sees.

Preemption and time limits: the script asks Slurm for SIGTERM `--signal-seconds` before the time
limit (`--signal=B:TERM@S`, to the batch shell) and forwards it to the job's steps (`scancel
--signal=TERM`; srun, signalled itself, would cancel its step). The agents' ranks save at the
next step boundary and stop; the script then requeues the job (`#SBATCH --requeue`), and every
attempt starts with `--resume auto`, so it continues from that checkpoint. `scontrol requeue` of
a running job does the same (Slurm sends the SIGTERM itself, `KillWait` seconds before
SIGKILL). Output from every attempt goes to one file (`--open-mode=append`) in the run's
`launch/` directory.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from shardwise.common.errors import ConfigError
from shardwise.training.launch.targets import Target

SCRIPT = "slurm.sbatch"


@dataclass(frozen=True)
class SlurmOptions:
    time: str | None = None
    """`--time` (e.g. 04:00:00); None: the partition's default."""
    partition: str | None = None
    account: str | None = None
    cpus_per_node: int | None = None
    """`--cpus-per-task` of the one task (the agent and its ranks) per node."""
    extra: tuple[str, ...] = ()
    """More `#SBATCH` options, passed through as given (`--qos=high`, `--constraint=a100`)."""
    port: int | None = None
    """The rendezvous port on the first node; None: 20000 + job id mod 20000."""
    signal_seconds: int = 120
    """How long before the time limit Slurm sends SIGTERM (the ranks need one step and a save)."""


def script_path(target: Target) -> Path:
    return target.config.run_dir.absolute() / "launch" / SCRIPT


def sbatch_script(target: Target, options: SlurmOptions, shardwise: str | None = None) -> str:
    """The batch script for `target` (see the module docstring)."""
    shardwise = shardwise or str(Path(sys.executable).with_name("shardwise"))
    config = target.config
    logs = target.config.run_dir.absolute() / "launch"
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={config.job.name}",
        f"#SBATCH --nodes={target.nodes}",
        "#SBATCH --ntasks-per-node=1",
    ]
    if options.cpus_per_node:
        lines.append(f"#SBATCH --cpus-per-task={options.cpus_per_node}")
    if target.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={target.gpus_per_node}")
    for flag, value in (
        ("time", options.time),
        ("partition", options.partition),
        ("account", options.account),
    ):
        if value:
            lines.append(f"#SBATCH --{flag}={value}")
    lines += [
        "#SBATCH --requeue",
        f"#SBATCH --signal=B:TERM@{options.signal_seconds}",
        "#SBATCH --open-mode=append",
        f"#SBATCH --output={logs}/slurm-%j.out",
        f"#SBATCH --chdir={Path.cwd()}",
        *(f"#SBATCH {_option(line)}" for line in options.extra),
        "# Written by `shardwise launch slurm`: one shardwise agent per node, which starts that",
        "# node's ranks; every attempt resumes from the newest good checkpoint.",
        "set -u",
    ]
    train = [shardwise, "train", str(target.job), "--nproc", str(target.per_node)]
    if target.nodes > 1:
        lines += [
            'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            "addr=$(scontrol show node \"$head\" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)",
            f"port={options.port or '$((20000 + SLURM_JOB_ID % 20000))'}",
        ]
        train += ["--nnodes", str(target.nodes)]
        rendezvous = ' --rdzv-endpoint "$addr:$port" --rdzv-id "slurm-$SLURM_JOB_ID"'
    else:
        rendezvous = ""
    train += ["--resume", "auto"]
    for item in target.overrides:
        train += ["--set", item]
    command = " ".join(shlex.quote(part) for part in train) + rendezvous
    lines += [
        'echo "shardwise: job $SLURM_JOB_ID, attempt $((${SLURM_RESTART_COUNT:-0} + 1)), on '
        '$SLURM_JOB_NODELIST"',
        f"srun --ntasks-per-node=1 --kill-on-bad-exit=1 {command} &",
        "step=$!",
        "preempted=0",
        "# Slurm's warning before the time limit (or a requeue): the ranks save and stop. The",
        "# signal goes to the job's steps (srun would cancel its step if signalled itself), in",
        "# the background and only until the step ends: while Slurm requeues or cancels the",
        "# job, scancel retries for longer than Slurm waits before it kills this script, and",
        "# would signal the next attempt.",
        "forwarding=",
        "trap 'preempted=1; scancel --signal=TERM \"$SLURM_JOB_ID\" & forwarding=$!' TERM",
        'wait "$step"; status=$?',
        'while kill -0 "$step" 2>/dev/null; do wait "$step"; status=$?; done',
        "# The step has ended: a later SIGTERM (Slurm sends one when it requeues the job, as the",
        "# requeue below asks) has nothing to forward to, and a forwarder started then would",
        "# outlive this script and signal the next attempt.",
        "trap '' TERM",
        '[ -n "$forwarding" ] && kill "$forwarding" 2>/dev/null',
        'if [ "$preempted" = 1 ]; then',
        '    echo "shardwise: stopped by SIGTERM at a checkpoint; requeueing job $SLURM_JOB_ID"',
        '    scontrol requeue "$SLURM_JOB_ID" || true',
        "    exit 0",
        "fi",
        'exit "$status"',
    ]
    return "\n".join(lines) + "\n"


def _option(line: str) -> str:
    """An extra `#SBATCH` option: `qos=high`, `--qos=high` or `#SBATCH --qos=high`; one line."""
    option = line.strip().removeprefix("#SBATCH").strip()
    if option and not option.startswith("-"):
        option = "--" + option
    if "\n" in line or not re.fullmatch(r"--?[A-Za-z][\w-]*(?:[= ]\S.*)?", option):
        raise ConfigError(
            f"--sbatch {line!r}: expected one sbatch option such as qos=high or constraint=a100"
        )
    return option


def write_script(target: Target, options: SlurmOptions) -> Path:
    path = script_path(target)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(sbatch_script(target, options))
    path.chmod(0o755)
    return path


def check_cluster(target: Target, options: SlurmOptions) -> None:
    """Before `sbatch`: Slurm's commands are here, and a GPU job's partition has GPUs."""
    if shutil.which("sbatch") is None:
        raise ConfigError(
            "sbatch not found: run `shardwise launch slurm` on a Slurm login node, or without "
            "--submit to write the script only"
        )
    if target.gpus_per_node:
        query = ["sinfo", "--noheader", "--format=%G"]
        if options.partition:
            query += ["--partition", options.partition]
        listed = _run(query)
        if "gpu" not in listed:
            where = f"partition {options.partition}" if options.partition else "this cluster"
            raise ConfigError(
                f"--gpus-per-node {target.gpus_per_node}: {where} has no GPUs (sinfo shows "
                f"GRES {listed.split()[0] if listed.split() else '(null)'}); choose a GPU "
                "partition with --partition, or run on CPUs with --nproc-per-node"
            )


def submit(path: Path) -> str:
    """`sbatch` the script; Slurm's job id."""
    out = _run(["sbatch", "--parsable", str(path)])
    match = re.match(r"(\d+)", out.strip())
    if match is None:
        raise ConfigError(f"sbatch printed no job id: {out.strip()[:200]!r}")
    return match.group(1)


def _run(command: list[str]) -> str:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"{command[0]} did not answer in 60 s: is slurmctld up?") from None
    if done.returncode != 0:
        reason = (done.stderr or done.stdout).strip().splitlines()
        raise ConfigError(f"{command[0]} failed: {reason[-1] if reason else done.returncode}")
    return done.stdout
