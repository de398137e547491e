import pytest

from shardwise.training.launch.env import detect, first_host


def test_plain_process_is_not_a_worker():
    assert detect({}) is None
    assert detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) is None  # sbatch script, no srun


def test_torchrun():
    env = detect(
        {
            "TORCHELASTIC_RUN_ID": "x",
            "RANK": "3",
            "LOCAL_RANK": "1",
            "WORLD_SIZE": "4",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "h",
            "MASTER_PORT": "1",
        }
    )
    assert env is not None
    assert (env.launcher, env.rank, env.local_rank, env.world_size, env.local_world_size) == (
        "torchrun",
        3,
        1,
        4,
        2,
    )
    assert env.init_method == "env://"


def test_srun():
    env = detect(
        {
            "SLURM_STEP_NUM_TASKS": "8",
            "SLURM_PROCID": "5",
            "SLURM_LOCALID": "1",
            "SLURM_STEP_NODELIST": "gpu[003-006]",
            "SLURM_JOB_ID": "1234",
            "SLURM_STEP_TASKS_PER_NODE": "2(x4)",
        }
    )
    assert env is not None
    assert (env.launcher, env.rank, env.local_rank, env.world_size, env.local_world_size) == (
        "slurm",
        5,
        1,
        8,
        2,
    )
    assert env.init_method == "tcp://gpu003:21234"


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [("node1", "node1"), ("gpu[003-005,9],cpu1", "gpu003"), ("a-b[7,9]", "a-b7"), ("x1,x2", "x1")],
)
def test_first_host(nodelist, first):
    assert first_host(nodelist) == first


@pytest.mark.parametrize(
    ("choice", "ranks", "gpus", "message"),
    [
        ("auto", 2, 1, "--nproc 2 ranks on this node but 1 GPU is visible"),
        ("cuda", 4, 2, "--nproc 4 ranks on this node but 2 GPUs are visible"),
        ("cuda", 1, 0, "job.device = 'cuda' but no GPU is visible"),
    ],
)
def test_a_gpu_job_needs_a_gpu_for_each_rank_of_a_node(choice, ranks, gpus, message):
    """Refused before launch, in one line (a GPU for rank 1 of a one-GPU machine ended in a
    CUDA 'invalid device ordinal' traceback from the worker)."""
    from shardwise.common.errors import ConfigError
    from shardwise.training.launch.worker import check_devices

    with pytest.raises(ConfigError, match=message) as error:
        check_devices(choice, ranks, gpus=gpus)
    said = str(error.value)
    assert "\n" not in said
    if gpus:
        assert f"use --nproc {gpus}" in said and "job.device = 'cpu'" in said


@pytest.mark.parametrize(
    ("choice", "ranks", "gpus"), [("auto", 4, 0), ("cpu", 4, 1), ("auto", 2, 2), ("cuda", 1, 8)]
)
def test_a_job_with_a_gpu_per_rank_or_on_the_cpu_is_let_through(choice, ranks, gpus):
    from shardwise.training.launch.worker import check_devices

    check_devices(choice, ranks, gpus=gpus)


KUBEFLOW = {  # what Kubeflow's training operator injects with nprocPerNode (PyTorchJob v1)
    "PET_NNODES": "2",
    "PET_NPROC_PER_NODE": "4",
    "PET_NODE_RANK": "1",
    "PET_MASTER_ADDR": "job-master-0",
    "PET_MASTER_PORT": "23456",
    "MASTER_ADDR": "job-master-0",
    "MASTER_PORT": "23456",
    "WORLD_SIZE": "2",
    "RANK": "1",
}


def test_a_kubeflow_pod_is_a_node_agent_not_a_rank():
    from shardwise.training.launch.env import kubeflow

    assert detect(KUBEFLOW) is None  # RANK/WORLD_SIZE there count pods, not ranks
    pod = kubeflow(KUBEFLOW)
    assert pod is not None
    assert (pod.nnodes, pod.nproc_per_node, pod.node_rank, pod.endpoint) == (
        2,
        4,
        1,
        "job-master-0:23456",
    )
    assert kubeflow({**KUBEFLOW, "PET_NPROC_PER_NODE": "auto"}).nproc_per_node is None
    assert kubeflow({}) is None
    # the ranks its agent starts are torch elastic's workers, whatever the pod's variables
    worker = detect({**KUBEFLOW, "TORCHELASTIC_RUN_ID": "x", "RANK": "5", "WORLD_SIZE": "8"})
    assert worker is not None and worker.rank == 5 and worker.world_size == 8


@pytest.mark.parametrize(("nnodes", "nodes"), [("1", None), ("3", 3)])
def test_a_pods_own_address_is_taken_whatever_the_jobs_size(monkeypatch, nnodes, nodes):
    """The manifests pass --local-addr $(POD_IP) to every pod: a one-pod job must accept it."""
    from shardwise.cli import build_parser
    from shardwise.training.launch.train_command import nodes_of

    for name, value in {**KUBEFLOW, "PET_NNODES": nnodes}.items():
        monkeypatch.setenv(name, value)
    args = build_parser().parse_args(["train", "job.toml", "--local-addr", "10.0.0.7"])
    got = nodes_of(args)
    assert (got.count if got else None) == nodes
    if got:
        assert (got.endpoint, got.local_addr) == ("job-master-0:23456", "10.0.0.7")
