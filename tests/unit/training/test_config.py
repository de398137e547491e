import re
from pathlib import Path

import pytest

from shardwise.common.errors import ConfigError
from shardwise.common.job_files import apply_override, flatten
from shardwise.training.config.derive import config_as_saved, derive
from shardwise.training.config.load import load_config, validate
from shardwise.training.config.schema import ParallelSection

MINIMAL = """
[model]
name = "mlp"
[data]
name = "digits"
[train]
steps = 10
global_batch = 64
"""


@pytest.fixture
def job_file(tmp_path: Path) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(MINIMAL)
    return path


def test_defaults_and_overrides(job_file):
    config = load_config(job_file, ["train.lr=3e-4", "model.args.hidden=16", "job.name=x"])
    assert config.train.lr == 3e-4
    assert config.model.args == {"hidden": 16}
    assert config.run_dir == Path("runs/x")
    assert config.checkpoint_dir == str(Path("runs/x/checkpoints"))
    assert config.tracking_uri.startswith("sqlite:///") and config.tracking_uri.endswith(
        "mlflow.db"
    )


def test_override_values_are_read_as_toml():
    raw: dict = {}
    apply_override(raw, "train.betas=[0.9, 0.95]")
    apply_override(raw, "model.name=gpt")
    apply_override(raw, "tracking.mlflow=false")
    assert raw == {
        "train": {"betas": [0.9, 0.95]},
        "model": {"name": "gpt"},
        "tracking": {"mlflow": False},
    }


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.stpes=5", "unknown key 'train.stpes'; did you mean 'train.steps'?"),
        ("trian.steps=5", "unknown key 'trian'; did you mean 'train'?"),
        ("train.steps=abc", "train.steps: input should be a valid integer"),
        (
            "train.precision=fp8",
            "train.precision: input should be 'fp32', 'bf16', 'fp16' or 'auto'",
        ),
        ("train.lr=-1", "train.lr: input should be greater than 0"),
        ("train", "expected section.key=value"),
        # numbers that pydantic would take: true as 1, inf, and sizes no code can use
        ("train.steps=true", "train.steps: expected an integer, not true"),
        ("train.lr=inf", "train.lr: input should be a finite number"),
        ("train.lr=nan", "train.lr: input should be a finite number"),
        ("train.betas=[2, 3]", "train.betas.0: input should be less than 1"),
        ("train.betas=[0.9, 1.0]", "train.betas.1: input should be less than 1"),
        ("fault.timeout_s=inf", "fault.timeout_s: input should be a finite number"),
        ("fault.timeout_s=1e300", "fault.timeout_s: input should be less than or equal to 86400"),
        ("job.threads_per_rank=2e40", "job.threads_per_rank: unable to parse"),
        ("job.threads_per_rank=" + "9" * 40, "job.threads_per_rank: input should be less than"),
        ("job.seed=18446744073709551616", "job.seed: input should be less than 4294967296"),
        ("job.seed=" + "1" * 500, "(got '11111111"),  # a number shown short, on one line
        ("a.b=" + "[" * 5000 + "]" * 5000, "the value nests too deeply to read"),
    ],
)
def test_bad_values_give_one_line(job_file, override, message):
    with pytest.raises(ConfigError) as caught:
        load_config(job_file, [override])
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("[job]\nname = 'x'\n".encode("utf-16"), "is UTF-16 text; TOML files are UTF-8"),
        (b"[job]\nname = 'caf\xe9'\n", "is not UTF-8 text (byte 0xe9 on line 2)"),
        (b"a = " + b"[" * 100_000 + b"]" * 100_000, "nests arrays or tables too deeply"),
        (b"x = " + b"{a=" * 5000 + b"1" + b"}" * 5000, "nests arrays or tables too deeply"),
    ],
)
def test_job_files_that_are_not_utf8_toml_give_one_line(tmp_path, content, message):
    path = tmp_path / "job.toml"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=re.escape(message)) as caught:
        load_config(path)
    assert "\n" not in str(caught.value)


def test_missing_section_and_file(tmp_path):
    with pytest.raises(ConfigError, match="missing key 'train'"):
        validate({"model": {"name": "mlp"}, "data": {"name": "digits"}})
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps = 1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_derived_numbers(job_file):
    config = load_config(job_file, ["train.micro_batch=8"])
    derived = derive(config, world_size=2)
    assert (derived.dp, derived.micro_batch, derived.grad_accum) == (2, 8, 4)
    assert derived.degrees == {"pp": 1, "dp_replicate": 2, "dp_shard": 1, "tp": 1}
    assert derive(load_config(job_file), world_size=4).micro_batch == 16  # default: one micro-batch


def test_batch_must_divide(job_file):
    config = load_config(job_file, ["train.micro_batch=32"])
    with pytest.raises(
        ConfigError, match=r"multiple of train\.micro_batch \(32\) × data-parallel ranks \(3\)"
    ):
        derive(config, world_size=3)


def test_lr_scaling(job_file):
    linear = load_config(job_file, ["train.lr_scaling=linear", "train.lr_base_batch=32"])
    assert derive(linear, 1).lr == pytest.approx(2e-3)
    sqrt = load_config(job_file, ["train.lr_scaling=sqrt", "train.lr_base_batch=16"])
    assert derive(sqrt, 1).lr == pytest.approx(2e-3)


def test_parallel_degrees():
    assert ParallelSection().degrees(4)["dp_replicate"] == 4
    assert ParallelSection(dp_replicate=2, dp_shard=-1).degrees(8)["dp_shard"] == 4
    with pytest.raises(ConfigError, match="= 4 but the world size is 2; make them multiply to 2"):
        ParallelSection(dp_replicate=2, tp=2).degrees(2)
    with pytest.raises(ConfigError, match="both -1"):
        ParallelSection(dp_replicate=-1, dp_shard=-1).degrees(2)
    with pytest.raises(ConfigError, match="does not divide the world size 3"):
        ParallelSection(tp=2).degrees(3)
    with pytest.raises(ConfigError, match="positive integer or -1"):
        ParallelSection(pp=0).degrees(2)


def test_data_parallel_ranks_count_both_axes(job_file):
    hsdp = derive(load_config(job_file, ["parallel.dp_shard=2"]), world_size=4)
    assert hsdp.degrees == {"pp": 1, "dp_replicate": 2, "dp_shard": 2, "tp": 1}
    assert (hsdp.dp, hsdp.micro_batch, hsdp.grad_accum) == (4, 16, 1)
    tp = derive(load_config(job_file, ["parallel.tp=2"]), world_size=2)
    assert (tp.dp, tp.micro_batch) == (1, 64)  # tensor-parallel peers read the same samples


def test_resolved_config_writes_out_defaults(job_file):
    config = load_config(job_file)
    full = config_as_saved(config, derive(config, 2))
    assert full.train.micro_batch == 32
    assert full.parallel.dp_replicate == 2
    assert full.checkpoint.dir == "runs/run/checkpoints"
    assert full.tracking.experiment == "run"
    params = flatten(full)
    assert params["train.steps"] == "10" and params["model.name"] == "mlp"


def test_checkpoint_async_key_round_trips(tmp_path):
    import tomllib

    import tomli_w

    job = tmp_path / "job.toml"
    job.write_text(
        '[model]\nname = "mlp"\n[data]\nname = "digits"\n[train]\nsteps = 1\nglobal_batch = 8\n'
    )
    config = load_config(job, ["checkpoint.async=true"])
    assert config.checkpoint.async_save is True
    dumped = tomllib.loads(tomli_w.dumps(config.model_dump(mode="json", exclude_none=True)))
    assert dumped["checkpoint"]["async"] is True


@pytest.mark.parametrize("name", ["..", ".", "..."])
def test_a_job_name_cannot_point_outside_the_runs_directory(job_file, name):
    with pytest.raises(ConfigError, match=r"job\.name"):
        load_config(job_file, [f"job.name='{name}'"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["parallel.grad_compression=int8", "parallel.dp_shard=2", "parallel.dp_replicate=1"],
            r"compresses DDP's all-reduce; FSDP2 .* use 'bf16' or 'fp16'",
        ),
        (
            ["parallel.grad_compression=powersgd", "parallel.tp=2", "parallel.dp_replicate=1"],
            r"compresses DDP's all-reduce",
        ),
        (
            ["train.sync=local_sgd", "parallel.dp_shard=2", "parallel.dp_replicate=1"],
            r"keeps a whole replica on each data-parallel rank; set parallel.dp_shard = 1",
        ),
        (
            ["train.sync=diloco", "parallel.grad_compression=bf16"],
            r"not to train.sync = 'diloco' \(diloco: set train.outer_compression\)",
        ),
        (
            ["train.sync=async", "parallel.pp=2", "parallel.dp_replicate=1"],
            r"'async' needs plain data parallelism",
        ),
        (
            ["parallel.hierarchical=true", "parallel.dp_shard=2", "parallel.dp_replicate=1"],
            r"use HSDP instead",
        ),
    ],
)
def test_communication_options_that_do_not_fit_the_layout(job_file, overrides, message):
    with pytest.raises(ConfigError, match=message):
        derive(load_config(job_file, overrides), world_size=2)


@pytest.mark.parametrize("path", sorted(Path("examples").glob("*.toml")), ids=str)
def test_every_example_job_file_loads_and_passes_its_checks(path):
    """The docs run these as written: each is a valid training or many-models job."""
    import tomllib

    from shardwise.manymodel.config import load_many_models
    from shardwise.training.config.load import load_config

    raw = tomllib.loads(path.read_text())
    if "models" in raw:
        load_many_models(path)
    else:
        load_config(path)


def test_a_many_models_run_registers_its_forecasts_only_where_mlflow_records_it():
    from shardwise.manymodel.config import load_many_models

    job = Path(__file__).resolve().parents[3] / "examples" / "retail-synthetic.toml"
    sets = ["tracking.registered_model='retail'"]
    assert load_many_models(job, sets).tracking.registered_model == "retail"
    with pytest.raises(ConfigError, match=r"registered_model: registers the run in mlflow"):
        load_many_models(job, [*sets, "tracking.mlflow=false"])
