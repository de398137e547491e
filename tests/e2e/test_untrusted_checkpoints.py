"""A checkpoint is data, never code: a `.metadata` or a value replaced by a pickle that runs
code (the manifest updated to match, so checksums pass) is refused by `--resume` and `export`
with one line and exit 2, and the code never runs."""

from __future__ import annotations

import json
import pickle
import shutil
import sys
from pathlib import Path

import pytest
import torch

import helpers
import shardwise
from helpers import digits_job, load_params
from shardwise.training.checkpoint.disk_layout import MANIFEST, file_digest
from shardwise.training.checkpoint.export import export_safetensors, load_exported

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]


class Touches:
    """Unpickling it creates a file: the proof that a checkpoint ran code."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("trusted")
    summary = shardwise.train(digits_job(run_dir, train={"steps": 2}), nproc=1)
    assert summary is not None and summary.checkpoint is not None
    return Path(summary.checkpoint)


def doctored(checkpoint: Path, where: Path, file: str, marker: Path) -> Path:
    """A copy of `checkpoint` whose `file` is a pickle that touches `marker` when loaded, with
    its manifest updated to match."""
    copy = where / "checkpoints" / checkpoint.name
    shutil.copytree(checkpoint, copy)
    (copy / file).write_bytes(pickle.dumps(Touches(marker)))
    manifest = json.loads((copy / MANIFEST).read_text())
    manifest["files"][file] = file_digest(copy / file)
    (copy / MANIFEST).write_text(json.dumps(manifest))
    return copy


def test_export_refuses_metadata_that_would_run_code(tmp_path, checkpoint):
    marker = tmp_path / "ran"
    copy = doctored(checkpoint, tmp_path, ".metadata", marker)
    out = tmp_path / "out.safetensors"
    done = helpers.shardwise_command("export", str(copy), str(out), timeout=120)
    assert done.returncode == 2, done.stderr
    assert not marker.exists()
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert "not a checkpoint's metadata" in done.stderr
    assert "could run code" in done.stderr
    assert not out.exists() and not out.with_name(out.name + ".partial").exists()


def test_resume_refuses_metadata_that_would_run_code(tmp_path, checkpoint):
    marker = tmp_path / "ran"
    copy = doctored(checkpoint, tmp_path, ".metadata", marker)
    with pytest.raises(shardwise.ConfigError, match="could run code"):
        shardwise.train(digits_job(tmp_path, train={"steps": 4}), nproc=1, resume=str(copy))
    assert not marker.exists()


def test_resume_refuses_a_checkpoint_of_another_model_in_one_line(tmp_path, checkpoint):
    """Named before launch, instead of DCP failing in every rank on a name it cannot find; a
    default written out is the same model."""
    other = digits_job(tmp_path, model={"name": "cnn", "args": {"channels": 4}}, train={"steps": 4})
    with pytest.raises(shardwise.ConfigError) as caught:
        shardwise.train(other, nproc=1, resume=str(checkpoint))
    assert "checkpoint is for model mlp(" in str(caught.value)
    assert "this job builds cnn(channels=4, classes=10, image_size=8)" in str(caught.value)
    same = digits_job(tmp_path / "same", train={"steps": 3})
    same.model.args = {**same.model.args, "classes": 10}
    summary = shardwise.train(same, nproc=1, resume=str(checkpoint))
    assert summary is not None and summary.step == 3


def test_weights_start_a_run_from_a_safetensors_file(tmp_path, checkpoint):
    """The safe path: `export` the weights (tensors only), start a new run from them with
    `model.init_from` (here sharded by FSDP over 2 ranks); a wrong file is one line before
    launch."""
    weights = tmp_path / "weights.safetensors"
    export_safetensors(checkpoint, weights)
    run_dir = tmp_path / "from-weights"
    job = digits_job(
        run_dir,
        model={"init_from": str(weights)},
        train={"steps": 1, "lr": 1e-30, "warmup_steps": 0},  # one step that moves nothing
        parallel={"dp_shard": 2},
    )
    summary = shardwise.train(job, nproc=2)
    assert summary is not None and summary.checkpoint is not None
    started, exported = load_params(summary.checkpoint), load_exported(weights)
    assert started.keys() == exported.keys()
    for name, value in exported.items():
        torch.testing.assert_close(started[name], value, rtol=0, atol=1e-6)

    wrong = digits_job(tmp_path / "wrong", model={"init_from": str(weights), "args": {"hidden": 8}})
    with pytest.raises(shardwise.ConfigError, match=r"is \[8, 64\] in the file|is \[32, 64\]"):
        shardwise.train(wrong, nproc=1)
    missing = digits_job(tmp_path / "missing", model={"init_from": str(tmp_path / "nope")})
    with pytest.raises(shardwise.ConfigError, match="no such file"):
        shardwise.train(missing, nproc=1)


@pytest.mark.parametrize(
    ("output", "message"),
    [
        ("a-dir", "is a directory"),
        ("a-file/out.safetensors", "is not a directory"),
        ("/proc/shardwise-out.safetensors", "cannot write"),
    ],
    ids=["directory", "under-a-file", "unwritable"],
)
def test_export_to_where_it_cannot_write_is_one_line_and_leaves_nothing(
    tmp_path, checkpoint, output, message
):
    (tmp_path / "a-dir").mkdir()
    (tmp_path / "a-file").write_text("not a directory")
    out = Path(output) if output.startswith("/") else tmp_path / output
    done = helpers.shardwise_command("export", str(checkpoint), str(out), timeout=120)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not out.with_name(out.name + ".partial").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-dir", "a-file"]
