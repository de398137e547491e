"""`shardwise train`: the command's options made into a launch (training/run.py): the processes
per machine (--nproc, or a Kubeflow pod's), the machines (--nnodes and the rendezvous, or the
pod's PET_* variables), and how a run that is stopped or whose ranks failed is reported."""

from __future__ import annotations

import argparse
import sys

from shardwise.common.errors import ConfigError
from shardwise.training.launch.agent import Nodes
from shardwise.training.launch.env import kubeflow
from shardwise.training.launch.outcome import Interrupted, WorkerFailed
from shardwise.training.run import report_result, train


def run(args: argparse.Namespace) -> int:
    if args.nproc is not None and args.nproc < 1:
        raise ConfigError(f"--nproc {args.nproc}: need at least 1 process")
    nodes, nproc = nodes_of(args), args.nproc
    if nproc is None and (pod := kubeflow()) is not None:
        nproc = pod.nproc_per_node or _gpus_or_1()
    try:
        summary = train(
            args.job,
            nproc=nproc,
            resume=args.resume,
            overrides=args.overrides,
            dry_run=args.dry_run,
            nodes=nodes,
        )
    except Interrupted as stop:
        print(f"shardwise: {stop}; checkpoints written so far are kept", file=sys.stderr)
        return 128 + stop.signum
    except WorkerFailed as failure:
        return worker_failed(failure)
    return report_result(summary)


def worker_failed(failure: WorkerFailed) -> int:
    """A run whose ranks failed (and had no restart left): what failed, one line, exit code 1;
    the rank's traceback where the launcher has it."""
    print(f"shardwise: {failure}", file=sys.stderr)
    if failure.traceback:
        print(f"--- rank {failure.rank} traceback ---\n{failure.traceback}", file=sys.stderr)
    return 1


def nodes_of(args: argparse.Namespace) -> Nodes | None:
    """The --nnodes options, checked; in a Kubeflow pod without them, the operator's (PET_*)."""
    if args.nnodes < 1:
        raise ConfigError(f"--nnodes {args.nnodes}: need at least 1 node")
    pod = kubeflow()
    if args.nnodes == 1 and not args.rdzv_endpoint and pod is not None:
        if pod.nnodes > 1:
            return Nodes(pod.nnodes, pod.endpoint, run_id=args.rdzv_id, local_addr=args.local_addr)
        return None  # a one-pod job is a one-machine job: the manifest's --local-addr is moot
    if args.nnodes == 1:
        extra = [f for f in ("rdzv_endpoint", "rdzv_id", "local_addr") if getattr(args, f)]
        if extra:
            flag = "--" + extra[0].replace("_", "-")
            raise ConfigError(f"{flag} is for jobs across machines; add --nnodes N")
        return None
    endpoint = args.rdzv_endpoint or ""
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(
            f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT (one node's address and a "
            "free port on it; every node passes the same)"
        )
    return Nodes(args.nnodes, endpoint, run_id=args.rdzv_id, local_addr=args.local_addr)


def _gpus_or_1() -> int:
    import torch

    return torch.cuda.device_count() or 1
