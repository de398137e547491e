"""`shardwise launch ray JOB.toml`: the job's ranks as Ray actors, one per rank, in a placement
group (`pack`: as few nodes as possible; `spread`: across nodes), each with its CPUs (and GPU).

Every actor runs the same worker entry as every other launcher (launch/worker.py: `run_worker`)
with torchrun's variables set from the group: rank, local rank among the actors on its node,
world size, and rank 0's node address and a free port there for the process group. The driver
(this process) waits on all of them; when an actor or its node dies, or a rank fails, it stops
the others and starts the group again, up to `fault.max_restarts` times. Each new group agrees on
the restart and resumes from the newest good checkpoint, as under the elastic agent, so on CPU
the run ends bitwise like an uninterrupted one.

Actors start in Ray's own working directory on their node: relative paths in the job (run_dir,
checkpoints) are made absolute here, and must name storage every node sees. Variables named
SHARDWISE_* in this process are passed to the actors.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardwise.common.errors import ConfigError
from shardwise.training.launch.targets import (
    Target,
    absolute_paths,
    forwarded_env,
    run_with_restarts,
)

if TYPE_CHECKING:
    from shardwise.training.trainer.train_summary import TrainSummary

PLACEMENT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class RayOptions:
    address: str | None = None
    """A running cluster (host:port, or `auto`); None: a local Ray on loopback, for this run."""
    placement: str = "pack"
    cpus_per_rank: float = 1.0


class Rank:
    """One rank of the job, as a Ray actor."""

    def where(self) -> tuple[str, list[int]]:
        """This actor's node address and the GPUs Ray gave it."""
        import ray

        node: str = ray.util.get_node_ip_address()
        return node, [int(g) for g in ray.get_gpu_ids()]

    def free_port(self) -> int:
        address = self.where()[0]
        with socket.socket() as s:
            s.bind((address, 0))
            return int(s.getsockname()[1])

    def run(
        self, env: dict[str, str], config_data: dict[str, Any], resume: str | None
    ) -> TrainSummary | None:
        os.environ.update(env)
        from shardwise.training.launch.worker import run_worker

        return run_worker(config_data, resume)


def describe(target: Target, options: RayOptions, resume: str) -> str:
    """What `train_on_ray` would start, for --dry-run."""
    bundle = {"CPU": options.cpus_per_rank, **({"GPU": 1} if target.gpus_per_node else {})}
    data = absolute_paths(target)
    return "\n".join(
        [
            f"# would connect to Ray at {options.address or 'a local Ray on loopback'} and run:",
            f"placement group: {target.world_size} bundles of {bundle}, strategy "
            f"{options.placement.upper()}",
            f"actors: {target.world_size} × shardwise.training.launch.ray_actors.Rank, one per "
            "bundle, each calling launch/worker.py's run_worker",
            f"per rank: RANK=i WORLD_SIZE={target.world_size} LOCAL_RANK/LOCAL_WORLD_SIZE by "
            "node, MASTER_ADDR=rank 0's node, MASTER_PORT=a free port there, "
            "TORCHELASTIC_RESTART_COUNT=attempt",
            f"restarts: up to {target.config.fault.max_restarts} (fault.max_restarts), each from "
            "the newest good checkpoint",
            f"resume: {resume}; run_dir {data['job']['run_dir']}, checkpoints "
            f"{data['checkpoint']['dir'] or data['job']['run_dir'] + '/checkpoints'}",
        ]
    )


def train_on_ray(target: Target, options: RayOptions, resume: str | None) -> TrainSummary | None:
    """Run the job; rank 0's summary. `resume`: the checkpoint chosen before launch."""
    ray = _connect(options, target.config.run_dir)
    try:
        _check_resources(ray, target, options)
        group = _placement_group(ray, target, options)
        config_data = absolute_paths(target)
        forwarded = forwarded_env()

        def attempt(n: int) -> TrainSummary | None:
            actors = _start_actors(ray, target, options, group)
            try:
                envs = _environments(ray, actors, target, n)
                calls = [
                    actor.run.remote({**forwarded, **env}, config_data, resume)
                    for actor, env in zip(actors, envs, strict=True)
                ]
                return _wait_all(ray, calls)
            finally:
                for actor in actors:
                    ray.kill(actor)

        return run_with_restarts(
            target.config.fault.max_restarts,
            attempt,
            again=lambda failure: f"{failure}; restarting the group",
            fatal=_failed,
        )
    finally:
        if options.address is None:
            ray.shutdown()


def _connect(options: RayOptions, run_dir: Path) -> Any:
    from shardwise.common.ray_cluster import check_ray_address, loopback_ray, ray_logs_to

    address = options.address
    if address:
        check_ray_address(address, f"--ray-address {address}")
    with contextlib.nullcontext() if address else loopback_ray():
        import ray

        with ray_logs_to(run_dir / "ray.log"):
            ray.init(
                address=address or "local",
                include_dashboard=False,
                configure_logging=False,
                log_to_driver=True,
            )
    return ray


def _check_resources(ray: Any, target: Target, options: RayOptions) -> None:
    have = ray.cluster_resources()
    if target.gpus_per_node and not have.get("GPU"):
        raise ConfigError(
            f"--gpus-per-node {target.gpus_per_node}: the Ray cluster has no GPUs; run on CPUs "
            "with --nproc-per-node"
        )
    cpus = options.cpus_per_rank * target.world_size
    if cpus > have.get("CPU", 0):
        raise ConfigError(
            f"{target.world_size} ranks × {options.cpus_per_rank:g} CPUs need {cpus:g} CPUs; "
            f"the Ray cluster has {have.get('CPU', 0):g}: use fewer ranks or --cpus-per-rank"
        )


def _placement_group(ray: Any, target: Target, options: RayOptions) -> Any:
    from ray.util.placement_group import placement_group

    bundle = {"CPU": options.cpus_per_rank, **({"GPU": 1} if target.gpus_per_node else {})}
    group = placement_group([bundle] * target.world_size, strategy=options.placement.upper())
    ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        ray.util.remove_placement_group(group)
        raise ConfigError(
            f"Ray could not place {target.world_size} ranks of {bundle} "
            f"({options.placement}) within {PLACEMENT_TIMEOUT_S:g} s: the nodes have "
            f"{ray.available_resources()} free"
        )
    return group


def _start_actors(ray: Any, target: Target, options: RayOptions, group: Any) -> list[Any]:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    remote = ray.remote(Rank)
    return [
        remote.options(
            num_cpus=options.cpus_per_rank,
            num_gpus=1 if target.gpus_per_node else 0,
            max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=rank
            ),
        ).remote()
        for rank in range(target.world_size)
    ]


def _environments(
    ray: Any, actors: list[Any], target: Target, attempt: int
) -> list[dict[str, str]]:
    """torchrun's variables for each actor: ranks by bundle, local ranks by node (on GPUs, the
    position of the actor's GPU among those of its node's actors, all of which it sees)."""
    places = ray.get([actor.where.remote() for actor in actors])
    master = places[0][0]
    port = ray.get(actors[0].free_port.remote())
    by_node: dict[str, list[int]] = defaultdict(list)
    for rank, (node, _) in enumerate(places):
        by_node[node].append(rank)
    nodes = list(by_node)
    envs = []
    for rank, (node, gpus) in enumerate(places):
        peers = by_node[node]
        env = {
            "RANK": str(rank),
            "WORLD_SIZE": str(target.world_size),
            "LOCAL_RANK": str(peers.index(rank)),
            "LOCAL_WORLD_SIZE": str(len(peers)),
            "GROUP_RANK": str(nodes.index(node)),
            "MASTER_ADDR": master,
            "MASTER_PORT": str(port),
            "TORCHELASTIC_RESTART_COUNT": str(attempt),
        }
        if gpus:
            visible = sorted(g for r in peers for g in places[r][1])
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, visible))
            env["LOCAL_RANK"] = str(visible.index(gpus[0]))
        envs.append(env)
    return envs


class RankFailed(Exception):
    def __init__(self, rank: int, error: BaseException) -> None:
        super().__init__(rank, error)
        self.rank, self.error = rank, error

    def __str__(self) -> str:
        cause = getattr(self.error, "cause", None) or self.error
        lines = str(cause).strip().splitlines()
        return f"rank {self.rank}: {lines[-1][:300] if lines else type(cause).__name__}"


def _wait_all(ray: Any, calls: list[Any]) -> TrainSummary | None:
    """Every rank's result, failing (RankFailed) as soon as one fails: the others would wait in
    a collective until their timeout. Rank 0's result."""
    pending = list(calls)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        try:
            ray.get(done)
        except Exception as e:  # the rank's own error, or RayActorError where it died
            raise RankFailed(calls.index(done[0]), e) from None
    result: TrainSummary | None = ray.get(calls[0])
    return result


def _failed(failure: BaseException) -> Exception:
    """What the command reports: a ConfigError from a rank as one line; else the failed rank."""
    from shardwise.training.launch.outcome import WorkerFailed

    if isinstance(failure, ConfigError):
        return failure
    error = failure.error if isinstance(failure, RankFailed) else failure
    cause = getattr(error, "cause", None)
    if isinstance(cause, ConfigError):
        return ConfigError(str(cause))
    rank = failure.rank if isinstance(failure, RankFailed) else 0
    message = str(failure).removeprefix(f"rank {rank}: ")
    return WorkerFailed(rank=rank, exitcode=1, message=message, traceback="")
