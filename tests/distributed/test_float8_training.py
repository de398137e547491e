"""Float8 training in real runs (`train.float8`, torchao's emulation on the CPU): every layout
that converts trains what one process trains, a float8 run's checkpoint resumes bit for bit,
loads into a run without float8 and back, and exports plain tensors; over 50 steps the loss
stays within 3% of a bf16 run's."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

import shardwise
from helpers import (
    assert_bitwise_same_run,
    assert_same_training,
    digits_job,
    gpt_job,
    load_params,
    losses,
)
from shardwise.common.errors import ConfigError
from shardwise.training.checkpoint.export import export_safetensors

pytest.importorskip("torchao", reason="the float8 extra: pip install 'shardwise[float8]'")
pytestmark = pytest.mark.slow

STEPS = 12
FLOAT8 = {
    "float8": "tensorwise",
    "float8_layers": ["*.mlp.*", "*.attn.*"],  # the tiny GPT's are too small for `auto`
    "float8_emulate": True,
}


def _job(run_dir, *, train=None, **sections):
    # no dropout: the layouts draw their masks in different streams
    model = {"name": "gpt", "args": {"layers": 2, "heads": 2, "hidden": 32, "seq_len": 32}}
    return gpt_job(
        run_dir,
        model=model,
        train={"steps": STEPS, **FLOAT8, **(train or {})},
        checkpoint={"every_steps": 6},
        **sections,
    )


def _outcome(run_dir, step=STEPS):
    return losses(run_dir), load_params(run_dir / "checkpoints" / f"step_{step:08d}")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("one")
    shardwise.train(_job(run_dir), nproc=1)
    return run_dir


LAYOUTS = {
    "ddp": {},
    "fsdp, float8 all-gather": {"dp_shard": 2},
    "pipeline": {"pp": 2},
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_that_converts_trains_what_one_process_trains(tmp_path, one_process, layout):
    train = {"float8_all_gather": True} if "all-gather" in layout else {}
    shardwise.train(_job(tmp_path, train=train, parallel=LAYOUTS[layout]), nproc=2)
    # float8's scales come from each layout's own amax (the same: a max is exact), the sums
    # in another order; fp32 master weights
    assert_same_training(
        _outcome(tmp_path), _outcome(one_process), range(1, STEPS + 1), loss_rtol=1e-4,
        param_atol=1e-4,
    )  # fmt: skip


def test_a_float8_run_resumes_bit_for_bit(tmp_path, monkeypatch, one_process):
    # killed after step 8: restarted, it resumes from the checkpoint of step 6
    monkeypatch.setenv("SHARDWISE_FAULT", "kill:step=8")
    shardwise.train(_job(tmp_path, fault={"max_restarts": 1}), nproc=1)
    assert_bitwise_same_run(tmp_path, one_process, STEPS)


def test_a_float8_checkpoint_loads_into_a_bf16_run_and_back_and_exports_plain_tensors(
    tmp_path, one_process
):
    plain = {"float8": "off", "float8_layers": "auto", "float8_emulate": False, "precision": "bf16"}
    checkpoint = one_process / "checkpoints" / f"step_{STEPS:08d}"
    without = tmp_path / "without"
    shardwise.train(_job(without, train={**plain, "steps": 14}), nproc=1, resume=str(checkpoint))
    assert sorted(losses(without)) == [13, 14]
    back = tmp_path / "back"
    shardwise.train(
        _job(back, train={"steps": 16}),
        nproc=1,
        resume=str(without / "checkpoints" / "step_00000014"),
    )
    assert sorted(losses(back)) == [15, 16]
    export_safetensors(checkpoint, tmp_path / "gpt.safetensors")
    exported = load_file(tmp_path / "gpt.safetensors")
    params = load_params(checkpoint)
    assert exported.keys() == params.keys()
    for name, value in exported.items():
        assert type(value) is torch.Tensor and torch.equal(value, params[name]), name


def test_over_fifty_steps_float8_stays_within_three_percent_of_bf16(tmp_path):
    steps = {"steps": 50, "precision": "bf16"}
    shardwise.train(_job(tmp_path / "bf16", train={**steps, "float8": "off"}), nproc=1)
    shardwise.train(_job(tmp_path / "float8", train=steps), nproc=1)
    bf16, float8 = losses(tmp_path / "bf16"), losses(tmp_path / "float8")
    last = [sum(run[s] for s in range(41, 51)) / 10 for run in (bf16, float8)]
    assert last[1] == pytest.approx(last[0], rel=0.03)


def test_float8_compiles(tmp_path):
    """torch.compile captures the float8 linears (their casts and scaled matrix multiplies) in
    its graphs: `aot_eager` here, the same graphs inductor fuses on a GPU."""
    train = {"steps": 4, "compile": True, "compile_backend": "aot_eager"}
    summary = shardwise.train(_job(tmp_path, train=train), nproc=1)
    assert summary is not None
    assert all(math.isfinite(loss) for loss in losses(tmp_path).values())
    assert sorted(losses(tmp_path)) == [1, 2, 3, 4]


def test_an_fsdp_unit_of_bias_free_float8_linears_is_refused_on_gloo(tmp_path):
    job = digits_job(
        tmp_path,
        model={"name": "tests.foreign_models:bias_free_blocks", "args": {}},
        train={**FLOAT8, "float8_all_gather": True, "float8_layers": ["layers.*"]},
        parallel={"dp_shard": 2},
    )
    with pytest.raises(ConfigError, match=r"'layers\.0' holds only bias-free float8 linears"):
        shardwise.train(job, nproc=2)
