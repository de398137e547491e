"""Fault tolerance, by injecting real faults (SHARDWISE_FAULT) into real 2-rank runs: a SIGKILLed
rank is restarted and the run ends bitwise where an uninterrupted one ends; NaN gradients are
skipped or stop the run with the step named; SIGTERM saves at a step boundary and exits 0.
"""

from __future__ import annotations

import math
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

import shardwise
from helpers import (
    SHARDWISE,
    digits_job,
    gpt_job,
    listening_sockets,
    load_params,
    losses,
    ranks_of,
    shardwise_command,
    shardwise_process,
    write_job,
)
from shardwise.training.checkpoint.disk_layout import problem
from shardwise.training.checkpoint.export import export_safetensors, load_exported
from shardwise.training.config.schema import JobConfig
from shardwise.training.tracking.metrics import read_metrics

pytestmark = pytest.mark.slow
SECTIONS = {
    "checkpoint": {"every_steps": 4, "keep_last": 3},
    "fault": {"max_restarts": 2},
    # the profile window over steps 6-9, which the kills at step 7 and the SIGTERMs at step 6
    # fall into: a process that ends inside it, or restarts into it, ends and resumes cleanly
    "tracking": {"profile_step": 6, "profile_steps": 4},
}
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference: 16 steps on 2 ranks, checkpoints every 4, no faults."""
    run_dir = tmp_path_factory.mktemp("straight")
    summary = shardwise.train(gpt_job(run_dir, train={"steps": 16}, **SECTIONS), nproc=2)
    assert summary is not None and summary.checkpoint is not None
    return losses(run_dir), load_params(summary.checkpoint), run_dir


def test_killed_ranks_restart_and_end_bitwise_identical(tmp_path, monkeypatch, uninterrupted):
    """Three runs, each with a random rank SIGKILLed at a random step: each restarts from its
    newest checkpoint and ends with the uninterrupted run's parameters and losses, bit for bit."""
    want_losses, want_params, _ = uninterrupted
    rng = random.Random(20261122)
    for attempt in range(3):
        rank, step = rng.randrange(2), rng.randrange(2, 15)
        monkeypatch.setenv("SHARDWISE_FAULT", f"kill:rank={rank}:step={step}")
        run_dir = tmp_path / f"run{attempt}"
        summary = shardwise.train(gpt_job(run_dir, train={"steps": 16}, **SECTIONS), nproc=2)
        assert summary is not None and summary.checkpoint is not None
        records = read_metrics(run_dir / "metrics.jsonl")
        restarts = [r for r in records if "fault/restarts" in r]
        assert restarts and restarts[-1]["step"] == step // 4 * 4, (rank, step)
        got = losses(run_dir)
        assert [got[s] for s in range(1, 17)] == [want_losses[s] for s in range(1, 17)]
        for name, value in want_params.items():
            assert torch.equal(load_params(summary.checkpoint)[name], value), (name, rank, step)


def test_nan_gradients_are_skipped_and_counted(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDWISE_FAULT", "nan:step=5")
    sections = {
        "checkpoint": {"every_steps": 1, "keep_last": 10},
        "fault": {"on_nonfinite": "skip"},
    }
    summary = shardwise.train(gpt_job(tmp_path, train={"steps": 7}, **sections), nproc=2)
    assert summary is not None
    checkpoints = tmp_path / "checkpoints"
    before, at, after = (load_params(checkpoints / f"step_0000000{s}") for s in (4, 5, 6))
    for name in before:
        assert torch.equal(before[name], at[name]), name  # step 5's update was not applied
    assert any(not torch.equal(at[n], after[n]) for n in at)  # step 6's was
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["fault/skipped_steps"] for r in records if "fault/skipped_steps" in r] == [1.0]
    assert all(torch.isfinite(v).all() for v in after.values())


def test_nan_gradients_stop_the_run_naming_the_step(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDWISE_FAULT", "nan:step=5")
    sections = {"checkpoint": {"every_steps": 4}}
    with pytest.raises(shardwise.WorkerFailed, match="step 5: the gradient norm is nan") as info:
        shardwise.train(gpt_job(tmp_path, train={"steps": 8}, **sections), nproc=2)
    assert "saved the state before it as step_00000005" in str(info.value)
    saved, good = (load_params(tmp_path / "checkpoints" / f"step_0000000{s}") for s in (5, 4))
    assert all(torch.equal(saved[n], good[n]) for n in good)


def test_nan_found_at_a_later_log_step_is_stopped_at_its_own_step(tmp_path, monkeypatch):
    """The device keeps the verdict until the next reporting step (step 8 here): no update
    after the bad step 5 is applied, and the checkpoint saved holds the state before it with
    step 5's data position and schedule; resuming from it trains steps 6-8 bitwise as the run
    that skipped step 5 did."""
    monkeypatch.setenv("SHARDWISE_FAULT", "nan:step=5")
    job = {"train": {"steps": 8}, "checkpoint": {"every_steps": 4}, "tracking": {"log_every": 4}}
    with pytest.raises(shardwise.WorkerFailed) as info:
        shardwise.train(digits_job(tmp_path / "stop", **job), nproc=2)
    assert "step 5: the gradient norm is nan" in str(info.value)
    assert "(found at step 8; no update after it was applied)" in str(info.value)
    assert "saved the state before it as step_00000005" in str(info.value)
    checkpoints = tmp_path / "stop" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_00000004", "step_00000005"]
    saved, good = (load_params(checkpoints / f"step_0000000{s}") for s in (5, 4))
    assert all(torch.equal(saved[n], good[n]) for n in good)

    skip = {"train": {"steps": 8}, "fault": {"on_nonfinite": "skip"}}
    shardwise.train(digits_job(tmp_path / "skip", **skip), nproc=2)
    monkeypatch.delenv("SHARDWISE_FAULT")
    resumed = shardwise.train(
        digits_job(tmp_path / "stop", train={"steps": 8}), nproc=2, resume="auto"
    )
    assert resumed is not None and resumed.resumed_from == 5
    want, got = losses(tmp_path / "skip"), losses(tmp_path / "stop")
    assert [got[s] for s in (6, 7, 8)] == [want[s] for s in (6, 7, 8)]


def test_skipped_steps_are_counted_at_the_log_step(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDWISE_FAULT", "nan:step=5,nan:step=6")
    job = {"fault": {"on_nonfinite": "skip"}, "tracking": {"log_every": 4}}
    summary = shardwise.train(digits_job(tmp_path, train={"steps": 12}, **job), nproc=2)
    assert summary is not None
    records = read_metrics(tmp_path / "metrics.jsonl")
    counted = [(r["step"], r["fault/skipped_steps"]) for r in records if "fault/skipped_steps" in r]
    assert counted == [(8, 2.0)]
    assert all(math.isfinite(r["loss"]) for r in records if "loss" in r)


def _train_on_two_ranks(tmp_path: Path, config: JobConfig) -> list[str]:
    """The `shardwise train` command of `config` (written to job.toml) on 2 ranks."""
    return [SHARDWISE, "train", str(write_job(config, tmp_path / "job.toml")), "--nproc", "2"]


GRACE_S = 25
"""Less than a scheduler's grace between SIGTERM and SIGKILL (Slurm's KillWait and Kubernetes'
terminationGracePeriodSeconds: 30 s by default), from the ranks' save to the launcher's exit."""


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_sigterm_saves_at_a_step_boundary_exits_0_and_resumes_exactly(
    tmp_path, uninterrupted, asynchronous
):
    """The launcher gets SIGTERM (as from a scheduler) after step 6: the ranks agree on a step,
    save there, and `shardwise train` exits 0 within a scheduler's grace period (not after torch
    elastic's 30 s wait for ranks that have stopped); `--resume auto` then ends bitwise like the
    uninterrupted run. With synchronous and asynchronous checkpoints (the SIGTERM's save is
    committed before the ranks stop either way)."""
    want_losses, want_params, _ = uninterrupted
    sections = {
        **SECTIONS,
        "checkpoint": {**SECTIONS["checkpoint"], "async": asynchronous},
        "fault": {**SECTIONS["fault"], "check_interval_s": 0},
    }
    command = _train_on_two_ranks(
        tmp_path, gpt_job(tmp_path / "run", train={"steps": 16}, **sections)
    )
    env = {**os.environ, "SHARDWISE_FAULT": "sigterm:step=6"}
    stderr = tmp_path / "stderr"
    with stderr.open("w") as err:
        first = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err, text=True
        )
        assert first.stdout is not None
        printed = []
        for line in first.stdout:  # until rank 0 has saved on the SIGTERM
            printed.append(line)
            if "and stopping" in line:
                break
        try:
            rest, _ = first.communicate(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            first.kill()  # as the scheduler would
            first.communicate()
            pytest.fail(f"shardwise train still running {GRACE_S} s after the ranks saved")
    stdout = "".join(printed) + rest
    assert first.returncode == 0, stderr.read_text()
    assert "preempted (SIGTERM): stopped at step" in stdout
    stopped = int(stdout.split("stopped at step ")[1].split()[0])
    assert 7 <= stopped <= 9
    second = shardwise_command(*command[1:], "--resume", "auto", timeout=300)
    assert second.returncode == 0, second.stderr
    got = losses(tmp_path / "run")
    assert [got[s] for s in range(1, 17)] == [want_losses[s] for s in range(1, 17)]
    final = load_params(tmp_path / "run" / "checkpoints" / "step_00000016")
    for name, value in want_params.items():
        assert torch.equal(final[name], value), name


def test_sigterm_to_the_ranks_alone_stops_the_run_at_a_checkpoint(tmp_path):
    """SIGTERM to the ranks, not to `shardwise train` (no restarts left): they save at a step
    boundary, the run stops there and `shardwise train` exits 0 with the preempted summary."""
    sections = {**SECTIONS, "fault": {"max_restarts": 0, "check_interval_s": 0}}
    command = _train_on_two_ranks(
        tmp_path, gpt_job(tmp_path / "run", train={"steps": 40}, **sections)
    )
    env = {**os.environ, "SHARDWISE_FAULT": "slow:step=1:seconds=0.2"}
    launcher = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 120
    while not (tmp_path / "run" / "checkpoints" / "step_00000004").exists():
        assert time.monotonic() < deadline and launcher.poll() is None, launcher.communicate()
        time.sleep(0.1)
    ranks = ranks_of(launcher.pid)
    assert len(ranks) == 2
    for pid in ranks:
        os.kill(pid, signal.SIGTERM)
    out, err = launcher.communicate(timeout=GRACE_S)
    assert launcher.returncode == 0, err
    assert "preempted (SIGTERM): stopped at step" in out
    stopped = int(out.split("stopped at step ")[1].split()[0])
    assert 4 < stopped < 40 and (tmp_path / "run" / "checkpoints" / f"step_{stopped:08d}").exists()


def test_on_sigterm_ranks_stuck_behind_a_stalled_rank_end_without_waiting_for_sigkill(tmp_path):
    """Rank 1 stalls after step 4 and the launcher gets SIGTERM then, so the ranks cannot meet to
    stop together: rank 0 waits inside step 5 for rank 1. Each says so and ends about 10 s after
    the signal (4 × the slowest step, at least 10 s, inside a step), not when torch's agent
    SIGKILLs them 30 s after it; `shardwise train` exits 143, keeping step 4's checkpoint."""
    command = _train_on_two_ranks(
        tmp_path, gpt_job(tmp_path / "run", train={"steps": 16}, **SECTIONS)
    )
    fault = {"SHARDWISE_FAULT": "stall:rank=1:step=4,sigterm:step=4"}
    done = shardwise_command(*command[1:], env=fault, timeout=300)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    for rank, where in ((0, "inside step 5"), (1, "after step 4")):
        assert f"rank {rank}: SIGTERM, but the rank has waited" in done.stderr, done.stderr
        assert f"{where}: a rank it waits for is gone" in done.stderr
    assert "checkpoints written so far are kept" in done.stderr
    assert (tmp_path / "run" / "checkpoints" / "step_00000004").exists()


@pytest.mark.parametrize("damage", ["truncate", "corrupt"])
def test_damaged_newest_checkpoint_is_skipped_for_the_previous_good_one(
    tmp_path, uninterrupted, damage
):
    want_losses, want_params, straight = uninterrupted
    for step in (8, 12):
        name = f"step_{step:08d}"
        shutil.copytree(straight / "checkpoints" / name, tmp_path / "checkpoints" / name)
    target = tmp_path / "checkpoints" / "step_00000012" / "__1_0.distcp"
    data = target.read_bytes()
    if damage == "truncate":
        target.write_bytes(data[: len(data) // 2])
    else:
        target.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
    word = "truncated" if damage == "truncate" else "corrupted"
    with pytest.warns(UserWarning, match=rf"skipping checkpoint step_00000012: __1_0.*\({word}\)"):
        summary = shardwise.train(
            gpt_job(tmp_path, train={"steps": 16}, **SECTIONS), nproc=2, resume="auto"
        )
    assert summary is not None and summary.resumed_from == 8
    got = losses(tmp_path)
    assert [got[s] for s in range(9, 17)] == [want_losses[s] for s in range(9, 17)]
    final = load_params(summary.checkpoint)
    assert all(torch.equal(final[n], v) for n, v in want_params.items())


def test_failed_save_is_reported_and_training_goes_on(tmp_path, monkeypatch, uninterrupted):
    _, want_params, _ = uninterrupted
    monkeypatch.setenv("SHARDWISE_FAULT", "save_error:step=8")
    summary = shardwise.train(gpt_job(tmp_path, train={"steps": 16}, **SECTIONS), nproc=2)
    assert summary is not None
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step_00000004", "step_00000012", "step_00000016"]  # no 8, no partial
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records if "checkpoint/failed_saves" in r] == [8]
    final = load_params(summary.checkpoint)
    assert all(torch.equal(final[n], v) for n, v in want_params.items())


def test_failed_save_can_be_fatal(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDWISE_FAULT", "save_error:step=4")
    sections = {"checkpoint": {"every_steps": 4, "fail_on_save_error": True}}  # no restarts
    with pytest.raises(shardwise.WorkerFailed, match="saving the checkpoint of step 4 failed"):
        shardwise.train(gpt_job(tmp_path, train={"steps": 8}, **sections), nproc=2)


def test_a_stalled_rank_is_named_within_the_timeout(tmp_path, monkeypatch):
    """Rank 1 stops making progress after step 4: the watchdog (its 8 s timeout, not gloo's)
    fails the run with one message that names it, where it is, and who waits for it. How soon
    is not asserted (a loaded machine's start-up varies); the test's own limit catches a hang."""
    monkeypatch.setenv("SHARDWISE_FAULT", "stall:rank=1:step=4")
    with pytest.raises(shardwise.WorkerFailed) as info:
        shardwise.train(gpt_job(tmp_path, train={"steps": 8}, fault={"timeout_s": 8}), nproc=2)
    message = str(info.value)
    assert "rank 0 waits inside step 5, which rank 1 never started" in message
    assert "rank 1 after step 4 is at" in message and "inject.py" in message
    assert (tmp_path / "hangs" / "rank0.txt").exists()


def test_a_slow_rank_is_flagged_as_a_straggler(tmp_path, monkeypatch):
    """Of 2 ranks the median is their mean, so the slowed rank's ratio is 2·s / (s + f) for its
    time s and the other's f: above the factor 1.5 only where s > 3·f. 0.05 s more per step was
    too little on a loaded machine (f over 25 ms: never flagged); 0.25 s holds to f = 125 ms."""
    monkeypatch.setenv("SHARDWISE_FAULT", "slow:rank=1:step=1:seconds=0.25")
    job = gpt_job(tmp_path, train={"steps": 8}, fault={"check_interval_s": 0})  # check every step
    summary = shardwise.train(job, nproc=2)
    assert summary is not None
    records = read_metrics(tmp_path / "metrics.jsonl")
    flagged = [r for r in records if "straggler/rank1" in r]
    steps = [r["step"] for r in flagged]
    # flagged after 3 slow windows in a row (the first step's warm-up may not count), then each
    assert steps == list(range(steps[0], 9)) and steps[0] <= 5, steps
    assert min(r["straggler/rank1"] for r in flagged) > 1.5
    assert not any("straggler/rank0" in r for r in records)


def test_async_checkpoints_commit_and_resume_exactly(tmp_path, uninterrupted):
    _, want_params, _ = uninterrupted
    sections = {**SECTIONS, "checkpoint": {**SECTIONS["checkpoint"], "async": True}}
    summary = shardwise.train(gpt_job(tmp_path / "a", train={"steps": 16}, **sections), nproc=2)
    assert summary is not None
    checkpoints = tmp_path / "a" / "checkpoints"
    names = sorted(p.name for p in checkpoints.iterdir())
    assert names == ["step_00000008", "step_00000012", "step_00000016"]
    assert all(problem(checkpoints / name) is None for name in names)
    final = load_params(summary.checkpoint)
    assert all(torch.equal(final[n], v) for n, v in want_params.items())

    shutil.copytree(checkpoints / "step_00000012", tmp_path / "b" / "checkpoints" / "step_00000012")
    resumed = shardwise.train(
        gpt_job(tmp_path / "b", train={"steps": 16}, **sections), nproc=2, resume="auto"
    )
    assert resumed is not None and resumed.resumed_from == 12
    again = load_params(resumed.checkpoint)
    assert all(torch.equal(again[n], v) for n, v in want_params.items())


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_checkpoints_on_s3_restart_resume_and_retention(
    tmp_path, monkeypatch, uninterrupted, s3, asynchronous
):
    """checkpoint.dir = s3://…: a rank is killed at step 10, the restarted ranks resume from
    step 8 read back from the object store, and the run ends bitwise like the uninterrupted one;
    keep_last retention deletes from the store; nothing else is left there. An asynchronous save
    is committed as soon as it is written, not at the next save: rank 1 pauses 3 s after step 9
    (a checkpoint interval is normally much longer than a write) and step 8 is there to resume
    from."""
    want_losses, want_params, _ = uninterrupted
    monkeypatch.setenv("SHARDWISE_FAULT", "stall:rank=1:step=9:seconds=3,kill:rank=1:step=10")
    url = "s3://checkpoints/runs/gpt"
    checkpoint = {**SECTIONS["checkpoint"], "dir": url, "async": asynchronous}
    sections = {**SECTIONS, "checkpoint": checkpoint}
    summary = shardwise.train(gpt_job(tmp_path, train={"steps": 16}, **sections), nproc=2)
    assert summary is not None and summary.checkpoint == f"{url}/step_00000016"
    restarts = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "fault/restarts" in r]
    assert [r["step"] for r in restarts] == [8]
    got = losses(tmp_path)
    assert [got[s] for s in range(1, 17)] == [want_losses[s] for s in range(1, 17)]
    final = load_params(summary.checkpoint)
    for name, value in want_params.items():
        assert torch.equal(final[name], value), name
    s3.invalidate_cache()
    assert s3.ls("checkpoints/runs/gpt", detail=False) == [
        f"checkpoints/runs/gpt/step_{s:08d}" for s in (8, 12, 16)
    ]
    assert all(problem(f"{url}/step_{s:08d}") is None for s in (8, 12, 16))
    assert not (tmp_path / "checkpoints").exists()
    export_safetensors(summary.checkpoint, tmp_path / "model.safetensors")
    exported = load_exported(tmp_path / "model.safetensors")
    assert all(torch.equal(exported[name], value) for name, value in want_params.items())


def test_an_unreachable_checkpoint_url_is_refused_before_launch(tmp_path, s3):
    config = gpt_job(tmp_path, checkpoint={"dir": "s3://no-such-bucket/run"})
    with pytest.raises(shardwise.ConfigError, match=r"checkpoint.dir = 's3://no-such-bucket/run'"):
        shardwise.train(config, nproc=2)


def test_a_job_across_two_nodes_survives_one_nodes_workers_being_killed(tmp_path, uninterrupted):
    """Two simulated machines (network namespaces joined by a veth pair), one `shardwise train`
    (one elastic agent) per node, one rank each, meeting at a c10d rendezvous on node a. The
    worker of rank 1 is SIGKILLed after step 10: its agent restarts it, the other node's agent
    restarts its own into the new round, both resume from step 8 and the run ends bitwise like
    the uninterrupted 2-rank run on one machine."""
    import tomli_w

    from netns import two_nodes

    want_losses, want_params, _ = uninterrupted
    job = tmp_path / "job.toml"
    # One thread per rank, as in the one-machine run (2 ranks on 2 cores): a rank alone on its
    # "node" would otherwise take both cores and sum in another order.
    config = gpt_job(tmp_path / "run", job={"threads_per_rank": 1}, train={"steps": 16}, **SECTIONS)
    job.write_text(tomli_w.dumps(config.model_dump(mode="json", exclude_none=True)))
    with two_nodes() as (a, b):
        endpoint = f"{a.addr}:{a.free_port()}"
        started = [
            shardwise_process(
                *("train", str(job), "--nproc", "1", "--nnodes", "2", "--rdzv-endpoint", endpoint),
                *("--local-addr", node.addr),
                env={
                    "GLOO_SOCKET_IFNAME": node.interface,
                    "SHARDWISE_FAULT": "kill:rank=1:step=10",
                },
                stdout=(tmp_path / f"{node.namespace}.out").open("w"),
                stderr=(tmp_path / f"{node.namespace}.err").open("w"),
                netns=node.namespace,
            )
            for node in (a, b)
        ]
        listening = set()  # what each node listens on while the job runs
        deadline = time.monotonic() + 240
        while any(p.poll() is None for p in started) and time.monotonic() < deadline:
            for process in started:
                listening.update((s[0], s[1]) for s in listening_sockets(process.pid))
            time.sleep(0.2)
        for process in started:
            process.wait(timeout=max(1.0, deadline - time.monotonic()))
        outputs = [
            (
                (tmp_path / f"{n.namespace}.out").read_text(),
                (tmp_path / f"{n.namespace}.err").read_text(),
            )
            for n in (a, b)
        ]
    for process, (_, err) in zip(started, outputs, strict=True):
        assert process.returncode == 0, err
    assert sum("done: step 16" in out for out, _ in outputs) == 1  # printed where rank 0 ran
    # the rendezvous store, rank 0's store and gloo, on the nodes' own addresses only
    assert len(listening) >= 3 and {address for address, _ in listening} <= {a.addr, b.addr}
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records if "fault/restarts" in r] == [8]
    got = losses(tmp_path / "run")
    assert [got[s] for s in range(1, 17)] == [want_losses[s] for s in range(1, 17)]
    final = load_params(tmp_path / "run" / "checkpoints" / "step_00000016")
    for name, value in want_params.items():
        assert torch.equal(final[name], value), name


def test_a_failing_final_evaluation_keeps_the_final_checkpoint(tmp_path):
    """The last step's checkpoint is written before the last evaluation: a model that fails in
    evaluation loses nothing it trained."""
    job = gpt_job(
        tmp_path,
        model={"name": "tests.foreign_models:fails_in_evaluation", "args": {}},
        data={"name": "digits", "args": {}},
        train={"steps": 6, "global_batch": 16, "micro_batch": 8},
    )
    with pytest.raises(shardwise.WorkerFailed, match="injected failure in evaluation"):
        shardwise.train(job, nproc=2)
    final = tmp_path / "checkpoints" / "step_00000006"
    assert problem(str(final)) is None
    assert load_params(final).keys() == {"body.1.weight", "body.1.bias"}


def test_retention_keeps_the_newest_good_checkpoint_when_a_newer_one_is_corrupt(
    tmp_path, uninterrupted
):
    """The audit's loss: step 16's bytes flipped at the same size, `--resume auto` with
    keep_last = 1 resumes from 12 and saves 14. Retention must keep 14 (the newest good one) and
    never count 16; it deleted everything but the corrupt 16."""
    _, _, straight = uninterrupted
    for step in (8, 12, 16):
        name = f"step_{step:08d}"
        shutil.copytree(straight / "checkpoints" / name, tmp_path / "checkpoints" / name)
    target = tmp_path / "checkpoints" / "step_00000016" / "__0_0.distcp"
    data = target.read_bytes()
    target.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
    sections = {**SECTIONS, "checkpoint": {"every_steps": 4, "keep_last": 1}}
    with pytest.warns(UserWarning, match="skipping checkpoint step_00000016"):
        summary = shardwise.train(
            gpt_job(tmp_path, train={"steps": 14}, **sections), nproc=2, resume="auto"
        )
    assert summary is not None and summary.resumed_from == 12
    left = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert left == ["step_00000014", "step_00000016"]
    assert summary.checkpoint is not None and problem(summary.checkpoint) is None
