"""`shardwise plan` as a user meets it: the examples of docs/planner.md, a job file, the chart and
JSON outputs, and bad input (one line, exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardwise.cli import main
from shardwise.plan.job import plan_job
from shardwise.plan.plan_arguments import CHOICES, NUMBERS
from shardwise.training.config.load import load_config

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
    from shardwise.training import job_names

    built = job_names.build_model(config)
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
    from shardwise.plan.job import trace_activations
    from shardwise.training import job_names

    args = {"layers": 3, "heads": 4, "hidden": 64, "seq_len": 32, "dropout": dropout}
    config = gpt_job(tmp_path, model={"args": args})
    with torch.device("meta"):
        meta = job_names.build_model(config)
    traced = trace_activations(config, meta, layers=3, fused_attention=dropout == 0)

    real = job_names.build_model(config)
    params = {p.untyped_storage().data_ptr() for p in real.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    train_set, _ = job_names.build_datasets(config)
    inputs, target = (torch.as_tensor(x).unsqueeze(0) for x in train_set[0])
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        job_names.build_loss(config)(real(inputs), target)
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
    from shardwise.plan.job import trace_activations
    from shardwise.training import job_names

    config = gpt_job(tmp_path, model={"args": {"layers": layers, "heads": 4, "hidden": 64}})
    with torch.device("meta"):
        gpt = job_names.build_model(config)
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


def refused(capsys, args) -> str:
    """The one line `shardwise plan ARGS` answers with: exit 2, nothing on stdout."""
    assert main(["plan", *args]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("shardwise: error: ") and err.count("\n") == 1, err
    return err.removeprefix("shardwise: error: ").rstrip("\n")


BASE = [*SHAPE, "--gpus", "64", "--hardware", "h100"]


@pytest.mark.timeout(20)  # two of them hung: a divisor search over 10^10 or 10^20 numbers
@pytest.mark.parametrize(
    ("bad", "line"),
    [
        (["--params", "-5"], "--params -5: must be a number from 1 to 1e15 (a parameter count"),
        (["--params", "nan"], "--params nan: must be a number from 1 to 1e15"),
        (["--params", "inf"], "--params inf: must be a number from 1 to 1e15"),
        (["--hidden", "-4096"], "--hidden -4096: must be a whole number from 1 to 1,048,576"),
        (["--hidden", "10000000001"], "--hidden 10000000001: must be a whole number from 1 to"),
        (["--gpus", "1e20"], "--gpus 1e20: must be a whole number from 1 to 1,048,576"),
        (["--gpus", "1" + "0" * 20], "--gpus 1" + "0" * 20 + ": must be a whole number"),
        (["--gpus", "1" + "0" * 400], "--gpus 1" + "0" * 39 + "…: must be a whole number"),
        (["--gpus", "abc"], "--gpus abc: must be a whole number from 1 to 1,048,576"),
        (["--gpus", "2.5"], "--gpus 2.5: must be a whole number"),
        (["--utilisation", "0"], "--utilisation 0: must be a number above 0 and at most 1 (the"),
        (["--utilisation", "-1"], "--utilisation -1: must be a number above 0 and at most 1"),
        (["--utilisation", "1.5"], "--utilisation 1.5: must be a number above 0 and at most 1"),
        (["--tp", "0"], "--tp 0: must be a whole number from 1 to 1,048,576"),
        (["--micro-batch", "0"], "--micro-batch 0: must be a whole number from 1 to 100,000,000"),
        (["--memory-gib", "0"], "--memory-gib 0: must be a number above 0 and at most 1,048,576"),
        (["--memory-gib", "-0"], "--memory-gib -0: must be a number above 0"),
        (["--tokens", "-5"], "--tokens -5: must be a number from 1 to 1e18 (tokens to train on"),
        (["--seq", "-5"], "--seq -5: must be a whole number from 1 to 100,000,000 (tokens per"),
        (["--vocab", "-5"], "--vocab -5: must be a whole number from 1 to 100,000,000"),
        (["--heads", "-32"], "--heads -32: must be a whole number from 1 to 1,048,576"),
        (["--intra-gbs", "-1"], "--intra-gbs -1: must be a number above 0 and at most 1,000,000"),
        (["--layers", "-2"], "--layers -2: must be a whole number from 1 to 10,000"),
        (["--global-batch", "0"], "--global-batch 0: must be a whole number from 1 to 100,000,000"),
        (["--gpus-per-node", "0"], "--gpus-per-node 0: must be a whole number from 1 to 4,096"),
        (["--peak-tflops", "1e308"], "--peak-tflops 1e308: must be a number above 0 and at most"),
        (["--zero", "4"], "--zero 4: must be a whole number from 0 to 3 (the ZeRO stage)"),
        (["--top", "-1"], "--top -1: must be a whole number from 1 to 1,000 (layouts to list)"),
        (["--ffn", "0"], "--ffn 0: must be a whole number from 1 to 16,777,216"),
        (["--precision", "bf61"], "--precision bf61: must be one of bf16, bf16-autocast, fp16"),
        (["--recompute", "ful"], "--recompute ful: must be one of none, selective, full; did you"),
        (["--nproc", "2"], "--nproc N is a job file's ranks; without a job file give --gpus N"),
    ],
)
def test_a_bad_flag_is_one_line_naming_it_and_the_range(capsys, bad, line):
    assert refused(capsys, [*BASE, *bad]).startswith(line)


@pytest.mark.parametrize("value", ["abc", "nan", "-inf", "-1", "1e30", "1\nshardwise: ok"])
@pytest.mark.parametrize("dest", sorted(NUMBERS))
def test_every_numeric_flag_refuses_what_is_not_a_number_in_its_range(capsys, dest, value):
    flag = "--" + dest.replace("_", "-")
    line = refused(capsys, [f"{flag}={value}"])  # "--dp -inf" would read -inf as a flag
    assert line.startswith(f"{flag} ") and ": must be a " in line


@pytest.mark.parametrize("dest", sorted(CHOICES))
def test_every_option_flag_refuses_what_is_not_one_of_its_choices(capsys, dest):
    flag = "--" + dest.replace("_", "-")
    assert refused(capsys, [flag, "bogus"]).startswith(f"{flag} bogus: must be one of ")


def test_a_whole_number_may_be_written_in_scientific_notation(capsys):
    args = [*SHAPE, "--gpus", "6.4e1", "--hardware", "h100", "--global-batch", "1.024e3"]
    assert main(["plan", *args, "--json", "--top", "1"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["devices"] == 64 and plan["global_batch"] == 1024


@pytest.mark.timeout(20)
def test_a_search_over_too_many_layouts_is_refused_in_seconds(capsys):
    """720720 has 240 divisors: over a million layouts, minutes to weigh."""
    shape = ["--layers", "10000", "--hidden", "720720", "--heads", "720720"]
    args = [*shape, "--gpus", "720720", "--gpus-per-node", "1024", "--hardware", "h100"]
    line = refused(capsys, args)
    assert "make more than 20,000 layouts to weigh; fix part of the layout (--tp" in line


def test_a_fixed_micro_batch_may_exceed_the_searchs_64(capsys):
    args = ["--layers", "2", "--hidden", "64", "--heads", "2", "--gpus", "2", "--hardware", "h100"]
    assert main(["plan", *args, "--global-batch", "256", "--micro-batch", "128"]) == 0
    assert "dp2 mb128x1" in capsys.readouterr().out


def test_a_micro_batch_that_divides_no_share_of_the_batch_says_so(capsys):
    line = refused(capsys, [*BASE, "--micro-batch", "3"])
    assert line.startswith("--micro-batch 3 divides no data-parallel rank's share of the global")


@pytest.mark.parametrize("flag", [["--gpus", "4"], ["--layers", "4"], ["--no-dropout"]])
def test_a_job_file_refuses_flags_that_describe_another_model(repo_cwd, capsys, flag):
    line = refused(capsys, ["examples/text-gpt.toml", "--hardware", "h100", *flag])
    assert line.startswith(f"{flag[0]} is for planning without a job file; examples/text-gpt")


FIELDS = (
    b"memory = 1e9\npeak_flops = 1e12\nmemory_bandwidth = 1e9\nintra_bandwidth = 1e9\n"
    b"intra_latency = 1e-6\ninter_bandwidth = 1e9\ninter_latency = 1e-5\n"
)


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("bin.toml", b"\x00\xd7\xff\xfe", "not a TOML file ("),
        ("bad.toml", b"memory = [\n", "not a TOML file (Invalid value"),
        ("text.toml", FIELDS.replace(b"1e9\npeak", b"'lots'\npeak"), "memory = 'lots': must be a"),
        ("bool.toml", FIELDS.replace(b"1e12", b"true"), "peak_flops = True: must be a number"),
        ("table.toml", b'base = "h100"\n[memory]\nx = 1\n', "memory = {'x': 1}: must be a"),
        ("missing.toml", b"memory = 1e9\n", "missing inter_bandwidth, inter_latency, intra_"),
        ("minus.toml", b'base = "h100"\nmemory = -5\n', "memory = -5: must be a number above 0"),
        ("nan.toml", b'base = "h100"\nmemory_bandwidth = nan\n', "memory_bandwidth = nan: must"),
        ("util.toml", b'base = "h100"\nutilisation = 0\n', "utilisation = 0: must be a number"),
        ("node.toml", b'base = "h100"\ngpus_per_node = 2.5\n', "gpus_per_node = 2.5: must be"),
        ("base.toml", b"base = [1]\n", "base [1] is not one of a100-40gb"),
        ("name.toml", b'name = 5\nbase = "h100"\n', "name = 5 must be a string"),
        ("calibrated.toml", b'base = "h100"\ncalibrated = 1\n', "calibrated = 1 must be true"),
        ("unknown.toml", b'base = "h100"\nmemroy = 1\n', "unknown field 'memroy'"),
        ("list.json", b"[1, 2]", "must be a table of fields, not list"),
        ("bad.json", b'{"memory": ', "not a JSON file (Expecting value"),
        ("huge.json", b'{"base": "h100", "memory": 1' + b"0" * 400 + b"}", "memory = 10000"),
    ],
)
def test_a_bad_hardware_file_is_one_line(tmp_path, capsys, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    line = refused(capsys, [*SHAPE, "--gpus", "8", "--hardware", str(path)])
    assert line.startswith(f"--hardware {path}: {message}"), line


def test_a_hardware_file_that_is_missing_or_a_directory_is_one_line(tmp_path, capsys):
    missing = tmp_path / "gone.toml"
    assert refused(capsys, [*BASE[:-1], str(missing)]) == f"--hardware {missing}: no such file"
    folder = tmp_path / "folder.toml"
    folder.mkdir()
    line = refused(capsys, [*BASE[:-1], str(folder)])
    assert line == f"--hardware {folder}: cannot read it (Is a directory)"


def test_a_damaged_calibrated_profile_says_to_calibrate_again(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SHARDWISE_CACHE", str(tmp_path))
    (tmp_path / "this-machine.json").write_text('{"memory": 1e9, "peak_flops": -1}')
    line = refused(capsys, [*BASE[:-1], "this-machine"])
    assert line.startswith(f"the calibrated profile {tmp_path / 'this-machine.json'}: peak_flops")
    (tmp_path / "this-machine.json").write_text("{")
    assert refused(capsys, [*BASE[:-1], "this-machine"]).endswith(
        "; run `shardwise plan --calibrate` again"
    )


def test_a_chart_that_cannot_be_written_is_one_line_before_any_plan(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("")
    (tmp_path / "folder.png").mkdir()
    cases = {
        str(afile / "x.png"): f"{afile} is a file, not a folder",
        str(afile / "deeper" / "x.png"): f"{afile} is a file, not a folder",
        str(tmp_path / "folder.png"): "a directory; name a file in it, e.g.",
        str(tmp_path): "name the image file, ending in .png, .svg, .pdf",
        str(tmp_path / "plan.txt"): "name the image file, ending in .png",
        "": "name the image file, ending in .png",
    }
    if Path("/proc/self").is_dir():  # no file can be made there, not even by root
        cases["/proc/x.png"] = "cannot write in /proc ("
    for chart, message in cases.items():
        line = refused(capsys, [*BASE, "--chart", chart])
        assert line.startswith(f"--chart {chart}: {message}"), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "folder.png"]


def test_a_chart_is_written_in_a_new_folder_in_the_format_its_name_says(tmp_path, capsys):
    chart = tmp_path / "new" / "plan.svg"
    assert main(["plan", *BASE, "--chart", str(chart)]) == 0
    assert chart.read_text().lstrip().startswith("<?xml")


def test_a_given_utilisation_is_a_flat_rate_and_each_layout_reports_its_share(capsys):
    args = [*SHAPE, *RUN, "--hardware", "h200", "--global-batch", "512", "--json", "--top", "3"]
    assert main(["plan", *args]) == 0
    curved = json.loads(capsys.readouterr().out)
    assert curved["hardware"]["layer_overhead"] > 0
    assert all(0 < c["utilisation"] < curved["hardware"]["utilisation"] for c in curved["ranked"])
    assert main(["plan", *args, "--utilisation", "0.4"]) == 0
    flat = json.loads(capsys.readouterr().out)
    assert flat["hardware"]["layer_overhead"] == 0 and flat["hardware"]["utilisation"] == 0.4
    untouched = [c for c in flat["ranked"] if c["layout"]["tp"] == 1]
    assert untouched and all(c["utilisation"] == pytest.approx(0.4) for c in untouched)
    assert main(["plan", *SHAPE, *RUN, "--hardware", "h200", "--global-batch", "512"]) == 0
    out = capsys.readouterr().out
    assert "large layers at 56% of it + 1.35 ms per layer and micro-batch" in out


def test_auto_precision_is_planned_for_the_target_hardware(repo_cwd):
    """`train.precision = "auto"` is bf16 on a GPU and fp32 on a calibrated CPU (whose profile
    measures fp32's rate), as a run there would choose."""
    from dataclasses import replace

    from shardwise.plan.hardware import PRESETS

    config = load_config("examples/text-gpt.toml", ["train.precision=auto"])
    assert plan_job(config, 2, PRESETS["h200"]).precision.name == "bf16-autocast"
    cpu = replace(PRESETS["h200"], device="cpu", calibrated=True)
    assert plan_job(config, 2, cpu).precision.name == "fp32"
