"""The training step never makes the host wait for the device (issues 17 and 34): the non-finite
check, the loss and the gradient norm stay on the device until a reporting step reads them, and
nothing else in the step cycle (the loop's accounting, health checks, logging) reads a value
between two log steps. A step launches about what the hand-written loop launches.

A host-device synchronisation is a read of a tensor's value on the host: every such read (`bool`,
`float`, `.item()`, `.tolist()` of a one-element tensor) dispatches `aten._local_scalar_dense`, on
CPU as on CUDA, so counting those dispatches finds them on this machine without a GPU.
"""

from __future__ import annotations

import json
import math
import sys
import traceback
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import REPO, digits_job, gpt_job
from shardwise.training.config.load import load_config
from shardwise.training.config.schema import TrackingSection
from shardwise.training.fault.inject import FaultPlan, parse
from shardwise.training.trainer import loop
from shardwise.training.trainer.build import build_run
from shardwise.training.trainer.profile import summarise
from shardwise.training.trainer.step import train_step

READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default}


class HostReads(TorchDispatchMode):
    """Counts the host's reads of tensor values (each one a wait for the device on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in READS:
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


def _steps(config, steps: int = 3):
    run = build_run(config, torch.device("cpu"))
    run.faults = FaultPlan(parse("nan:step=2"), rank=0, attempt=0)
    states = []
    for step in range(1, steps + 1):
        batch = run.loader.next_step()
        with HostReads() as mode:
            skipped = train_step(run, batch, step=step).skipped
        states.append((mode.reads, skipped, [p.detach().clone() for p in run.parameters()]))
    return run, states


@pytest.mark.parametrize("on_nonfinite", ["skip", "stop"])
def test_a_step_reads_nothing_on_the_host_and_a_nan_step_is_skipped_on_the_device(
    tmp_path, one_rank, on_nonfinite
):
    """Step 2's gradient is NaN: its update is not applied (parameters, moments and the step
    count untouched); under `skip` step 3's is, under `stop` no later one (the run saves the
    state before step 2 at its next reporting step)."""
    job = digits_job(tmp_path, train={"grad_clip": 1.0}, fault={"on_nonfinite": on_nonfinite})
    run, states = _steps(job)
    assert all(optimizer.defaults["fused"] for optimizer in run.optimizers)
    for reads, _, _ in states:
        assert reads == []
    (_, first, after_1), (_, second, after_2), (_, third, after_3) = states
    go_on = on_nonfinite == "skip"
    assert [float(first), float(second), float(third)] == [0.0, 1.0, 0.0 if go_on else 1.0]
    assert all(torch.equal(a, b) for a, b in zip(after_1, after_2, strict=True))
    moved = any(not torch.equal(a, b) for a, b in zip(after_2, after_3, strict=True))
    assert moved == go_on
    (optimizer,) = run.optimizers
    assert {float(s["step"]) for s in optimizer.state.values()} == {2.0 if go_on else 1.0}
    seen = run.nonfinite.read()
    assert (seen.skipped, seen.first_bad) == (1, 2)
    assert math.isnan(seen.norm)


def test_accumulation_and_clipping_on_the_gpt_read_nothing_either(tmp_path, one_rank):
    _, states = _steps(gpt_job(tmp_path, train={"grad_clip": 1.0}), steps=2)
    assert [reads for reads, _, _ in states] == [[], []]


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_the_loop_calls_train_step_and_train_step_calls_backward(tmp_path, one_rank):
    """Issue 18's short path: in a rank, `loop.train` → `step.train_step` → `loss.backward()`,
    with no other shardwise function between them (the launcher side is `cli._train` →
    `run.train` → `launch.agent.launch` → `launch.worker.run_worker` → `loop.train`)."""
    from shardwise.training.trainer import loop

    seen: list[list[str]] = []

    def record(module, grad_output):
        frames = traceback.extract_stack()
        ours = [f"{Path(f.filename).stem}.{f.name}" for f in frames if "/shardwise/" in f.filename]
        seen.append(ours)

    handle = torch.nn.modules.module.register_module_full_backward_pre_hook(record)
    try:
        loop.train(
            digits_job(tmp_path, train={"steps": 2}), device=torch.device("cpu"), resume=None
        )
    finally:
        handle.remove()
    training = [path for path in seen if "build.build_run" not in path]  # not the FLOP count's
    assert len(training) >= 2
    assert all(path == ["loop.train", "step.train_step"] for path in training), training[:3]


def _profiled(run_dir: Path, **sections) -> dict:
    """A 30-step GPT run (log every 10 steps; health checks, checkpoints and evaluation on) with
    steps 11-14 profiled and 15-18 counted for host reads: its profile/rank0.json."""
    base = {
        "train": {"steps": 30, "global_batch": 4, "micro_batch": 2},
        "tracking": {"log_every": 10, "profile_step": 11, "profile_steps": 4},
        "fault": {"check_interval_s": 0.001},  # the ranks compare notes every step or two
        "eval": {"every_steps": 10},
        "checkpoint": {"every_steps": 10},
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    loop.train(gpt_job(run_dir, **base), device=torch.device("cpu"), resume=None)
    return json.loads((run_dir / "profile" / "rank0.json").read_text())


@pytest.mark.parametrize("on_nonfinite", ["skip", "stop"])
def test_no_step_between_two_log_steps_reads_a_value_on_the_host(tmp_path, one_rank, on_nonfinite):
    profile = _profiled(tmp_path / "run", fault={"on_nonfinite": on_nonfinite})
    reads = profile["host_reads"]
    assert [(r["step"], r["reporting"]) for r in reads] == [(s, False) for s in (15, 16, 17, 18)]
    assert [r["count"] for r in reads] == [0, 0, 0, 0], reads
    assert [s["syncs"] for s in profile["steps"]] == [0, 0, 0, 0]


def test_a_read_in_the_step_is_counted_and_named(tmp_path, one_rank):
    """The same count finds a read where there is one (the test can fail): a loss that checks
    its value on the host."""
    profile = _profiled(tmp_path / "run", train={"loss": "foreign_models:loss_that_reads_a_value"})
    (where,) = {key for r in profile["host_reads"] for key in r["where"]}
    assert "loss_that_reads_a_value" in where and "_local_scalar_dense" in where
    assert [r["count"] for r in profile["host_reads"]] == [2, 2, 2, 2]  # two micro-batches
    assert all(s["syncs"] == 2 for s in profile["steps"])


def test_a_step_launches_no_more_than_5_percent_more_operators_than_the_hand_loop(
    tmp_path, one_rank
):
    """The operators a step dispatches, from the profiler, against bench/'s hand-written loop on
    the same tiny GPT (one micro-batch, fused AdamW, clipping): the non-finite check, the loss
    kept for the log and the found-inf the optimizer skips on are all shardwise adds."""
    sys.path.insert(0, str(REPO / "bench"))
    from hand_loop import TINY, hand_loop, job_sets

    sets = job_sets(TINY, "fp32", steps=30)
    extra = ["tracking.log_every=10", "tracking.profile_step=11", "tracking.profile_steps=4"]
    run_dir = tmp_path / "run"
    config = load_config(str(REPO / "examples/text-gpt.toml"), [*sets, *extra])
    config.job.run_dir = str(run_dir)
    loop.train(config, device=torch.device("cpu"), resume=None)
    ours = summarise(json.loads((run_dir / "profile" / "rank0.json").read_text())["steps"])
    hand = summarise(hand_loop([*sets, *extra], compiled=False, profile_window=(11, 4)))
    assert hand["operators"] > 100
    assert ours["operators"] <= 1.05 * hand["operators"], (ours, hand)


def test_a_profile_window_the_run_ends_in_or_resumes_into_is_closed_or_skipped(tmp_path, one_rank):
    """The default window (steps 10-11): a run of 5 steps ends before it and profiles nothing; a
    run of 10 steps ends inside it, and the profiler is
    stopped and its step written; the run resumed after step 10 starts inside it and profiles
    nothing (what the first process profiled stays), then counts the host's reads at 12 and 13
    (12 gathers the memory table: a reporting step); the run report draws the split."""
    default = TrackingSection.model_fields["profile_step"].default  # the helpers turn it off
    assert default == 10
    tracking = {"log_every": 5, "report": True, "profile_step": default}
    sections = {"tracking": tracking, "checkpoint": {"every_steps": 10}}
    short = gpt_job(tmp_path / "short", train={"steps": 5}, tracking={**tracking, "report": False})
    loop.train(short, device=torch.device("cpu"), resume=None)  # ends before the window
    assert not (tmp_path / "short" / "profile").exists()
    loop.train(
        gpt_job(tmp_path / "run", train={"steps": 10}, **sections),
        device=torch.device("cpu"),
        resume=None,
    )
    profile = json.loads((tmp_path / "run" / "profile" / "rank0.json").read_text())
    assert [s["step"] for s in profile["steps"]] == [10]
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000010"
    loop.train(
        gpt_job(tmp_path / "run", train={"steps": 14}, **sections),
        device=torch.device("cpu"),
        resume=str(checkpoint),
    )
    profile = json.loads((tmp_path / "run" / "profile" / "rank0.json").read_text())
    assert [s["step"] for s in profile["steps"]] == [10]
    reads = [(r["step"], r["reporting"], r["count"]) for r in profile["host_reads"]]
    assert reads[1] == (13, False, 0) and reads[0][:2] == (12, True)
    assert (tmp_path / "run" / "report" / "time.png").exists()
