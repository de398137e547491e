"""`shardwise launch k8s`: the manifests, validated against the resource models of Kubeflow's own
SDK packages on PyPI (kubeflow-trainer-api for Trainer v2, kubeflow-training for the v1
PyTorchJob): every object parses into its model, and the model writes back exactly what shardwise
wrote, so no field is misspelled, misplaced or of the wrong type. There is no cluster here: that
the operator accepts and runs them is not tested."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import tomli_w
import yaml

from helpers import digits_job
from shardwise.cli import main
from shardwise.training.config.load import validate

IMAGE = "ghcr.io/example/shardwise:1.0"


@pytest.fixture
def job(tmp_path: Path) -> Path:
    path = tmp_path / "job.toml"
    config = digits_job(tmp_path / "run")
    path.write_text(tomli_w.dumps(config.model_dump(mode="json", exclude_none=True)))
    return path


def render(capsys, job: Path, *args: str) -> list[dict[str, Any]]:
    assert main(["launch", "k8s", str(job), "--image", IMAGE, *args]) == 0
    return list(yaml.safe_load_all(capsys.readouterr().out))


def trainer_v2(manifest: dict[str, Any]) -> dict[str, Any]:
    from kubeflow_trainer_api import models

    kind = {
        "ConfigMap": models.IoK8sApiCoreV1ConfigMap,
        "ClusterTrainingRuntime": models.TrainerV1alpha1ClusterTrainingRuntime,
        "TrainJob": models.TrainerV1alpha1TrainJob,
    }[manifest["kind"]]
    return kind.from_dict(manifest).to_dict()


def operator_v1(manifest: dict[str, Any]) -> dict[str, Any]:
    from kubeflow.training.api_client import ApiClient

    client = ApiClient()
    kind = {"ConfigMap": "V1ConfigMap", "PyTorchJob": "KubeflowOrgV1PyTorchJob"}[manifest["kind"]]
    model = client.deserialize(SimpleNamespace(data=json.dumps(manifest)), kind)
    return client.sanitize_for_serialization(model)


def test_a_trainjob_matches_kubeflow_trainer_v2s_models(job, capsys, tmp_path):
    objects = render(
        capsys, job, "--nodes", "2", "--gpus-per-node", "8", "--cpus-per-node", "32",
        "--memory-per-node", "256Gi", "--volume", "shared:/shared", "--namespace", "ml",
        "--set", "job.run_dir=/shared/runs/digits",
    )  # fmt: skip
    assert [o["kind"] for o in objects] == ["ConfigMap", "ClusterTrainingRuntime", "TrainJob"]
    for manifest in objects:
        assert trainer_v2(manifest) == manifest, manifest["kind"]
    config_map, runtime, train_job = objects
    trainer = train_job["spec"]["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"], trainer["image"]) == (2, 8, IMAGE)
    assert trainer["resourcesPerNode"]["limits"] == {
        "nvidia.com/gpu": "8", "cpu": "32", "memory": "256Gi",
    }  # fmt: skip
    assert train_job["spec"]["runtimeRef"]["name"] == runtime["metadata"]["name"] == "shardwise"
    container = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"][
        "template"
    ]["spec"]["containers"][0]
    assert container["command"][:5] == ["shardwise", "train", "/etc/shardwise/job.toml",
                                         "--resume", "auto"]  # fmt: skip
    # the job file the pods read is this job, with the launch's overrides
    loaded = validate(tomllib.loads(config_map["data"]["job.toml"]))
    assert (
        str(loaded.run_dir) == "/shared/runs/digits" and config_map["metadata"]["namespace"] == "ml"
    )


def test_a_pytorchjob_matches_the_training_operators_models(job, capsys):
    objects = render(
        capsys, job, "--api", "pytorchjob", "--nodes", "3", "--nproc-per-node", "4",
        "--set", "checkpoint.dir=s3://bucket/digits", "--set", "train.global_batch=48",
        "--shared-storage", "--max-restarts", "5",
    )  # fmt: skip
    assert [o["kind"] for o in objects] == ["ConfigMap", "PyTorchJob"]
    for manifest in objects:
        assert operator_v1(manifest) == manifest, manifest["kind"]
    spec = objects[1]["spec"]
    assert spec["nprocPerNode"] == "4" and spec["runPolicy"]["backoffLimit"] == 5
    replicas = spec["pytorchReplicaSpecs"]
    assert (replicas["Master"]["replicas"], replicas["Worker"]["replicas"]) == (1, 2)
    container = replicas["Worker"]["template"]["spec"]["containers"][0]
    assert container["name"] == "pytorch" and "--local-addr" in container["command"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nodes", "2"], "checkpoint.dir = 'runs/"),
        (["--nodes", "2", "--volume", "bad"], "--volume 'bad': expected CLAIM:/path"),
        (["--submit"], "--submit is for slurm"),
        (["--max-restarts", "-1"], "--max-restarts -1: need 0 or more"),
    ],
)
def test_bad_k8s_launches_are_one_line(job, capsys, tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "job.toml").write_text(
        tomli_w.dumps(digits_job(Path("runs/x")).model_dump(mode="json", exclude_none=True))
    )
    assert main(["launch", "k8s", "job.toml", "--image", IMAGE, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardwise: error: " + message) and err.count("\n") == 1, err


def test_no_image_or_no_cluster_is_one_line(job, capsys, tmp_path, monkeypatch):
    assert main(["launch", "k8s", str(job)]) == 2
    assert capsys.readouterr().err.startswith("shardwise: error: k8s needs --image IMAGE")
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "none"))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert main(["launch", "k8s", str(job), "--image", IMAGE, "--apply"]) == 2
    assert capsys.readouterr().err.startswith(
        "shardwise: error: --apply: no Kubernetes cluster configured"
    )
