"""Live recovery in real training runs (`fault.mode = "live"`: fault/live_replica.py,
launch/live_launch.py). Three replicas split a batch of 64 as 21, 21 and 22 and train what one
process trains on the whole batch; a replica SIGKILLed after a step is not waited for: the two
left do the next step again without it, a replacement heals from them and joins, and the run
ends where one process ends. With batch norms (a ResNet), whose running statistics each
replica updates from its own samples, the replicas' buffers are averaged with the gradients and
a replacement heals to the same bytes (checked by hash)."""

from __future__ import annotations

import math
import subprocess
import time

import pytest
import torch

import command_server
import shardwise
from helpers import (
    assert_bitwise_same_run,
    digits_job,
    listening_sockets,
    load_params,
    losses,
    shardwise_process,
    write_job,
)
from shardwise.common.errors import ConfigError
from shardwise.training.checkpoint.disk_layout import problem
from shardwise.training.launch.outcome import WorkerFailed
from shardwise.training.tracking.metrics import read_metrics

pytestmark = pytest.mark.slow
STEPS = 12
# float sums in another order: the three replicas' shares of a gradient added by gloo, against
# one process's sum over the whole batch
TOLERANCE = {"rtol": 1e-4, "atol": 1e-6}


def _job(run_dir, **sections):
    base = {
        # micro-batches of 8: a replica of 21 samples runs 8, 8 and 5, weighted by their share
        "train": {
            "steps": STEPS,
            "global_batch": 64,
            "micro_batch": 8,
            "lr": 1e-2,
            "warmup_steps": 2,
        },
        "checkpoint": {"every_steps": 4},
    }
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    return digits_job(run_dir, **base)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("one")
    summary = shardwise.train(_job(run_dir), nproc=1)
    assert summary is not None and summary.checkpoint is not None
    return losses(run_dir), load_params(summary.checkpoint)


def _same(got_losses, got_params, want):
    want_losses, want_params = want
    assert sorted(got_losses) == list(range(1, STEPS + 1))  # every step once
    for step in want_losses:
        assert got_losses[step] == pytest.approx(want_losses[step], rel=1e-4), step
    for name, value in want_params.items():
        torch.testing.assert_close(
            got_params[name], value, **TOLERANCE, msg=lambda m, name=name: f"{name}: {m}"
        )


def _same_run(got, want, *, steps):
    """Two runs' directories: the same losses and final parameters, within TOLERANCE."""
    want_losses, got_losses = losses(want), losses(got)
    every = range(1, steps + 1)
    assert [got_losses[s] for s in every] == pytest.approx(
        [want_losses[s] for s in every], rel=1e-4
    )
    final = f"checkpoints/step_{steps:08d}"
    want_params, got_params = load_params(want / final), load_params(got / final)
    for name, value in want_params.items():
        torch.testing.assert_close(got_params[name], value, **TOLERANCE, msg=name)


def test_three_live_replicas_train_what_one_process_trains(tmp_path, one_process):
    summary = shardwise.train(_job(tmp_path, fault={"mode": "live"}), nproc=3)
    assert summary is not None and summary.checkpoint is not None
    _same(losses(tmp_path), load_params(summary.checkpoint), one_process)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert any(r.get("comm/bytes_per_step", 0) > 0 for r in records)


def test_live_replicas_draw_dropout_as_ddps_ranks_do(tmp_path):
    """Each replica its own dropout stream, seeded as DDP seeds the rank of its number: with
    nothing failing, a live run with dropout is DDP's run (the streams repeat nothing across
    replicas)."""
    from helpers import gpt_job

    train = {"steps": 6, "global_batch": 16, "micro_batch": 4}
    ddp, live = tmp_path / "ddp", tmp_path / "live"
    shardwise.train(gpt_job(ddp, train=train, checkpoint={"every_steps": 6}), nproc=2)
    config = gpt_job(live, train=train, checkpoint={"every_steps": 6}, fault={"mode": "live"})
    shardwise.train(config, nproc=2)
    _same_run(live, ddp, steps=6)


def test_a_slow_replica_is_named_a_straggler(tmp_path, monkeypatch):
    """Each replica is a world of its own: their batch fetch + forward times meet in the
    coordinator's store, and the reporting replica names the one that is slow."""
    monkeypatch.setenv("SHARDWISE_FAULT", "slow:rank=2:step=1:seconds=0.05")
    fault = {"mode": "live", "check_interval_s": 0.1, "straggler_windows": 2}
    shardwise.train(_job(tmp_path, fault=fault), nproc=3)
    records = read_metrics(tmp_path / "metrics.jsonl")
    named = {k for r in records for k in r if k.startswith("straggler/")}
    assert named == {"straggler/replica2"}


def test_a_killed_replica_is_not_waited_for_and_its_replacement_heals(
    tmp_path, monkeypatch, one_process
):
    # replica 1 dies after step 3; replica 0 is slowed so that the replacement (a new process,
    # seconds to start) joins while the run still has steps to go
    monkeypatch.setenv("SHARDWISE_FAULT", "kill:rank=1:step=3,slow:rank=0:step=1:seconds=0.4")
    fault = {"mode": "live", "max_restarts": 1, "timeout_s": 60}
    config = _job(tmp_path, fault=fault, tracking={"report": True})
    summary = shardwise.train(config, nproc=3)
    assert summary is not None and summary.checkpoint is not None
    _same(losses(tmp_path), load_params(summary.checkpoint), one_process)
    report = (tmp_path / "report" / "report.html").read_text()
    assert "live: 1 replica lost, detected in" in report
    assert "live: replica 0 healed 1 replacement" in report
    records = read_metrics(tmp_path / "metrics.jsonl")
    lost = [r for r in records if "live/detected_s" in r]
    assert [r["step"] for r in lost] == [4]
    # 2 replicas redo the step, or 3 where the replacement (forked: a fraction of a second)
    # was ready by then and healed inside it
    assert lost[0]["live/replicas"] in (2.0, 3.0)
    assert math.isfinite(lost[0]["live/detected_s"])  # measured; bench/ judges its speed
    assert any("live/stall_s" in r for r in records)
    healed = [r for r in records if "live/heal_bytes" in r]
    assert len(healed) == 1 and healed[0]["live/replicas"] == 3.0
    assert healed[0]["live/heal_bytes"] > 0
    assert not (tmp_path / "hangs").exists()


POINTS = {
    # replica 1 dies at a point of step 5 (its peers: before, inside or after their all-reduce)
    "before_forward": "kill:rank=1:step=5:at=before_forward",
    "inside the all-reduce": "kill:rank=1:step=5:at=reduce",
    "after the all-reduce, before the optimizer": "kill:rank=1:step=5:at=after_reduce",
    # the reporting replica, before it logs a step the others commit: replica 1 logs it
    "reporting, after the all-reduce": "kill:rank=0:step=5:at=after_reduce",
    # replica 2 dies after step 3; then replica 1 dies forming the generation without it
    "re-forming": "kill:rank=2:step=3,kill:rank=1:step=4:at=reform",
    # replica 2 dies; replica 0, healing its replacement, dies sending
    "healing, the sender": "kill:rank=2:step=3,kill:rank=0:step=4:at=heal_send",
    # replica 2 dies; its replacement dies receiving
    "healing, the receiver": "kill:rank=2:step=3,kill:rank=2:step=1:at=heal_receive",
}


@pytest.mark.parametrize("point", list(POINTS))
def test_a_replica_killed_anywhere_in_a_step_or_a_heal_costs_nothing(
    tmp_path, monkeypatch, one_process, point
):
    """Whatever the point a replica dies at, the others go on, replacements heal, and the run
    ends where one process ends: no step lost or done twice, no sample lost or read twice."""
    monkeypatch.setenv("SHARDWISE_FAULT", f"{POINTS[point]},slow:rank=0:step=1:seconds=0.4")
    config = _job(tmp_path, fault={"mode": "live", "max_restarts": 3, "timeout_s": 60})
    summary = shardwise.train(config, nproc=3)
    assert summary is not None and summary.checkpoint is not None
    _same(losses(tmp_path), load_params(summary.checkpoint), one_process)
    assert not (tmp_path / "hangs").exists()


REPLAYED = {
    "after step 3": "kill:rank=2:step=3",
    "before the forward pass of step 4": "kill:rank=2:step=4:at=before_forward",
    "inside the all-reduce of step 4": "kill:rank=2:step=4:at=reduce",
    "after the all-reduce of step 4, before the optimizer": "kill:rank=2:step=4:at=after_reduce",
    # replica 2 dies after step 3 and is replaced; replica 1 dies forming the generation that
    # leaves 2 out, or replica 0 while it heals the replacement, or the replacement itself
    "re-forming": "kill:rank=2:step=3,kill:rank=1:step=4:at=reform",
    "healing, the sender": "kill:rank=2:step=3,kill:rank=0:step=4:at=heal_send",
    "healing, the receiver": "kill:rank=2:step=3,kill:rank=2:step=1:at=heal_receive",
}


def _membership(records: list[dict]) -> list[tuple[int, int]]:
    """A live run's membership as its metrics recorded it: (the first step, replicas) of each
    stretch of steps done by the same number of replicas."""
    replicas = {1: 3}
    for r in records:  # each change at the first step its membership does, in order
        if "live/detected_s" in r or "live/heal_bytes" in r:
            replicas[r["step"]] = int(r["live/replicas"])
    stretches: list[tuple[int, int]] = []
    for step, count in sorted(replicas.items()):
        if not stretches or stretches[-1][1] != count:
            stretches.append((step, count))
    return stretches


def _replay(run_dir, membership, sections, monkeypatch) -> None:
    """`membership` without a failure: each stretch a run of its number of replicas from the
    checkpoint of the step before it, every replica stopped before the next stretch's first
    step (a synchronous save every step: that step's checkpoint is written by then)."""
    for index, (first, count) in enumerate(membership):
        resume = "never" if first == 1 else str(run_dir / "checkpoints" / f"step_{first - 1:08d}")
        if index + 1 < len(membership):
            stop = membership[index + 1][0]
            monkeypatch.setenv("SHARDWISE_FAULT", f"kill:step={stop}:at=before_forward")
            with pytest.raises(WorkerFailed):
                shardwise.train(_job(run_dir, **sections), nproc=count, resume=resume)
        else:
            monkeypatch.delenv("SHARDWISE_FAULT", raising=False)
            shardwise.train(_job(run_dir, **sections), nproc=count, resume=resume)


@pytest.mark.parametrize("point", list(REPLAYED))
def test_a_kill_is_bit_for_bit_the_run_its_membership_makes_without_one(
    tmp_path, monkeypatch, point
):
    """Replicas die wherever they die (one replaced, when `max_restarts` allows), and the
    others go on: from the step a replica died in, or the next where its all-reduce had
    completed everywhere (the step committed by three). The same membership without a
    failure, read from the killed run's metrics, replayed from checkpoints (three replicas to
    the last step they committed, two resumed from it, and so on): the losses of every step
    and the final parameters are the same bits."""
    checkpoint = {"every_steps": 1, "async": False}
    restarts = 2 if "heal" in REPLAYED[point] or "reform" in REPLAYED[point] else 0
    fault = {"mode": "live", "max_restarts": restarts, "timeout_s": 60}
    sections = {"fault": fault, "checkpoint": checkpoint}
    killed = tmp_path / "killed"
    monkeypatch.setenv("SHARDWISE_FAULT", f"{REPLAYED[point]},slow:rank=0:step=1:seconds=0.1")
    shardwise.train(_job(killed, **sections), nproc=3)
    membership = _membership(read_metrics(killed / "metrics.jsonl"))
    # with no restart two are left; with replacements healed inside the step the others were
    # doing again, every step may have been done by three
    assert membership[-1][1] == 2 if not restarts else membership[0] == (1, 3), membership
    _replay(tmp_path / "replay", membership, sections, monkeypatch)
    assert_bitwise_same_run(tmp_path / "replay", killed, STEPS)


def test_a_replica_whose_all_reduce_failed_where_its_peers_completed_takes_their_step(
    tmp_path, monkeypatch, one_process
):
    """Replica 2 dies as its all-reduce of step 5 ends: replica 1's completes, replica 0's
    (which reports) fails, as gloo's ring leaves them (`lose`). Replica 1 commits step 5 and
    replica 0 does not: in the next generation replica 0 is behind, receives replica 1's state
    and goes on from step 6 with it (the rule is the highest committed step), never doing step
    5 again on top of replica 1's step 6."""
    faults = "lose:rank=0:step=5,kill:rank=2:step=5:at=after_reduce,slow:rank=0:step=1:seconds=0.4"
    monkeypatch.setenv("SHARDWISE_FAULT", faults)
    config = _job(tmp_path, fault={"mode": "live", "max_restarts": 1, "timeout_s": 60})
    summary = shardwise.train(config, nproc=3)
    assert summary is not None and summary.checkpoint is not None
    _same(losses(tmp_path), load_params(summary.checkpoint), one_process)
    records = read_metrics(tmp_path / "metrics.jsonl")
    behind = [r for r in records if "live/behind_steps" in r]
    assert [(r["step"], r["live/behind_steps"]) for r in behind] == [(5, 1.0)]
    assert not (tmp_path / "hangs").exists()


def test_when_the_reporting_replica_dies_the_one_that_reports_on_saves(
    tmp_path, monkeypatch, one_process
):
    """Replica 0 reports and saves; it dies after step 2, replica 1 reports from then on, and
    the summary names the final checkpoint, which it saves, even once replica 0's replacement
    (the lowest slot again) has joined."""
    monkeypatch.setenv("SHARDWISE_FAULT", "kill:rank=0:step=2,slow:rank=1:step=1:seconds=0.4")
    fault = {"mode": "live", "max_restarts": 1, "timeout_s": 60}
    config = _job(tmp_path, fault=fault, tracking={"mlflow": True})
    summary = shardwise.train(config, nproc=3)
    assert summary is not None and summary.checkpoint is not None
    assert summary.checkpoint.endswith(f"step_{STEPS:08d}")
    # the MLflow run the first replica opened, reopened by the one that took over, and closed
    from mlflow.tracking import MlflowClient

    assert summary.mlflow_run_id is not None
    tracked = MlflowClient(config.tracking_uri).get_run(summary.mlflow_run_id)
    assert tracked.info.status == "FINISHED"
    assert tracked.data.metrics["loss"] == pytest.approx(losses(tmp_path)[STEPS])
    _same(losses(tmp_path), load_params(summary.checkpoint), one_process)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["live/heal_source"] for r in records if "live/heal_bytes" in r] == [1.0]


def test_a_lone_replica_commits_nothing_until_its_peer_is_replaced(
    tmp_path, monkeypatch, one_process
):
    """Two replicas, one killed: the other is below fault.min_replicas (2) and waits for the
    replacement, heals it inside the step, and the two do the step together."""
    monkeypatch.setenv("SHARDWISE_FAULT", "kill:rank=1:step=3")
    config = _job(tmp_path, fault={"mode": "live", "max_restarts": 1, "timeout_s": 60})
    summary = shardwise.train(config, nproc=2)
    assert summary is not None and summary.checkpoint is not None
    _same(losses(tmp_path), load_params(summary.checkpoint), one_process)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records if "live/waited_s" in r] in ([4], [])  # [] if it was ready
    # one left, which commits step 4 only with the replacement healed inside it
    assert [(r["step"], r["live/replicas"]) for r in records if "live/detected_s" in r] == [
        (4, 1.0)
    ]
    assert [(r["step"], r["live/replicas"]) for r in records if "live/heal_bytes" in r] == [
        (4, 2.0)
    ]


def test_with_no_restart_left_the_others_go_on_while_enough_are_left(
    tmp_path, monkeypatch, one_process
):
    monkeypatch.setenv("SHARDWISE_FAULT", "kill:rank=2:step=5")
    summary = shardwise.train(_job(tmp_path, fault={"mode": "live"}), nproc=3)
    assert summary is not None and summary.checkpoint is not None
    _same(losses(tmp_path), load_params(summary.checkpoint), one_process)


def test_below_the_minimum_with_no_restart_left_the_run_fails_its_checkpoints_intact(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("SHARDWISE_FAULT", "kill:rank=1:step=6")
    with pytest.raises(WorkerFailed, match=r"replica 1 died .*fewer than fault\.min_replicas"):
        shardwise.train(_job(tmp_path, fault={"mode": "live"}), nproc=2)
    assert problem(tmp_path / "checkpoints" / "step_00000004") is None


@pytest.mark.parametrize("hang", ["stall", "stop"])
def test_a_hung_replica_is_evicted_after_the_timeout_and_replaced(
    tmp_path, monkeypatch, one_process, hang
):
    """Replica 1 stops making progress after step 4: its training thread stalls (alive,
    silent), or the whole process is SIGSTOPped (every thread of it frozen). The others'
    all-reduce times out after fault.timeout_s, they say they are alive, the supervisor kills
    the silent one, and its replacement heals and joins."""
    monkeypatch.setenv("SHARDWISE_FAULT", f"{hang}:rank=1:step=4,slow:rank=0:step=1:seconds=0.5")
    config = _job(tmp_path, fault={"mode": "live", "max_restarts": 1, "timeout_s": 4})
    summary = shardwise.train(config, nproc=3)
    assert summary is not None and summary.checkpoint is not None
    _same(losses(tmp_path), load_params(summary.checkpoint), one_process)
    records = read_metrics(tmp_path / "metrics.jsonl")
    lost = [r for r in records if "live/detected_s" in r]
    assert [r["step"] for r in lost] == [5]
    assert [r["live/replicas"] for r in records if "live/heal_bytes" in r] == [3.0]
    assert not (tmp_path / "hangs").exists()  # no survivor's watchdog fired


def test_a_replica_whose_state_silently_changed_is_caught_at_the_next_checkpoint_step(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("SHARDWISE_FAULT", "corrupt:rank=1:step=5")
    with pytest.raises(WorkerFailed, match="the replicas' states differ after step 8"):
        shardwise.train(_job(tmp_path, fault={"mode": "live"}), nproc=3)
    assert problem(tmp_path / "checkpoints" / "step_00000004") is None
    assert not (tmp_path / "checkpoints" / "step_00000008").exists()


def test_batch_norms_heal_to_the_same_bytes(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDWISE_FAULT", "kill:rank=2:step=2,slow:rank=0:step=1:seconds=0.5")
    resnet = {"name": "resnet", "args": {"depth": 18, "width": 4, "channels": 1}}
    fault = {"mode": "live", "max_restarts": 1, "timeout_s": 60}
    summary = shardwise.train(_job(tmp_path, model=resnet, fault=fault), nproc=3)
    assert summary is not None and summary.checkpoint is not None
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["live/replicas"] for r in records if "live/heal_bytes" in r] == [3.0]
    params = load_params(summary.checkpoint)
    running = [v for k, v in params.items() if k.endswith("running_var")]
    assert running and all(torch.isfinite(v).all() and (v > 0).all() for v in running)


def test_a_live_runs_checkpoint_resumes_on_another_number_of_replicas(
    tmp_path, monkeypatch, one_process
):
    """The whole job dies after step 9 on 3 live replicas (every one killed); it resumes from
    the checkpoint of step 8 on 2, and ends where one process ends."""
    monkeypatch.setenv("SHARDWISE_FAULT", "kill:step=9")
    with pytest.raises(WorkerFailed):
        shardwise.train(_job(tmp_path, fault={"mode": "live"}), nproc=3)
    monkeypatch.delenv("SHARDWISE_FAULT")
    summary = shardwise.train(_job(tmp_path, fault={"mode": "live"}), nproc=2, resume="auto")
    assert summary is not None and summary.checkpoint is not None
    _same(losses(tmp_path), load_params(summary.checkpoint), one_process)


def test_hsdp_replicas_of_two_fsdp_ranks_train_what_one_process_trains(tmp_path, one_process):
    """Two replicas of two processes each (FSDP inside a replica, live recovery across): each
    process reads 16 of the 64 samples, each replica's gradients are its FSDP ranks' mean, and
    the replicas' shards are summed rank by rank."""
    config = _job(tmp_path, fault={"mode": "live"}, parallel={"dp_shard": 2})
    summary = shardwise.train(config, nproc=4)
    assert summary is not None and summary.checkpoint is not None
    _same(losses(tmp_path), load_params(summary.checkpoint), one_process)


HSDP_KILLS = {
    # rank = replica × 2 + its process
    "replica 1's second process, after step 3": ("kill:rank=3:step=3", 4),
    "replica 1's first process, inside the all-reduce": ("kill:rank=2:step=5:at=reduce", 5),
    # the reporting replica: replica 1 reports (and saves) from then on
    "replica 0's second process, after the all-reduce": ("kill:rank=1:step=5:at=after_reduce", 6),
}


@pytest.mark.parametrize("killed", [False, True])
def test_replicas_of_two_tensor_parallel_ranks_train_what_restart_mode_trains(
    tmp_path, monkeypatch, killed
):
    """Tensor parallelism inside the replicas: two replicas of two processes that read the same
    samples and hold half of each large layer; their shards are summed rank by rank. The same
    run as the default mode's on the same layout (tp = 2, two data-parallel replicas), also
    where replica 0's second process dies after step 2 and its replacement heals, shard by
    shard."""
    from helpers import gpt_job

    train = {"steps": 6, "global_batch": 16, "micro_batch": 4}
    model = {"name": "gpt", "args": {"layers": 2, "heads": 2, "hidden": 32, "seq_len": 32}}
    sections = {"train": train, "model": model, "parallel": {"tp": 2}}
    restart, live = tmp_path / "restart", tmp_path / "live"
    shardwise.train(gpt_job(restart, checkpoint={"every_steps": 6}, **sections), nproc=4)
    if killed:
        monkeypatch.setenv("SHARDWISE_FAULT", "kill:rank=1:step=2")
    fault = {"mode": "live", "max_restarts": 1, "timeout_s": 60}
    config = gpt_job(live, checkpoint={"every_steps": 6}, fault=fault, **sections)
    shardwise.train(config, nproc=4)
    if killed:
        records = read_metrics(live / "metrics.jsonl")
        assert [r["step"] for r in records if "live/heal_bytes" in r] == [3]
    _same_run(live, restart, steps=6)


@pytest.mark.parametrize("fault", ["", "kill:rank=3:step=4"])
def test_replicas_of_two_pipeline_stages_train_what_one_process_trains(
    tmp_path, monkeypatch, one_process, fault
):
    """Three replicas of a two-stage pipeline (1F1B): each step's 8 micro-batches of 8 are
    split 2, 3, 3 over them and each replica's schedule runs its own count. With the second
    stage of replica 1 killed after step 4, the two left run 4 each, the replacement's two
    stages heal from replica 0's, and the schedule goes back to 2 and 3."""
    monkeypatch.setenv("SHARDWISE_FAULT", f"{fault},slow:rank=0:step=1:seconds=0.2".lstrip(","))
    fault_section = {"mode": "live", "max_restarts": 1, "timeout_s": 60}
    config = _job(tmp_path, parallel={"pp": 2}, fault=fault_section)
    summary = shardwise.train(config, nproc=6)
    assert summary is not None and summary.checkpoint is not None
    _same(losses(tmp_path), load_params(summary.checkpoint), one_process)
    records = read_metrics(tmp_path / "metrics.jsonl")
    lost = [r for r in records if "live/detected_s" in r]
    assert [r["step"] for r in lost] == ([5] if fault else [])
    assert not (tmp_path / "hangs").exists()


def test_replicas_of_fsdp_pipelines_give_each_fsdp_rank_as_many_micro_batches(tmp_path):
    """Two replicas, each a 2-stage pipeline (GPipe) on 2 FSDP ranks, whose collectives run
    per micro-batch: a step's 48 samples are 6 micro-batches of 8, split over the replicas in
    pairs (one for each FSDP rank), 2 pairs and 1, never 1, 2, 1, 2 (which hangs: FSDP ranks
    of one replica waiting in different micro-batches). The run is the one one process makes
    on the whole batch."""
    train = {"global_batch": 48}
    reference = shardwise.train(_job(tmp_path / "one", train=train), nproc=1)
    assert reference is not None and reference.checkpoint is not None
    parallel = {"pp": 2, "dp_shard": 2, "pipeline_schedule": "GPipe"}
    config = _job(tmp_path / "live", train=train, parallel=parallel, fault={"mode": "live"})
    summary = shardwise.train(config, nproc=8)
    assert summary is not None and summary.checkpoint is not None
    want = (losses(tmp_path / "one"), load_params(reference.checkpoint))
    _same(losses(tmp_path / "live"), load_params(summary.checkpoint), want)


def test_replicas_of_pipelines_with_tensor_parallel_stages_train_what_restart_mode_trains(
    tmp_path,
):
    """Two replicas of a 2-stage pipeline whose stages are tensor-parallel over 2 processes
    (8 in all): the same run as the default mode's on the same layout."""
    from helpers import gpt_job

    train = {"steps": 6, "global_batch": 16, "micro_batch": 4}
    model = {"name": "gpt", "args": {"layers": 2, "heads": 2, "hidden": 32, "seq_len": 32}}
    sections = {"train": train, "model": model, "parallel": {"tp": 2, "pp": 2}}
    restart, live = tmp_path / "restart", tmp_path / "live"
    shardwise.train(gpt_job(restart, checkpoint={"every_steps": 6}, **sections), nproc=8)
    config = gpt_job(live, checkpoint={"every_steps": 6}, fault={"mode": "live"}, **sections)
    shardwise.train(config, nproc=8)
    _same_run(live, restart, steps=6)


@pytest.mark.parametrize("kill", list(HSDP_KILLS))
def test_hsdp_a_killed_rank_takes_its_replica_down_and_the_replacement_heals_rank_by_rank(
    tmp_path, monkeypatch, one_process, kill
):
    """A process of a replica of two dies: its sibling is killed with it, the other replica
    (alone, below fault.min_replicas) waits, a replacement replica of two processes heals from
    it, each process from its counterpart, and the run ends where one process ends."""
    fault, detected = HSDP_KILLS[kill]
    monkeypatch.setenv("SHARDWISE_FAULT", fault)
    config = _job(
        tmp_path, fault={"mode": "live", "max_restarts": 1, "timeout_s": 60},
        parallel={"dp_shard": 2},
    )  # fmt: skip
    summary = shardwise.train(config, nproc=4)
    assert summary is not None and summary.checkpoint is not None
    _same(losses(tmp_path), load_params(summary.checkpoint), one_process)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records if "live/detected_s" in r] == [detected]
    healed = [r for r in records if "live/heal_bytes" in r]
    assert len(healed) == 1 and healed[0]["live/replicas"] == 2.0
    assert not (tmp_path / "hangs").exists()


@pytest.mark.parametrize(
    ("nproc", "sections", "why"),
    [
        (2, {"train": {"sync": "local_sgd", "sync_every": 2}}, "reduces gradients every step"),
        (3, {"parallel": {"dp_shard": 2}}, "use a multiple of it"),
        (4, {"parallel": {"pp": 2, "pipeline_schedule": "Interleaved1F1B"}}, "GPipe and 1F1B"),
        (8, {"parallel": {"pp": 2}, "train": {"global_batch": 24}}, "fewer than the 2 1F1B needs"),
    ],
)
def test_live_mode_refuses_what_it_cannot_run(tmp_path, nproc, sections, why):
    config = _job(tmp_path, fault={"mode": "live"}, **sections)
    with pytest.raises(ConfigError, match=rf"fault\.mode = 'live' .*{why}"):
        shardwise.train(config, nproc=nproc)


def _live_on_two_nodes(tmp_path, faults, fault, *, during=None):
    """`shardwise train` of the digits job in live mode on two simulated machines (network
    namespaces joined by a veth pair), two replicas on each, the coordinator on node a;
    `during(a, b, run_dir)` runs while they train. The two commands' exit codes and outputs."""
    from netns import two_nodes

    run_dir = tmp_path / "run"
    job = write_job(_job(run_dir, fault=fault), tmp_path / "job.toml")
    with two_nodes() as (a, b):
        endpoint = f"{a.addr}:{a.free_port()}"
        started = [
            shardwise_process(
                *("train", str(job), "--nproc", "2", "--nnodes", "2", "--rdzv-endpoint", endpoint),
                *("--local-addr", node.addr),
                env={"GLOO_SOCKET_IFNAME": node.interface, "SHARDWISE_FAULT": faults},
                stdout=(tmp_path / f"{name}.out").open("w"),
                stderr=(tmp_path / f"{name}.err").open("w"),
                netns=node.namespace,
            )
            for name, node in (("a", a), ("b", b))
        ]
        listening = set()  # what each node listens on while the job runs
        deadline = time.monotonic() + 240
        while any(p.poll() is None for p in started) and time.monotonic() < deadline:
            for process in started:
                listening.update((s[0], s[1]) for s in listening_sockets(process.pid))
            if during is not None and during(a, b, run_dir):
                during = None
            time.sleep(0.2)
        codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in started]
        outputs = [(tmp_path / f"{n}.out").read_text() + (tmp_path / f"{n}.err").read_text()
                   for n in "ab"]  # fmt: skip
    # the coordinator's store and the replicas' gloo groups, on the nodes' own addresses only
    assert listening and {address for address, _ in listening} <= {a.addr, b.addr}
    return run_dir, codes, outputs


def test_live_replicas_on_two_machines_replace_a_dead_one_on_its_own_machine(tmp_path, one_process):
    """Four replicas, two per machine: replica 3 (on node b) dies after step 4; node b's
    supervisor starts its replacement when the coordinator on node a says so, it heals from
    a live replica across the link, and the run ends where one process ends."""
    fault = {"mode": "live", "max_restarts": 1, "timeout_s": 60}
    run_dir, codes, outputs = _live_on_two_nodes(
        tmp_path, "kill:rank=3:step=4,slow:rank=0:step=1:seconds=0.3", fault
    )
    assert codes == [0, 0], outputs
    assert "done: step 12" in outputs[0] and "done: step" not in outputs[1]
    _same(losses(run_dir), load_params(run_dir / "checkpoints" / "step_00000012"), one_process)
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records if "live/detected_s" in r] == [5]
    healed = [r for r in records if "live/heal_bytes" in r]
    assert len(healed) == 1 and healed[0]["live/replicas"] == 4.0


def test_when_a_machine_is_lost_the_replicas_on_the_others_go_on(tmp_path, one_process):
    """Node b (its supervisor and both its replicas) is SIGKILLed whole after step 4, as a
    machine that loses power: the coordinator sees its heartbeat stop, the two replicas on
    node a go on without restarting (none can be started there), and the run ends where one
    process ends."""

    def lose_b(a, b, run_dir):
        try:
            records = read_metrics(run_dir / "metrics.jsonl")
        except (OSError, ValueError):  # not there yet, or a line being written
            return False
        if not any(r["step"] >= 4 for r in records):
            return False
        b.kill_everything()
        return True

    fault = {"mode": "live", "max_restarts": 2, "timeout_s": 60}
    run_dir, codes, outputs = _live_on_two_nodes(
        tmp_path, "slow:rank=0:step=1:seconds=0.3", fault, during=lose_b
    )
    assert codes[0] == 0, outputs
    assert "done: step 12" in outputs[0]
    _same(losses(run_dir), load_params(run_dir / "checkpoints" / "step_00000012"), one_process)
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["live/replicas"] for r in records if "live/detected_s" in r] == [2.0]
    assert not [r for r in records if "live/heal_bytes" in r]


def test_nodes_of_a_live_job_given_different_nproc_each_say_so_in_one_line(tmp_path):
    """Node b runs 4 replicas where node a, which hosts the coordinator, runs 2: node b says
    so and ends; node a says which nodes never came, after fault.timeout_s. Exit 2 both."""
    from netns import two_nodes

    config = _job(tmp_path / "run", fault={"mode": "live", "timeout_s": 5})
    job = write_job(config, tmp_path / "job.toml")
    with two_nodes() as (a, b):
        endpoint = f"{a.addr}:{a.free_port()}"
        started = [
            shardwise_process(
                *("train", str(job), "--nproc", nproc, "--nnodes", "2"),
                *("--rdzv-endpoint", endpoint, "--local-addr", node.addr),
                env={"GLOO_SOCKET_IFNAME": node.interface},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                netns=node.namespace,
            )
            for node, nproc in ((a, "2"), (b, "4"))
        ]
        done = [command_server.completed(p, 60) for p in started]
    assert [d.returncode for d in done] == [2, 2], done
    assert "1 of 2 nodes came to" in done[0].stderr and "Traceback" not in done[0].stderr
    assert "this node runs 4 replica(s) and the first node 2" in done[1].stderr
    assert "Traceback" not in done[1].stderr
