"""`shardwise plan` as a user meets it: the examples of the README, a job file, the chart and
JSON outputs, and bad input (one line, exit 2)."""

from __future__ import annotations

import json

import pytest

from shardwise.cli import main
from shardwise.config import load_config
from shardwise.plan.job import plan_job

SHAPE = ["--model", "gpt", "--layers", "32", "--hidden", "4096", "--heads", "32"]
RUN = ["--vocab", "32000", "--seq", "4096", "--gpus", "64", "--gpus-per-node", "8"]


def test_a_shape_on_h100s_ranks_layouts_and_times_the_run(capsys):
    args = [*SHAPE, *RUN, "--hardware", "h100", "--global-batch", "1024", "--tokens", "300e9"]
    assert main(["plan", *args]) == 0
    out = capsys.readouterr().out
    assert "6.59B parameters" in out
    assert "fastest:" in out and "dominant term:" in out
    assert "whole run: 3e+11 tokens = 71,526 steps" in out
    assert "speedup over one device" in out


def test_json_has_every_ranked_layout_with_its_terms(capsys):
    args = [*SHAPE, *RUN, "--hardware", "a100-80gb", "--global-batch", "512", "--json"]
    assert main(["plan", *args, "--top", "5"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert len(plan["ranked"]) == 5
    times = [c["step_seconds"] for c in plan["ranked"]]
    assert times == sorted(times)
    first = plan["ranked"][0]
    assert set(first["memory_bytes"]) >= {"params", "grads", "optimizer", "activations", "total"}
    assert first["fits"] and first["memory_bytes"]["total"] <= 0.9 * plan["hardware"]["memory"]
    assert all(not c["fits"] and c["reason"].startswith("needs") for c in plan["dropped"])


def test_a_parameter_count_with_zero_3(capsys):
    assert (
        main(["plan", "--params", "7e9", "--gpus", "64", "--hardware", "a100-80gb", "--zero", "3"])
        == 0
    )
    out = capsys.readouterr().out
    assert "shape assumed for activations" in out
    assert "zero3" in out and "zero1" not in out


def test_a_chart_is_written(tmp_path, capsys):
    chart = tmp_path / "plan.png"
    assert main(["plan", *SHAPE, *RUN, "--hardware", "h100", "--chart", str(chart)]) == 0
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_job_file_plans_its_own_model_and_layout(repo_cwd, capsys):
    args = ["examples/text-gpt.toml", "--nproc", "2", "--hardware", "h100"]
    assert main(["plan", *args]) == 0
    out = capsys.readouterr().out
    assert "job. dp2 mb" in out  # the job's own layout, evaluated, above the ranking
    config = load_config("examples/text-gpt.toml", [])
    job = plan_job(config, 2)
    from shardwise import builders

    built = builders.build_model(config)
    assert job.model.params == sum(p.numel() for p in built.parameters())
    assert job.layout.dp == 2 and job.layout.global_batch == config.train.global_batch


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([*SHAPE, *RUN, "--hardware", "h10"], "unknown; did you mean 'h100'?"),
        ([*SHAPE, *RUN], "--hardware NAME: one of a100-40gb"),
        (
            [
                "--layers",
                "4",
                "--hidden",
                "100",
                "--heads",
                "3",
                "--gpus",
                "2",
                "--hardware",
                "h100",
            ],
            "not a multiple of --heads 3; try --heads 2",
        ),
        (
            [*SHAPE, *RUN, "--hardware", "h100", "--tp", "3"],
            "--tp 3: tensor parallelism must divide the 32 heads",
        ),
        (
            ["--params", "175e9", "--gpus", "8", "--hardware", "a100-40gb"],
            "fits no layout on 8 × a100-40gb",
        ),
        (["--params", "1e9", "--hardware", "h100"], "--gpus N: how many devices"),
        (["--gpus", "8", "--hardware", "h100"], "describe the model: --layers L"),
    ],
)
def test_bad_input_exits_2_with_one_line(capsys, args, message):
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardwise: error: ") and err.count("\n") == 1
    assert message in err


def test_this_machine_needs_a_calibration_first(repo_cwd, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDWISE_CACHE", str(tmp_path))
    assert main(["plan", "examples/text-gpt.toml", "--nproc", "2"]) == 2
    assert "run `shardwise plan --calibrate` first" in capsys.readouterr().err


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_the_meta_trace_saves_what_a_real_forward_on_cpu_does(tmp_path, dropout):
    """The job's model traced on the meta device (nothing allocated) records the bytes a real
    forward pass on CPU saves for backward: with fused attention (no dropout) the kernel's own
    saved tensors, with dropout the unfused attention's."""
    import torch

    from helpers import gpt_job
    from shardwise import builders
    from shardwise.plan.job import trace_activations

    args = {"layers": 3, "heads": 4, "hidden": 64, "seq_len": 32, "dropout": dropout}
    config = gpt_job(tmp_path, model={"args": args})
    with torch.device("meta"):
        meta = builders.build_model(config)
    traced = trace_activations(config, meta, layers=3, fused_attention=dropout == 0)

    real = builders.build_model(config)
    params = {p.untyped_storage().data_ptr() for p in real.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    train_set, _ = builders.build_datasets(config)
    inputs, target = (torch.as_tensor(x).unsqueeze(0) for x in train_set[0])
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        builders.build_loss(config)(real(inputs), target)
    # the same but for the token ids, which on CPU share one storage with the targets
    real_bytes = sum(saved.values())
    assert 3 * traced.layer + traced.before + traced.after == pytest.approx(real_bytes, abs=520)
    assert traced.after >= 32 * 256 * 4  # the log-softmax of the logits: after the layers


def opaque(inner):
    """A model without pipeline_blocks() around another (torch is imported by the tests that
    use it, not by this module)."""
    from torch import nn

    class Opaque(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)

    return Opaque()


def traced_gpt(tmp_path, layers: int, *, wrap: bool, traced_layers: int):
    """The activation trace of a built-in GPT with `layers` layers, bare or inside a model
    without pipeline_blocks()."""
    import torch

    from helpers import gpt_job
    from shardwise import builders
    from shardwise.plan.job import trace_activations

    config = gpt_job(tmp_path, model={"args": {"layers": layers, "heads": 4, "hidden": 64}})
    with torch.device("meta"):
        gpt = builders.build_model(config)
    model = opaque(gpt) if wrap else gpt
    return trace_activations(config, model, layers=traced_layers, fused_attention=False)


def test_a_model_without_blocks_has_its_repeated_layers_found(tmp_path):
    blocks = traced_gpt(tmp_path, 3, wrap=False, traced_layers=3)
    found = traced_gpt(tmp_path, 3, wrap=True, traced_layers=3)
    assert found == blocks  # inner.layers.0 … 2: the repeated layers, found without the contract


def test_a_model_without_blocks_or_repeated_layers_is_traced_whole_over_its_layers(tmp_path):
    blocks = traced_gpt(tmp_path, 1, wrap=False, traced_layers=1)
    whole = traced_gpt(tmp_path, 1, wrap=True, traced_layers=3)
    assert whole.before == whole.after == 0
    assert 3 * whole.layer == blocks.layer + blocks.before + blocks.after
