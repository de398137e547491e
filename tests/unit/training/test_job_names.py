import subprocess
import sys

import pytest
import torch

from helpers import REPO, digits_job, gpt_job, write_job
from shardwise.common.errors import ConfigError
from shardwise.training.job_names import (
    build_datasets,
    build_loss,
    build_model,
    build_on_meta,
    check,
    cross_entropy,
)


def test_builtins_build(tmp_path):
    config = digits_job(tmp_path, model={"name": "cnn", "args": {"channels": 4}})
    check(config)
    model = build_model(config)
    train, held_out = build_datasets(config)
    assert len(train) + len(held_out) == 1797
    image, _ = train[0]
    assert image.shape == (1, 8, 8) and model(image.unsqueeze(0)).shape == (1, 10)
    assert build_loss(config) is cross_entropy


def test_user_builders_by_import_path(tmp_path, repo_cwd):
    config = digits_job(
        tmp_path,
        model={"name": "examples.tabular:build_model", "args": {"hidden": 8}},
        data={"name": "examples.tabular:build_datasets", "args": {}},
        train={"loss": "examples.tabular:loss"},
    )
    check(config)
    model = build_model(config)
    train, _ = build_datasets(config)
    features, target = train[0]
    out = model(features.unsqueeze(0))
    assert build_loss(config)(out, target.unsqueeze(0)).dim() == 0


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"model": {"name": "mpl"}}, "did you mean 'mlp'?"),
        ({"model": {"name": "no_such_pkg.mod:build"}}, "cannot import module 'no_such_pkg'"),
        ({"model": {"name": "shardwise.models.vision:nope"}}, "has no attribute 'nope'"),
        ({"model": {"name": "mlp", "args": {"hiden": 3}}}, "did you mean 'model.args.hidden'?"),
        (
            {"model": {"name": "mlp", "args": {"hidden": "wide"}}},
            "model.args.hidden: expected an integer, not the string 'wide'",
        ),
        (  # a number in quotes: it was compared with the model's own and raised TypeError
            {
                "model": {"name": "gpt", "args": {"seq_len": 64}},
                "data": {"name": "text", "args": {"seq_len": "64"}},
            },
            "data.args.seq_len: expected an integer, not the string '64': write it without",
        ),
        (
            {"data": {"name": "digits", "args": {"eval_fraction": "0.2"}}},
            "data.args.eval_fraction: expected a number, not the string '0.2'",
        ),
        ({"train": {"loss": "crossentropy"}}, "did you mean 'cross_entropy'?"),
        (
            {"train": {"compile": True, "compile_backend": "aot-eager"}},
            "train.compile_backend = 'aot-eager' is not a torch.compile backend; use one of: "
            "cudagraphs, inductor, .*, or to debug, aot_eager or eager",
        ),
        (
            {
                "model": {"name": "gpt", "args": {"seq_len": 16}},
                "data": {"name": "text", "args": {"seq_len": 32}},
            },
            "longer than model.args.seq_len",
        ),
        (
            {"model": {"name": "cnn", "args": {"channels": -3}}},
            "model.args.channels: input should be greater than 0",
        ),
        (
            {"model": {"name": "cnn", "args": {"channels": 0}}},
            "model.args.channels: input should be greater than 0",
        ),
        (
            {"model": {"name": "cnn", "args": {"channels": True}}},
            "model.args.channels: expected a number, not true",
        ),
        (
            {"model": {"name": "gpt", "args": {"dropout": 1.5}}},
            "model.args.dropout: input should be less than 1",
        ),
        (
            {"data": {"name": "text", "args": {"seq_len": 12.5}}},
            "data.args.seq_len: input should be a valid integer",
        ),
    ],
)
def test_bad_names_and_arguments(tmp_path, sections, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("?", r"\?")):
        check(digits_job(tmp_path, **sections))


def test_builders_get_arguments_as_annotated(tmp_path):
    """`seq_len = 16.0` in a job file reaches the builder as the int it is annotated with."""
    config = digits_job(
        tmp_path, data={"name": "text", "args": {"seq_len": 16.0, "max_bytes": 4096}}
    )
    train, _ = build_datasets(config)
    assert train[0][0].shape == (16,)


def test_builder_value_errors_become_config_errors(tmp_path):
    config = digits_job(tmp_path, data={"name": "digits", "args": {"eval_fraction": 1.5}})
    with pytest.raises(ConfigError, match="eval_fraction must be between 0 and 1"):
        build_datasets(config)


def test_cross_entropy_handles_sequences():
    logits = torch.randn(2, 5, 7)
    target = torch.randint(0, 7, (2, 5))
    expected = torch.nn.functional.cross_entropy(logits.reshape(10, 7), target.reshape(10))
    assert torch.allclose(cross_entropy(logits, target), expected)


def test_digits_table_is_scikit_learns():
    from sklearn.datasets import load_digits

    from shardwise.training.data.digits import _digits_table

    table, reference = _digits_table(), load_digits()
    assert torch.equal(
        torch.tensor(table[:, :64]), torch.tensor(reference.data, dtype=torch.float32)
    )
    assert torch.equal(torch.tensor(table[:, 64]).long(), torch.tensor(reference.target))


@pytest.mark.parametrize("model", ["gpt", "hf-gpt2"])
def test_a_model_built_on_meta_without_its_initialisers_is_the_same_model(tmp_path, model):
    """build_on_meta skips initialisers on meta tensors (they hold no values): the same
    parameters and buffers, by name, shape and dtype, as a plain meta build (HF's models fill
    theirs with Tensor.normal_ in _init_weights, the GPT with nn.init)."""
    sections = {}
    if model == "hf-gpt2":
        args = {"n_layer": 2, "n_embd": 32, "n_head": 4, "n_positions": 16}
        sections = {"model": {"name": "examples.hf_gpt2:build_model", "args": args}}
    config = gpt_job(tmp_path / "run", **sections)
    with torch.device("meta"):
        plain = build_model(config)
    skipped = build_on_meta(config)
    shapes = [
        {
            n: (t.shape, t.dtype, t.device.type)
            for n, t in [*m.named_parameters(), *m.named_buffers()]
        }
        for m in (plain, skipped)
    ]
    assert shapes[0] == shapes[1] and shapes[0]


def test_a_launchers_checks_of_a_multi_rank_cpu_job_import_no_dynamo(tmp_path):
    """torch runs normal_ on meta tensors in Python through torch._dynamo: a fresh launcher that
    checks a 2-rank GPT job on meta (build_on_meta) no longer imports it (2.8 CPU-s of every CPU
    launch on the slower machine)."""
    job = write_job(gpt_job(tmp_path / "run"), tmp_path / "job.toml")
    check = (
        "import sys; from shardwise.training.config.load import load_config; "
        "from shardwise.training.run import check_job; "
        f"check_job(load_config({str(job)!r}), 2, 2, devices_here=False); "
        "print('torch._dynamo' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, cwd=REPO, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr[-2000:]
