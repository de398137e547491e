"""`shardwise launch TARGET JOB.toml`: take the same job file to a cluster. Targets: `slurm`
(launch/slurm.py). The checks every target shares are in launch/targets.py."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shardwise.config import ConfigError, load_config
from shardwise.launch.targets import Target, check_target

TARGETS = ("slurm",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", choices=TARGETS, help="where the job runs")
    parser.add_argument("job", help="the job's TOML file")
    parser.add_argument("--nodes", type=int, default=1, help="machines (default 1)")
    ranks = parser.add_mutually_exclusive_group()
    ranks.add_argument(
        "--gpus-per-node", type=int, metavar="G", help="GPUs per node: one rank on each"
    )
    ranks.add_argument(
        "--nproc-per-node", type=int, metavar="P", help="ranks per node on CPUs (default 1)"
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a job-file value (repeatable); passed to every node",
    )
    parser.add_argument(
        "--shared-storage",
        action="store_true",
        help="the checkpoint and run directories are on storage every node mounts, although "
        "their filesystem does not look shared (it is not NFS, Lustre, GPFS, …)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print what would be submitted")
    parser.add_argument("--submit", action="store_true", help="submit it (sbatch)")
    slurm = parser.add_argument_group("slurm")
    slurm.add_argument("--time", help="the time limit, e.g. 04:00:00")
    slurm.add_argument("--partition")
    slurm.add_argument("--account")
    slurm.add_argument("--cpus-per-node", type=int, metavar="C", help="CPUs for each node's task")
    slurm.add_argument(
        "--sbatch",
        dest="sbatch_lines",
        action="append",
        default=[],
        metavar="OPTION",
        help="another #SBATCH option, e.g. qos=high or constraint=a100 (repeatable)",
    )
    slurm.add_argument(
        "--port",
        type=int,
        help="rendezvous port on the first node (default 20000 + job id % 20000)",
    )
    slurm.add_argument(
        "--signal-seconds",
        type=int,
        default=120,
        metavar="S",
        help="SIGTERM this long before the time limit, to save and requeue (default 120)",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks for every error")


def target_of(args: argparse.Namespace) -> Target:
    for flag in ("nodes", "gpus_per_node", "nproc_per_node", "cpus_per_node"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} {value}: need at least 1")
    if args.port is not None and not 0 < args.port < 65536:
        raise ConfigError(f"--port {args.port}: a port is 1–65535")
    if args.signal_seconds < 10:
        raise ConfigError(
            f"--signal-seconds {args.signal_seconds}: give the ranks at least 10 s to save"
        )
    job = Path(args.job).absolute()
    config = load_config(job, args.overrides)
    per_node = args.gpus_per_node or args.nproc_per_node or 1
    return Target(job, config, tuple(args.overrides), args.nodes, per_node, args.gpus_per_node or 0)


def run(args: argparse.Namespace) -> int:
    from shardwise.launch import slurm

    target = target_of(args)
    check_target(target, shared_storage=args.shared_storage)
    options = slurm.SlurmOptions(
        time=args.time,
        partition=args.partition,
        account=args.account,
        cpus_per_node=args.cpus_per_node,
        extra=tuple(args.sbatch_lines),
        port=args.port,
        signal_seconds=args.signal_seconds,
    )
    script = slurm.sbatch_script(target, options)  # checks the extra lines too
    if args.dry_run:
        print(f"# would write {slurm.script_path(target)} and sbatch it:")
        print(script, end="")
        return 0
    if args.submit:
        slurm.check_cluster(target, options)
    path = slurm.write_script(target, options)
    if not args.submit:
        print(f"wrote {path}; submit it with: sbatch {path}")
        return 0
    job_id = slurm.submit(path)
    print(f"submitted Slurm job {job_id}: {path}", file=sys.stderr)
    print(job_id)
    return 0
