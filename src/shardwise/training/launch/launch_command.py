"""`shardwise launch TARGET JOB.toml`: take the same job file to a cluster. Targets: `slurm`
(launch/slurm.py), `k8s` (Kubeflow, launch/k8s.py), `ray` (actors, launch/ray_actors.py), `spark`
(barrier tasks, launch/spark_tasks.py). The checks every target shares are in
launch/targets.py; the command's options in launch/launch_arguments.py."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from shardwise.common.errors import ConfigError
from shardwise.training.config.load import load_config
from shardwise.training.launch.targets import Target, check_storage, check_target, unshared

if TYPE_CHECKING:
    from shardwise.training.trainer.train_summary import TrainSummary


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
    target = target_of(args)
    check_target(target)
    if args.target in ("slurm", "k8s") and args.resume != "never":
        raise ConfigError(f"--resume is for ray and spark; {args.target} jobs always resume")
    if args.target in ("ray", "spark"):
        given = [f for f in ("submit", "apply") if getattr(args, f)]
        if given:
            raise ConfigError(
                f"--{given[0]} is not for {args.target}: `shardwise launch {args.target}` runs "
                "the job itself (--dry-run prints what it would run)"
            )
        if not args.shared_storage:
            check_storage(target, lambda location: unshared(location, target.nodes))
    run_on = {"slurm": _slurm, "k8s": _k8s, "ray": _ray, "spark": _spark}[args.target]
    return run_on(args, target)


def _slurm(args: argparse.Namespace, target: Target) -> int:
    from shardwise.training.launch import slurm

    if args.apply:
        raise ConfigError("--apply is for k8s; Slurm jobs are submitted with --submit")
    if not args.shared_storage:
        check_storage(target, lambda location: unshared(location, target.nodes))
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


def _k8s(args: argparse.Namespace, target: Target) -> int:
    from shardwise.training.launch import k8s

    if args.submit:
        raise ConfigError("--submit is for slurm; Kubernetes objects are created with --apply")
    if not args.image:
        raise ConfigError(
            "k8s needs --image IMAGE: a container image with shardwise (and the job's data) in it"
        )
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts {args.max_restarts}: need 0 or more")
    options = k8s.K8sOptions(
        image=args.image,
        namespace=args.namespace,
        api=args.api,
        cpus_per_node=None if args.cpus_per_node is None else str(args.cpus_per_node),
        memory_per_node=args.memory_per_node,
        volumes=tuple(args.volumes),
        max_restarts=args.max_restarts,
    )
    if not args.shared_storage:
        check_storage(
            target, lambda location: k8s.unshared_in_pods(location, target.nodes, options)
        )
    objects = k8s.manifests(target, options)
    if not args.apply:
        print(k8s.to_yaml(objects), end="")
        return 0
    for created in k8s.apply(objects):
        print(f"created {created}")
    return 0


def _ray(args: argparse.Namespace, target: Target) -> int:
    from shardwise.training.checkpoint.resume import resume_point
    from shardwise.training.launch.ray_actors import RayOptions, train_on_ray

    if args.cpus_per_rank <= 0:
        raise ConfigError(f"--cpus-per-rank {args.cpus_per_rank:g}: need more than 0")
    options = RayOptions(args.ray_address, args.placement, args.cpus_per_rank)
    if args.dry_run:
        from shardwise.training.launch.ray_actors import describe

        print(describe(target, options, args.resume))
        return 0
    checkpoint = resume_point(target.config, args.resume)
    return _reported(target, lambda: train_on_ray(target, options, checkpoint))


def _spark(args: argparse.Namespace, target: Target) -> int:
    from shardwise.training.checkpoint.resume import resume_point
    from shardwise.training.launch.spark_tasks import SparkOptions, train_on_spark

    # every attempt of the stage resumes from the newest good checkpoint, the first included,
    # unless a checkpoint other than the newest was asked for
    auto = args.resume in ("auto", "never")
    if args.dry_run:
        from shardwise.training.launch.spark_tasks import describe

        print(describe(target, SparkOptions(args.spark_master), "auto" if auto else args.resume))
        return 0
    chosen = resume_point(target.config, args.resume)  # refuses to overwrite, checks a path
    resume = "auto" if auto else chosen or "auto"
    return _reported(
        target, lambda: train_on_spark(target, SparkOptions(args.spark_master), resume)
    )


def _reported(target: Target, run: Callable[[], TrainSummary | None]) -> int:
    """`run` (the ranks on Ray or Spark, from this process) reported as `shardwise train`
    reports a run on this machine: its outcome with what the ranks left (a hang said as such,
    launch/outcome.py), and the model logged once they are done."""
    from shardwise.training.launch.outcome import WorkerFailed, outcome
    from shardwise.training.run import publish, report_result

    started = time.time()
    try:
        summary = run()
    except WorkerFailed as failure:
        summary = outcome(target.config.run_dir, started, failure=failure)
    return report_result(publish(target.config, summary))
