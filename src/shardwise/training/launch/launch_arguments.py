"""The options of `shardwise launch` (launch_command.py runs it): those every target reads,
then each target's own. A light module: the CLI builds its parser without importing the
launcher."""

from __future__ import annotations

import argparse

from shardwise.common.arguments import add_debug, add_overrides

TARGETS = ("slurm", "k8s", "ray", "spark")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _shared(parser)
    _k8s(parser.add_argument_group("k8s"))
    _ray(parser.add_argument_group("ray"))
    parser.add_argument_group("spark").add_argument(
        "--spark-master",
        metavar="URL",
        help="the Spark cluster (default local-cluster[nodes, ranks per node, 2048])",
    )
    _slurm(parser.add_argument_group("slurm"))
    add_debug(parser)


def _shared(parser: argparse.ArgumentParser) -> None:
    """The target, the job, the machines and their ranks, and what to do with the result."""
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
    add_overrides(parser, "train.steps=1000", "; passed to every node")
    parser.add_argument(
        "--shared-storage",
        action="store_true",
        help="the checkpoint and run directories are on storage every node mounts, although "
        "their filesystem does not look shared (it is not NFS, Lustre, GPFS, …)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print what would be submitted")
    parser.add_argument("--submit", action="store_true", help="slurm: submit it (sbatch)")
    parser.add_argument(
        "--apply", action="store_true", help="k8s: create it through the Kubernetes API"
    )


def _k8s(k8s: argparse._ArgumentGroup) -> None:
    k8s.add_argument("--image", help="the container image, with shardwise installed")
    k8s.add_argument("--namespace", default="default")
    k8s.add_argument(
        "--api",
        choices=("trainjob", "pytorchjob"),
        default="trainjob",
        help="Kubeflow Trainer v2's TrainJob (default), or the Training Operator's PyTorchJob",
    )
    k8s.add_argument("--memory-per-node", metavar="QUANTITY", help="e.g. 64Gi")
    k8s.add_argument(
        "--volume",
        dest="volumes",
        action="append",
        default=[],
        metavar="CLAIM:/PATH",
        help="a PersistentVolumeClaim every pod mounts (repeatable): shared checkpoints",
    )
    k8s.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        help="times Kubernetes restarts the job's pods after a failure (default 3)",
    )


def _ray(ray: argparse._ArgumentGroup) -> None:
    ray.add_argument(
        "--ray-address", metavar="ADDRESS", help="a running Ray cluster (default: a local Ray)"
    )
    ray.add_argument(
        "--placement",
        choices=("pack", "spread"),
        default="pack",
        help="ranks on as few nodes as possible (pack), or across nodes (spread)",
    )
    ray.add_argument("--cpus-per-rank", type=float, default=1.0, metavar="C")
    ray.add_argument(
        "--resume",
        default="never",
        metavar="auto|never|PATH",
        help="ray and spark: as shardwise train's (slurm and k8s always resume: auto)",
    )


def _slurm(slurm: argparse._ArgumentGroup) -> None:
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
        help="rendezvous port on the first node (default 20000 + job id %% 20000)",
    )
    slurm.add_argument(
        "--signal-seconds",
        type=int,
        default=120,
        metavar="S",
        help="SIGTERM this long before the time limit, to save and requeue (default 120)",
    )
