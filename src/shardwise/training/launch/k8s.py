"""`shardwise launch k8s JOB.toml`: the same job as Kubernetes objects for Kubeflow, and (`--apply`)
their creation through the Kubernetes API.

- Kubeflow Trainer v2 (default): a `ClusterTrainingRuntime` named `shardwise` (the torch runtime:
  one JobSet replicated job, `node`, whose container runs shardwise) and a `TrainJob` that uses it
  with `numNodes`, `numProcPerNode`, the image and resources per node; the job file is mounted
  from a `ConfigMap` through the TrainJob's runtime patch, as are extra volumes (`--volume
  CLAIM:/path`: a PersistentVolumeClaim for checkpoints every node sees).
- Kubeflow Training Operator v1 (`--api pytorchjob`, older clusters): a `PyTorchJob` with a Master
  and `nodes − 1` Workers, `nprocPerNode`, `OnFailure` restarts up to `runPolicy.backoffLimit`.

Either way the operator gives each pod the torchrun variables (`PET_NNODES`, `PET_NODE_RANK`,
`PET_MASTER_ADDR`, `PET_MASTER_PORT`, `PET_NPROC_PER_NODE`), from which `shardwise train` makes
that pod one node of the job: its agent starts the pod's ranks, and the agents meet at the
master's address (launch/env.py: `kubeflow`). The pod passes its own address (`--local-addr`,
from the downward API), so the rendezvous does not depend on how its host name resolves. A pod
that fails is restarted by Kubernetes; every start runs with `--resume auto`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import tomli_w

from shardwise.common.errors import ConfigError
from shardwise.training.launch.targets import Target

RUNTIME = "shardwise"
JOB_DIR = "/etc/shardwise"
GROUP = "trainer.kubeflow.org"
Manifest = dict[str, Any]


@dataclass(frozen=True)
class K8sOptions:
    image: str
    namespace: str = "default"
    api: str = "trainjob"
    """`trainjob` (Kubeflow Trainer v2) or `pytorchjob` (Training Operator v1)."""
    cpus_per_node: str | None = None
    memory_per_node: str | None = None
    volumes: tuple[str, ...] = ()
    """`CLAIM:/mount/path`: PersistentVolumeClaims every pod mounts."""
    max_restarts: int = 3


def name_of(target: Target) -> str:
    """The job's name as Kubernetes takes it: lower case, digits and '-', at most 50."""
    name = re.sub(r"[^a-z0-9-]+", "-", target.config.job.name.lower()).strip("-")[:50]
    return name.strip("-") or "shardwise"


def manifests(target: Target, options: K8sOptions) -> list[Manifest]:
    """The objects to create, in order."""
    name = name_of(target)
    config_map: Manifest = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"{name}-job", "namespace": options.namespace},
        "data": {
            "job.toml": tomli_w.dumps(target.config.model_dump(mode="json", exclude_none=True))
        },
    }
    if options.api == "pytorchjob":
        return [config_map, pytorch_job(target, options, name)]
    return [config_map, cluster_runtime(options), train_job(target, options, name)]


def _command() -> list[str]:
    return [
        "shardwise", "train", f"{JOB_DIR}/job.toml", "--resume", "auto",
        "--local-addr", "$(POD_IP)",
    ]  # fmt: skip


def _resources(target: Target, options: K8sOptions) -> Manifest:
    limits: dict[str, str] = {}
    if target.gpus_per_node:
        limits["nvidia.com/gpu"] = str(target.gpus_per_node)
    if options.cpus_per_node:
        limits["cpu"] = options.cpus_per_node
    if options.memory_per_node:
        limits["memory"] = options.memory_per_node
    return {"limits": limits, "requests": dict(limits)} if limits else {}


def _volumes(options: K8sOptions, name: str) -> tuple[list[Manifest], list[Manifest]]:
    """(volumes, mounts): the job file's ConfigMap and each `--volume`."""
    volumes: list[Manifest] = [{"name": "job", "configMap": {"name": f"{name}-job"}}]
    mounts: list[Manifest] = [{"name": "job", "mountPath": JOB_DIR, "readOnly": True}]
    for i, spec in enumerate(options.volumes):
        claim, path = parse_volume(spec)
        volumes.append({"name": f"data-{i}", "persistentVolumeClaim": {"claimName": claim}})
        mounts.append({"name": f"data-{i}", "mountPath": path})
    return volumes, mounts


def unshared_in_pods(location: str, nodes: int, options: K8sOptions) -> str | None:
    """Why the pods of a job across `nodes` could not all see `location`: a path in the
    container's own filesystem, not under a `--volume`; None for one node or an object store."""
    from pathlib import PurePosixPath

    from shardwise.training.checkpoint.disk_layout import is_local

    if nodes <= 1 or not is_local(location):
        return None
    mounts = [PurePosixPath(parse_volume(spec)[1]) for spec in options.volumes]
    path = PurePosixPath(location)
    if path.is_absolute() and any(path.is_relative_to(mount) for mount in mounts):
        return None
    return (
        "not on a volume every pod mounts; mount a shared PersistentVolumeClaim with --volume "
        "CLAIM:/shared and set job.run_dir under it (--set job.run_dir=/shared/runs/NAME), or "
        "use an object store (checkpoint.dir = 's3://…')"
    )


def parse_volume(spec: str) -> tuple[str, str]:
    claim, _, path = spec.partition(":")
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", claim) or not path.startswith("/"):
        raise ConfigError(
            f"--volume {spec!r}: expected CLAIM:/path, a PersistentVolumeClaim's name and where "
            "to mount it (e.g. checkpoints:/shared)"
        )
    return claim, path


POD_IP: Manifest = {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}


def cluster_runtime(options: K8sOptions) -> Manifest:
    """The ClusterTrainingRuntime every shardwise TrainJob uses: the torch runtime (the operator
    sets PET_* for each node), its container running `shardwise train` on the mounted job."""
    container = {"name": "node", "image": options.image, "command": _command(), "env": [POD_IP]}
    return {
        "apiVersion": f"{GROUP}/v1alpha1",
        "kind": "ClusterTrainingRuntime",
        "metadata": {"name": RUNTIME, "labels": {f"{GROUP}/framework": "torch"}},
        "spec": {
            "mlPolicy": {"numNodes": 1, "torch": {}},
            "template": {
                "spec": {
                    "failurePolicy": {"maxRestarts": options.max_restarts},
                    "replicatedJobs": [
                        {
                            "name": "node",
                            "template": {
                                "metadata": {
                                    "labels": {f"{GROUP}/trainjob-ancestor-step": "trainer"}
                                },
                                "spec": {"template": {"spec": {"containers": [container]}}},
                            },
                        }
                    ],
                }
            },
        },
    }


def train_job(target: Target, options: K8sOptions, name: str) -> Manifest:
    volumes, mounts = _volumes(options, name)
    trainer: Manifest = {
        "image": options.image,
        "numNodes": target.nodes,
        "numProcPerNode": target.per_node,
    }
    if resources := _resources(target, options):
        trainer["resourcesPerNode"] = resources
    pod_patch = {"volumes": volumes, "containers": [{"name": "node", "volumeMounts": mounts}]}
    return {
        "apiVersion": f"{GROUP}/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": name, "namespace": options.namespace},
        "spec": {
            "runtimeRef": {"name": RUNTIME, "kind": "ClusterTrainingRuntime", "apiGroup": GROUP},
            "trainer": trainer,
            "runtimePatches": [
                {
                    "manager": "shardwise",
                    "trainingRuntimeSpec": {
                        "template": {
                            "spec": {
                                "replicatedJobs": [
                                    {
                                        "name": "node",
                                        "template": {"spec": {"template": {"spec": pod_patch}}},
                                    }
                                ]
                            }
                        }
                    },
                }
            ],
        },
    }


def pytorch_job(target: Target, options: K8sOptions, name: str) -> Manifest:
    volumes, mounts = _volumes(options, name)
    container: Manifest = {
        "name": "pytorch",  # the name the training operator looks for
        "image": options.image,
        "command": _command(),
        "env": [POD_IP],
        "volumeMounts": mounts,
    }
    if resources := _resources(target, options):
        container["resources"] = resources

    def replicas(count: int) -> Manifest:
        return {
            "replicas": count,
            "restartPolicy": "OnFailure",
            "template": {"spec": {"containers": [container], "volumes": volumes}},
        }

    specs = {"Master": replicas(1)}
    if target.nodes > 1:
        specs["Worker"] = replicas(target.nodes - 1)
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": name, "namespace": options.namespace},
        "spec": {
            "nprocPerNode": str(target.per_node),
            "runPolicy": {"backoffLimit": options.max_restarts, "cleanPodPolicy": "None"},
            "pytorchReplicaSpecs": specs,
        },
    }


def to_yaml(objects: list[Manifest]) -> str:
    import yaml

    return "---\n".join(yaml.safe_dump(o, sort_keys=False) for o in objects)


def apply(objects: list[Manifest]) -> list[str]:
    """Create `objects` through the Kubernetes API (the kubeconfig, or the pod's service account);
    what was created, as `Kind/name`."""
    try:
        from kubernetes import client, config, utils
    except ImportError:
        raise ConfigError(
            "--apply needs the Kubernetes client: pip install 'shardwise[k8s]'"
        ) from None
    try:
        config.load_kube_config()
    except Exception:
        try:
            config.load_incluster_config()
        except Exception:
            raise ConfigError(
                "--apply: no Kubernetes cluster configured (no kubeconfig at ~/.kube/config or "
                "$KUBECONFIG, and not inside a pod); use --dry-run to print the manifests"
            ) from None
    api = client.ApiClient()
    custom = client.CustomObjectsApi(api)
    _check_gpus(client.CoreV1Api(api), objects)
    created = []
    for obj in objects:
        kind, name = obj["kind"], obj["metadata"]["name"]
        try:
            if _create(client, utils, api, custom, obj):
                created.append(f"{kind}/{name}")
        except Exception as e:  # the API's errors (ApiException, FailToCreateError), one line
            reason = getattr(e, "reason", None) or str(e).strip().splitlines()[0]
            status = getattr(e, "status", None)
            detail = f"{status} {reason}" if status else reason
            raise ConfigError(
                f"--apply: creating {kind}/{name} failed ({detail}); created so far: "
                f"{', '.join(created) or 'nothing'}"
            ) from None
    return created


def _create(client: Any, utils: Any, api: Any, custom: Any, obj: Manifest) -> bool:
    """Create one object; False where it is the shared runtime and exists already."""
    kind, meta = obj["kind"], obj["metadata"]
    if kind == "ConfigMap":
        utils.create_from_dict(api, obj, namespace=meta["namespace"])
        return True
    group, version = obj["apiVersion"].split("/")
    plural = {"ClusterTrainingRuntime": "clustertrainingruntimes", "TrainJob": "trainjobs",
              "PyTorchJob": "pytorchjobs"}[kind]  # fmt: skip
    if kind != "ClusterTrainingRuntime":
        custom.create_namespaced_custom_object(group, version, meta["namespace"], plural, obj)
        return True
    try:
        custom.create_cluster_custom_object(group, version, plural, obj)
    except client.ApiException as e:
        if e.status != 409:
            raise
        return False  # it exists: the one runtime every job shares
    return True


def _check_gpus(core: Any, objects: list[Manifest]) -> None:
    """A GPU job on a cluster none of whose nodes offers `nvidia.com/gpu`: refused."""
    if "nvidia.com/gpu" not in str(objects):
        return
    try:
        nodes = core.list_node().items
    except Exception:  # no permission to list nodes: the scheduler will say
        return
    if not any(int((n.status.allocatable or {}).get("nvidia.com/gpu", "0")) for n in nodes):
        raise ConfigError(
            f"--gpus-per-node: none of the cluster's {len(nodes)} nodes offers nvidia.com/gpu; "
            "run on CPUs with --nproc-per-node, or on a cluster with GPUs"
        )
