"""What a run says about its speed is true (issue 34): the peak MFU is measured against is the
calibrated profile's where there is one, an MFU above 100% is never reported, a model whose
forward reads values is counted on a real micro-batch without changing its training, a Hugging
Face model's on fake tensors, and
`train.precision = "auto"` is resolved, printed and saved."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from helpers import digits_job, gpt_job
from shardwise.training.tracking.metrics import read_metrics
from shardwise.training.trainer.build import build_run
from shardwise.training.trainer.loop import train
from shardwise.training.trainer.precision import decide


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_an_mfu_above_100_percent_is_never_reported(
    tmp_path, one_rank, one_thread, monkeypatch, capsys
):
    """A calibrated profile whose peak is far too low (1 MFLOP/s): the run reports its TFLOP/s,
    no MFU, and says once that the peak is wrong."""
    monkeypatch.setenv("SHARDWISE_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    profile = {"peak_flops": 1e6, "calibrated": True, "device": "cpu"}
    (tmp_path / "cache" / "this-machine.json").write_text(json.dumps(profile))
    train(
        digits_job(tmp_path / "run", train={"steps": 20}), device=torch.device("cpu"), resume=None
    )
    out = capsys.readouterr().out
    peak = next(line for line in out.splitlines() if line.startswith("utilisation:"))
    assert "from the calibrated profile" in peak, peak  # else it says why the profile was not used
    records = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "tflops" in r]
    assert records and not any("mfu" in r for r in records)
    assert out.count("MFU is not reported") == 1 and "calibrated profile" in out
    assert "MFU" not in out.split("MFU is not reported")[1].replace("MFU = model", "")


@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="transformers is not installed (pip install 'shardwise[hf]'; make test does)",
)
def test_a_hugging_face_model_gets_an_mfu_counted_on_the_meta_device(tmp_path, one_rank):
    """The HF GPT-2 example reads a value in its forward on plain meta tensors ("Tensor.item()
    cannot be called on meta tensors"), which it skips on fake ones: its FLOPs are counted on
    fake tensors over the meta model, as every layout's are (under tensor and pipeline
    parallelism no real micro-batch can be counted), about 6 per parameter per token, and the
    run reports MFU."""
    args = {"n_layer": 2, "n_embd": 32, "n_head": 4, "n_positions": 16}
    config = gpt_job(
        tmp_path / "run",
        model={"name": "examples.hf_gpt2:build_model", "args": args},
        data={"args": {"seq_len": 16, "max_bytes": 20_000}},
        train={"steps": 4, "global_batch": 4, "micro_batch": 2},
    )
    run = build_run(config, torch.device("cpu"))
    assert "(counted)" in run.utilisation.describe()
    per_token = run.utilisation.flops_per_step / (4 * 16)
    params = sum(p.numel() for p in run.parameters())
    assert 6 * params * 0.5 < per_token < 6 * params * 2
    train(config, device=torch.device("cpu"), resume=None)
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert any("mfu" in r for r in records)


@pytest.mark.parametrize(
    ("asked", "rates", "chosen", "said"),
    [
        ("auto", {"fp32": 30e9, "bf16": 1e9}, "fp32", "train.precision = 'auto': fp32"),
        ("auto", {"fp32": 90e9, "bf16": 200e9}, "bf16", "train.precision = 'auto': bf16"),
        ("bf16", {"fp32": 30e9, "bf16": 0.57e9}, "bf16", "set train.precision = 'auto'"),
        ("bf16", {"fp32": 30e9, "bf16": 20e9}, "bf16", None),
    ],
)
def test_auto_precision_takes_bf16_on_a_cpu_only_where_it_is_as_fast(asked, rates, chosen, said):
    decided = decide(asked, rates)
    assert decided.name == chosen
    if said is None:
        assert decided.notes == []
    else:
        (note,) = decided.notes
        assert said in note


def test_auto_precision_is_resolved_printed_and_saved(tmp_path, one_rank, capsys):
    train(
        digits_job(tmp_path / "run", train={"steps": 2, "precision": "auto"}),
        device=torch.device("cpu"),
        resume=None,
    )
    saved = (tmp_path / "run" / "config.toml").read_text()
    (line,) = [line for line in saved.splitlines() if line.startswith("precision")]
    assert line in ('precision = "fp32"', 'precision = "bf16"')
    chosen = line.split('"')[1]
    assert (
        f"train.precision = 'auto': {chosen} (matrix multiplies here: bf16"
        in capsys.readouterr().out
    )


def test_a_resumed_auto_precision_run_keeps_the_precision_it_was_trained_in(
    tmp_path, one_rank, capsys
):
    """The checkpoint records the precision; a run resumed with `auto` continues in it, whatever
    today's probe would choose (exact resume)."""
    job = digits_job(tmp_path / "run", train={"steps": 4, "precision": "bf16"})
    train(job, device=torch.device("cpu"), resume=None)
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000004"
    manifest = json.loads((checkpoint / "shardwise.json").read_text())
    assert manifest["precision"] == "bf16"
    capsys.readouterr()
    resumed = digits_job(tmp_path / "again", train={"steps": 6, "precision": "auto"})
    train(resumed, device=torch.device("cpu"), resume=str(checkpoint))
    assert "train.precision = 'auto': bf16, as step_00000004 was trained" in capsys.readouterr().out
    assert 'precision = "bf16"' in (tmp_path / "again" / "config.toml").read_text()


class _ReadsAValue(torch.nn.Module):  # its forward reads a value: it cannot run on meta
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x) if x.sum().item() >= 0 else -self.layer(x)


def _count_in_every_rank() -> tuple[int, float, str | float]:
    from shardwise.training.job_names import LOSSES
    from shardwise.training.trainer.flops import Peak, for_run

    built = []

    def build(model: type[torch.nn.Module]) -> torch.nn.Module:
        built.append(model)
        return model()

    sample = (torch.zeros(4), torch.tensor(0))
    counted = {"micro_batch": 2, "global_batch": 4, "peak": lambda: Peak(1e12, torch.float32)}
    found = for_run(lambda: build(Linear4To2), LOSSES["cross_entropy"], sample, **counted)
    assert not isinstance(found, str)
    reads = for_run(lambda: build(_ReadsAValue), LOSSES["cross_entropy"], sample, **counted)
    return (
        len(built),
        found.flops_per_step,
        reads if isinstance(reads, str) else reads.flops_per_step,
    )


class Linear4To2(torch.nn.Linear):
    def __init__(self) -> None:
        super().__init__(4, 2)


def test_the_flops_are_counted_by_rank_0_and_given_to_every_rank():
    """Every rank builds the same model on meta: rank 0 counts it, the others get its count,
    and where the count fails every rank says the same (and takes the same path after it)."""
    from helpers import run_distributed

    (built_0, flops_0, reads_0), (built_1, flops_1, reads_1) = run_distributed(
        _count_in_every_rank, 2
    )
    assert (built_0, built_1) == (2, 0)
    # a global batch of 4 through 4 × 2 weights: 2 FLOPs each forward, 2 for the weights'
    # gradient (the input, data, needs none)
    assert flops_0 == flops_1 == 4 * 8 * (2 + 2)
    assert isinstance(reads_0, str) and reads_0 == reads_1
    assert "could not be counted on the meta device" in reads_0
