"""Communication modes (comm/) are correct by equivalence, on real 2-rank gloo process groups:

- an uncompressed hierarchical reduction is DDP (fp32 summation order aside);
- local SGD with H = 1 is DDP for a linear optimizer (SGD with momentum, no clipping: averaging
  parameters after identical linear steps is stepping on averaged gradients);
- DiLoCo with outer lr 1 and momentum 0 is local SGD (the outer step lands on the average);
- PowerSGD at full rank reproduces the uncompressed mean gradient;
- asynchronous updates with max_staleness = 0 are synchronous training (DDP), and a run with
  staleness replays bit for bit from its record of which version each pull got;
- bf16 sends half DDP's bytes and PowerSGD its factors' (r·(n + m) per matrix);
- a rank SIGKILLed mid-run restarts from its checkpoint and ends bitwise equal to the run that
  never stopped, in every mode (compression residuals, PowerSGD's Q, each rank's own parameters
  and optimizer state under local SGD and DiLoCo, DiLoCo's outer state are all checkpointed).

By module of comm/: hierarchical.py `test_an_uncompressed_hierarchical_reduction_is_ddp`;
local_sgd.py `test_local_sgd_every_step_is_ddp_…`, `test_diloco_with_outer_lr_1_…`;
powersgd.py `test_powersgd_at_full_rank_…`; compression.py `test_bf16_sends_half_…`,
`test_fsdp_reduces_in_bf16_when_asked`; param_server.py `test_async_…`,
`test_an_async_run_replays_…`; every mode (choose.py, base.py) `test_a_killed_rank_resumes_…`,
`test_every_mode_runs_across_two_machines`; collectives.py in test_collectives.py.

Tolerances: as tests/distributed/test_ddp.py (losses 1e-5 relative, parameters 1e-5 absolute);
DiLoCo against local SGD adds one rounding per synchronisation (g − (g − mean) for mean).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import shardwise
from helpers import digits_job, load_params, losses, run_distributed, shardwise_process
from shardwise.training.comm.powersgd import factor_bytes
from shardwise.training.tracking.metrics import read_metrics

pytestmark = pytest.mark.slow
RTOL, ATOL = 1e-5, 1e-5
SGD = {"optimizer": "sgd", "momentum": 0.9, "grad_clip": 0.0, "lr": 0.3}


def train(run_dir: Path, *, parallel=None, train=None, **sections) -> tuple[dict, dict]:
    job = digits_job(run_dir, parallel=parallel or {}, train=train or {}, **sections)
    summary = shardwise.train(job, nproc=2)
    assert summary is not None and summary.checkpoint is not None
    return losses(run_dir), load_params(summary.checkpoint)


def assert_same(got: tuple[dict, dict], want: tuple[dict, dict], atol: float = ATOL) -> None:
    (got_losses, got_params), (want_losses, want_params) = got, want
    assert sorted(got_losses) == sorted(want_losses)
    assert got_losses == pytest.approx(want_losses, rel=RTOL)
    assert got_params.keys() == want_params.keys()
    for name in want_params:
        torch.testing.assert_close(got_params[name], want_params[name], rtol=RTOL, atol=atol)
    assert want_losses[max(want_losses)] < want_losses[1] - 0.1  # training moved


def comm_metrics(run_dir: Path) -> dict[str, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "comm/bytes_per_step" in r][-1]


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    return train(tmp_path_factory.mktemp("ddp"))


def test_an_uncompressed_hierarchical_reduction_is_ddp(tmp_path, ddp):
    """On one node the hook reduces to the node's leader and broadcasts back: the same sum."""
    assert_same(train(tmp_path, parallel={"hierarchical": True}), ddp)


def test_local_sgd_every_step_is_ddp_for_a_linear_optimizer(tmp_path):
    want = train(tmp_path / "ddp", train=SGD)
    got = train(tmp_path / "local", train={**SGD, "sync": "local_sgd", "sync_every": 1})
    assert_same(got, want)


def test_diloco_with_outer_lr_1_and_no_momentum_is_local_sgd(tmp_path):
    local = {"sync": "local_sgd", "sync_every": 4}
    want = train(tmp_path / "local", train=local)
    diloco = {"sync": "diloco", "sync_every": 4, "outer_lr": 1.0, "outer_momentum": 0.0}
    assert_same(train(tmp_path / "diloco", train=diloco), want, atol=1e-6 * 10)


def test_bf16_sends_half_of_ddps_bytes_and_powersgd_its_factors(tmp_path, ddp):
    train(tmp_path / "bf16", parallel={"grad_compression": "bf16"})
    full = comm_metrics(tmp_path / "bf16")
    assert full["comm/compression_ratio"] == 2.0
    powersgd = {"grad_compression": "powersgd", "powersgd_rank": 2, "powersgd_start_step": 0}
    train(tmp_path / "powersgd", parallel=powersgd)
    got = comm_metrics(tmp_path / "powersgd")
    # the digits MLP (hidden 32): 64→32 and 32→10 matrices in factors, the biases as they are
    model = shardwise.training.job_names.build_model(digits_job(tmp_path))
    payload = sum(
        factor_bytes(p.shape, 2) or p.numel() * 4 for p in model.parameters() if p.requires_grad
    )
    assert got["comm/bytes_per_step"] == payload  # 2 ranks: an all-reduce sends 2·½ of it
    assert got["comm/compression_ratio"] == pytest.approx(full["comm/bytes_per_step"] * 2 / payload)


def test_bytes_per_step_are_the_logging_windows_not_a_mean_since_the_start(tmp_path):
    """PowerSGD reduces uncompressed for its first 10 steps: the window after them shows the
    factors' bytes alone; the mean since the start stays, under its own name."""
    powersgd = {"grad_compression": "powersgd", "powersgd_rank": 2, "powersgd_start_step": 10}
    train(tmp_path, parallel=powersgd, train={"steps": 20}, tracking={"log_every": 5})
    records = read_metrics(tmp_path / "metrics.jsonl")
    at = {r["step"]: r for r in records if "comm/bytes_per_step" in r}
    model = shardwise.training.job_names.build_model(digits_job(tmp_path))
    factors = sum(
        factor_bytes(p.shape, 2) or p.numel() * 4 for p in model.parameters() if p.requires_grad
    )
    uncompressed = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    assert at[5]["comm/bytes_per_step"] == uncompressed  # steps 1-5
    assert at[20]["comm/bytes_per_step"] == factors  # steps 16-20
    assert at[20]["comm/bytes_per_step_since_start"] == pytest.approx(
        (10 * uncompressed + 10 * factors) / 20
    )


def _full_rank_powersgd() -> list[float]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from shardwise.training.comm.hierarchical import topology
    from shardwise.training.comm.powersgd import PowerSGDSync

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 8), torch.nn.Tanh(), torch.nn.Linear(8, 5))
    reference = [p.detach().clone() for p in model.parameters()]
    ddp = DistributedDataParallel(model)
    sync = PowerSGDSync(
        [ddp],
        dist.group.WORLD,
        topology(dist.group.WORLD, 0, False),
        rank=64,
        start_step=0,
        error_feedback=True,
        seed=0,
        min_compression=0.0,
    )
    assert len(sync.qs) == 2  # both matrices compressed, at full rank
    errors = []
    for step in range(1, 4):
        torch.manual_seed(100 * step + rank)
        x, y = torch.randn(6, 12), torch.randn(6, 5)
        # the uncompressed mean gradient, from a plain copy of the same parameters
        plain = torch.nn.Sequential(torch.nn.Linear(12, 8), torch.nn.Tanh(), torch.nn.Linear(8, 5))
        with torch.no_grad():
            for p, q in zip(plain.parameters(), ddp.module.parameters(), strict=True):
                p.copy_(q)
        torch.nn.functional.mse_loss(plain(x), y).backward()
        want = [p.grad.clone() for p in plain.parameters()]
        for g in want:
            dist.all_reduce(g)
            g /= 2
        with sync.micro_batch(ddp, last=True, step=step):
            torch.nn.functional.mse_loss(ddp(x), y).backward()
        errors.append(
            max(
                float((p.grad - w).abs().max()) for p, w in zip(ddp.parameters(), want, strict=True)
            )
        )
        with torch.no_grad():
            for p in ddp.parameters():
                p -= 0.1 * p.grad
                p.grad = None
    assert reference  # (the model moved between steps, so Q's warm start was exercised)
    return errors


def test_powersgd_at_full_rank_reproduces_the_mean_gradient():
    for errors in run_distributed(_full_rank_powersgd, 2):
        assert max(errors) < 1e-5, errors


def test_fsdp_reduces_in_bf16_when_asked(tmp_path):
    """Under FSDP2 compression is the reduce-scatter's precision (MixedPrecisionPolicy's
    reduce_dtype): half the gradient bytes, the same training within bf16's rounding."""
    sharded = {"dp_shard": 2, "dp_replicate": 1}
    want = train(tmp_path / "fp32", parallel=sharded)
    got = train(tmp_path / "bf16", parallel={**sharded, "grad_compression": "bf16"})
    assert got[0] == pytest.approx(want[0], rel=1e-2)
    assert got[0] != want[0]  # the reduction did run in bf16
    fp32, bf16 = comm_metrics(tmp_path / "fp32"), comm_metrics(tmp_path / "bf16")
    # per step: the gradients' reduce-scatter (halved) and the parameters' all-gather (not)
    assert bf16["comm/bytes_per_step"] == pytest.approx(fp32["comm/bytes_per_step"] * 0.75)


NO_CLIP = {"grad_clip": 0.0}  # a worker clips its own gradient, DDP the mean: only equal unclipped


def test_async_with_no_staleness_is_ddp(tmp_path):
    want = train(tmp_path / "ddp", train=NO_CLIP)
    got = train(tmp_path / "async", train={**NO_CLIP, "sync": "async", "max_staleness": 0})
    assert_same(got, want)
    metrics = comm_metrics(tmp_path / "async")
    assert metrics["async/staleness_max"] == 0.0
    assert metrics["async/staleness_0"] == 20 * 2  # every worker's every gradient, fresh


def test_an_async_run_replays_bit_for_bit_from_its_record(tmp_path):
    """With staleness 3 which version each pull gets depends on timing; the replay serves the
    recorded ones and ends where the recorded run ended, bit for bit."""
    stale = {"sync": "async", "max_staleness": 3}
    first = train(tmp_path / "first", train=stale)
    record = tmp_path / "first" / "async_order.jsonl"
    assert len(record.read_text().splitlines()) == 20 * 2
    again = train(tmp_path / "again", train={**stale, "async_replay": str(record)})
    assert again[0] == first[0]
    for name, value in first[1].items():
        assert torch.equal(again[1][name], value), name
    replayed = (tmp_path / "again" / "async_order.jsonl").read_text()
    assert sorted(replayed.splitlines()) == sorted(record.read_text().splitlines())  # (interleaved)
    versions = [json.loads(line)["version"] for line in record.read_text().splitlines()]
    clocks = [json.loads(line)["clock"] for line in record.read_text().splitlines()]
    assert all(c + 1 - 3 <= v <= c + 1 for c, v in zip(clocks, versions, strict=True))


MODES = {
    "bf16": ({"grad_compression": "bf16"}, {}),
    "int8": ({"grad_compression": "int8"}, {}),
    "powersgd": ({"grad_compression": "powersgd", "powersgd_start_step": 2}, {}),
    "hierarchical-fp16": ({"hierarchical": True, "grad_compression": "fp16"}, {}),
    "local_sgd": ({}, {"sync": "local_sgd", "sync_every": 3}),
    "diloco": ({}, {"sync": "diloco", "sync_every": 3, "outer_compression": "int8"}),
    "async": ({}, {"sync": "async", "max_staleness": 0}),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_a_killed_rank_resumes_bitwise_in_every_mode(tmp_path, monkeypatch, mode):
    """Checkpoints every 4 steps; rank 1 is SIGKILLed in step 7 (mid-period for H = 3): the
    restarted run resumes from step 4 and ends bit for bit where the uninterrupted one ends."""
    parallel, train_section = MODES[mode]
    sections = {"checkpoint": {"every_steps": 4, "keep_last": 3}, "fault": {"max_restarts": 1}}
    want = train(tmp_path / "straight", parallel=parallel, train=train_section, **sections)
    monkeypatch.setenv("SHARDWISE_FAULT", "kill:rank=1:step=7")
    got = train(tmp_path / "killed", parallel=parallel, train=train_section, **sections)
    assert got[0] == want[0]
    for name, value in want[1].items():
        assert torch.equal(got[1][name], value), name
    ratio = comm_metrics(tmp_path / "killed")["comm/compression_ratio_since_start"]
    # on one node the hierarchical reduction has no inter-node step to compress; a parameter
    # server sends more than a ring all-reduce (every worker's parameters, from rank 0)
    if mode.startswith("hierarchical"):
        assert ratio == 1.0
    elif mode == "async":
        assert ratio == pytest.approx(1.0)  # (n − 1)·P against 2(n − 1)/n·P: 2/n
    else:
        assert ratio > 1.5


def _across_two_machines(tmp_path: Path, name: str, a, b, **sections) -> tuple[dict, dict]:
    """`shardwise train` on each of two simulated machines, 2 ranks each, as a user runs it."""
    import subprocess

    import tomli_w

    run_dir = tmp_path / name
    job = tmp_path / f"{name}.toml"
    sections["train"] = {"steps": 6, **sections.get("train", {})}
    config = digits_job(run_dir, job={"threads_per_rank": 1}, **sections)
    job.write_text(tomli_w.dumps(config.model_dump(mode="json", exclude_none=True)))
    endpoint = f"{a.addr}:{a.free_port()}"
    started = [
        shardwise_process(
            *("train", str(job), "--nproc", "2", "--nnodes", "2", "--rdzv-endpoint", endpoint),
            *("--local-addr", node.addr),
            env={"GLOO_SOCKET_IFNAME": node.interface},
            stdout=subprocess.DEVNULL,
            stderr=(tmp_path / f"{name}-{node.namespace}.err").open("w"),
            netns=node.namespace,
        )
        for node in (a, b)
    ]
    for process, node in zip(started, (a, b), strict=True):
        assert process.wait(timeout=240) == 0, (
            tmp_path / f"{name}-{node.namespace}.err"
        ).read_text()
    return losses(run_dir), load_params(run_dir / "checkpoints" / "step_00000006")


def test_every_mode_runs_across_two_machines(tmp_path):
    """Two simulated machines (network namespaces), 2 ranks each. The two-level reduction (each
    node's ranks to their leader, the leaders across the link, back inside the node) matches
    the flat all-reduce; compression applies on the link (inter-node bytes a quarter of flat's
    for int8); DiLoCo and the parameter server run across it."""
    from netns import two_nodes

    with two_nodes() as (a, b):
        flat = _across_two_machines(tmp_path, "flat", a, b, parallel={"hierarchical": False})
        two_level = _across_two_machines(tmp_path, "two-level", a, b)  # auto: on
        int8 = _across_two_machines(tmp_path, "int8", a, b, parallel={"grad_compression": "int8"})
        powersgd = {"grad_compression": "powersgd", "powersgd_start_step": 2}
        _across_two_machines(tmp_path, "powersgd", a, b, parallel=powersgd)
        local = {"sync": "local_sgd", "sync_every": 2}
        _across_two_machines(tmp_path, "local_sgd", a, b, train=local)
        diloco = {"sync": "diloco", "sync_every": 2}
        _across_two_machines(tmp_path, "diloco", a, b, train=diloco)
        _across_two_machines(tmp_path, "async", a, b, train={"sync": "async"})
    assert two_level[0] == pytest.approx(flat[0], rel=RTOL)
    for name, value in flat[1].items():
        torch.testing.assert_close(two_level[1][name], value, rtol=RTOL, atol=ATOL)
    crossing = {  # per step over the run: local SGD and DiLoCo send every other step
        n: comm_metrics(tmp_path / n)["comm/inter_node_bytes_per_step_since_start"]
        for n in ("flat", "two-level", "int8", "powersgd", "local_sgd", "diloco")
    }
    # a ring over 4 ranks carries 1.5 × the gradients off each node, the leaders' 2-rank ring 1 ×
    assert crossing["two-level"] == pytest.approx(crossing["flat"] / 1.5)
    assert crossing["int8"] < crossing["two-level"] / 3.5  # int8 values, a scale per chunk
    assert crossing["diloco"] < crossing["flat"] / 1.5  # parameters every 2 steps
    assert crossing["local_sgd"] == crossing["diloco"]
    assert crossing["powersgd"] < crossing["two-level"]
    assert int8[0][6] < int8[0][1]
    assert (tmp_path / "async" / "async_order.jsonl").exists()
