"""Data parallelism is correct when it is indistinguishable from one process: the same losses and
parameters (within fp32 summation-order tolerance) on the same global batch, gradient accumulation
included; and a resumed run is bitwise the run that never stopped.

Tolerance: ranks sum gradients in a different order from one process (and use a different number
of torch threads), so fp32 results differ in the last bits. Losses stay within 1e-5 relative.
Parameters (of order 0.1) stay within 1e-5 absolute after 20 AdamW steps at lr 1e-2: Adam divides
by the root of the second moment, so for elements whose gradient is nearly zero it turns rounding
noise into a visible but bounded difference (measured: at most 2e-6).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import shardwise
from helpers import digits_job, gpt_job, load_params, losses, run_distributed

pytestmark = pytest.mark.slow
RTOL, ATOL = 1e-5, 1e-5


def assert_params_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=RTOL, atol=ATOL, msg=name)


def train(run_dir: Path, nproc: int, **sections) -> tuple[dict[int, float], dict]:
    summary = shardwise.train(digits_job(run_dir, **sections), nproc=nproc)
    assert summary is not None and summary.checkpoint is not None
    return losses(run_dir), load_params(summary.checkpoint)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The reference: 1 process, the whole global batch (32) in one forward pass."""
    return train(tmp_path_factory.mktemp("one"), 1, train={"micro_batch": 32})


@pytest.mark.parametrize(
    ("nproc", "micro_batch"),
    [
        (2, 16),  # DDP: each rank half the batch, one all-reduce
        (1, 8),  # accumulation: 4 micro-batches of 8 on one process
        (2, 4),  # both: 2 ranks × 4 micro-batches of 4, all-reduce only after the last
    ],
)
def test_same_global_batch_same_training(tmp_path, one_process, nproc, micro_batch):
    want_losses, want_params = one_process
    got_losses, got_params = train(tmp_path, nproc, train={"micro_batch": micro_batch})
    assert sorted(got_losses) == list(range(1, 21))
    assert got_losses == pytest.approx(want_losses, rel=RTOL)
    assert_params_close(got_params, want_params)
    # and training moved the parameters: equality is not the trivial kind
    assert want_losses[20] < want_losses[1] - 0.2


def _count_all_reduces(config_data: dict) -> list[int]:
    """On each rank: build the run and count DDP's bucket all-reduces over three steps."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from shardwise.training.config.schema import JobConfig
    from shardwise.training.trainer.build import build_run
    from shardwise.training.trainer.step import train_step

    run = build_run(JobConfig.model_validate(config_data), torch.device("cpu"))
    calls = []

    def counting_hook(state, bucket):
        calls.append(bucket.index())
        return allreduce_hook(state, bucket)

    (model,) = run.parts
    model.register_comm_hook(None, counting_hook)
    for _ in range(3):
        micro_batches = run.loader.next_step()
        assert len(micro_batches) == 4
        train_step(run, micro_batches)
    return calls


def test_accumulation_all_reduces_once_per_step(tmp_path):
    config = digits_job(tmp_path, train={"micro_batch": 4})  # 32 = 2 ranks × 4 × 4
    per_rank = run_distributed(_count_all_reduces, 2, config.model_dump(mode="json"))
    buckets = max(per_rank[0]) + 1
    assert per_rank[0] == per_rank[1]
    assert len(per_rank[0]) == 3 * buckets  # not 4 × 3 × buckets: no_sync skipped the rest


def test_resume_is_bitwise_identical(tmp_path):
    """A GPT with dropout on 2 ranks, stopped after the checkpoint at step 20 (mid-epoch: an epoch
    is 37 steps) and resumed: it crosses the epoch boundary and ends bitwise where the run that
    never stopped ends, with the same loss at every step."""
    sections = {"checkpoint": {"every_steps": 10, "keep_last": 10}}
    straight = shardwise.train(gpt_job(tmp_path / "straight", **sections), nproc=2)
    assert straight is not None and straight.checkpoint is not None

    # The state a run interrupted right after step 20's save leaves behind.
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(
        tmp_path / "straight" / "checkpoints" / "step_00000020",
        resumed_dir / "checkpoints" / "step_00000020",
    )
    resumed = shardwise.train(gpt_job(resumed_dir, **sections), nproc=2, resume="auto")
    assert resumed is not None and resumed.resumed_from == 20

    want, got = losses(tmp_path / "straight"), losses(resumed_dir)
    assert [got[s] for s in range(21, 41)] == [want[s] for s in range(21, 41)]
    want_params, got_params = load_params(straight.checkpoint), load_params(resumed.checkpoint)
    for name, value in want_params.items():
        assert torch.equal(got_params[name], value), name


def test_resume_on_another_world_size_continues_the_curve(tmp_path):
    """Saved by 2 ranks, resumed by 1: model, optimizer and data position carry over, so the
    continued run reads the samples the first run would have read and follows its curve."""
    sections = {"checkpoint": {"every_steps": 10, "keep_last": 10}}
    straight = shardwise.train(digits_job(tmp_path / "straight", **sections), nproc=2)
    assert straight is not None and straight.checkpoint is not None
    shutil.copytree(
        tmp_path / "straight" / "checkpoints" / "step_00000010",
        tmp_path / "resumed" / "checkpoints" / "step_00000010",
    )
    resumed = shardwise.train(digits_job(tmp_path / "resumed", **sections), nproc=1, resume="auto")
    assert resumed is not None and resumed.resumed_from == 10
    want, got = losses(tmp_path / "straight"), losses(tmp_path / "resumed")
    assert [got[s] for s in range(11, 21)] == pytest.approx(
        [want[s] for s in range(11, 21)], rel=RTOL
    )
    assert_params_close(load_params(resumed.checkpoint), load_params(straight.checkpoint))
