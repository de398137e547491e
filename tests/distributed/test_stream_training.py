"""Training on a streamed table (data.name = "parquet") is correct by equivalence, as map-style
data is (tests/distributed/test_ddp.py): the digits written as Parquet files with uneven row
groups, so that fragments, windows and epochs do not line up with steps.

- Every global batch holds the same samples on 1 and 2 data-parallel ranks (checked by sample
  ids, which a batch transform records), and the losses agree within test_ddp's tolerance.
- A rank killed mid-epoch restarts from the checkpoint and ends bitwise equal to the run that
  never stopped, having trained on exactly the samples it would have.
- A resume on data that changed since the checkpoint is refused in one line, unless allowed.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import shardwise
from helpers import digits_job, load_params, losses
from shardwise.common.errors import ConfigError
from shardwise.training.data.digits import build_digits

pytestmark = pytest.mark.slow
RTOL, ATOL = 1e-5, 1e-5
STEPS = 30  # 1,437 training rows in steps of 64: an epoch is 22 steps, so the run crosses one


def write_digits(root: Path) -> Path:
    """The digits' training split as 3 Parquet files of uneven row groups: `pixels` (64 floats)
    and `tag` (id·10 + label, which tests.foreign_models:record_ids splits again)."""
    train, _ = build_digits()
    images = torch.stack([train[i][0].flatten() for i in range(len(train))])
    labels = torch.tensor([int(train[i][1]) for i in range(len(train))])
    root.mkdir(parents=True, exist_ok=True)
    bounds = [0, 500, 1100, len(images)]
    for index, (begin, end) in enumerate(itertools.pairwise(bounds)):
        pixels = pa.FixedSizeListArray.from_arrays(
            pa.array(images[begin:end].flatten().numpy()), 64
        )
        tags = (torch.arange(begin, end) * 10 + labels[begin:end]).numpy()
        pq.write_table(
            pa.table({"pixels": pixels, "tag": tags}), root / f"part-{index}.parquet",
            row_group_size=137 + 50 * index,
        )  # fmt: skip
    return root


def job(run_dir: Path, data: Path, *, allow_changed: bool = False, **sections):
    args = {"path": str(data), "inputs": "pixels", "target": "tag", "shuffle_rows": 300,
            "transform": "foreign_models:record_ids"}  # fmt: skip
    return digits_job(
        run_dir,
        data={"name": "parquet", "args": args, "allow_changed": allow_changed},
        model={"name": "mlp", "args": {"hidden": 32}},
        train={"steps": STEPS, "global_batch": 64, "warmup_steps": 2, **sections.pop("train", {})},
        **sections,
    )


def ids(run_dir: Path, ranks: list[int]) -> list[list[list[int]]]:
    """The samples of each micro-batch each of `ranks` trained on, as recorded, in order."""
    recorded = []
    for rank in ranks:
        lines = (run_dir / "ids" / f"rank{rank}.txt").read_text().splitlines()
        # left out: the table's first rows in file order, which shape the model (before launch,
        # and on every rank at its start), transformed as training batches are
        batches = [[int(i) for i in line.split()] for line in lines]
        recorded.append([b for b in batches if b != list(range(len(b)))])
    return recorded


def steps(run_dir: Path, ranks: int, micro_per_step: int) -> list[list[int]]:
    """The samples of each step, over every rank (sorted: a step's set of samples)."""
    per_rank = ids(run_dir, list(range(ranks)))
    count = len(per_rank[0]) // micro_per_step
    return [
        sorted(
            i
            for rank in per_rank
            for batch in rank[k * micro_per_step : (k + 1) * micro_per_step]
            for i in batch
        )
        for k in range(count)
    ]


def train(run_dir: Path, data: Path, nproc: int, monkeypatch, **sections):
    (run_dir / "ids").mkdir(parents=True)
    monkeypatch.setenv("SHARDWISE_TEST_IDS", str(run_dir / "ids"))
    summary = shardwise.train(job(run_dir, data, **sections), nproc=nproc)
    assert summary is not None and summary.checkpoint is not None
    return summary


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_digits(tmp_path_factory.mktemp("digits") / "table")


def test_global_batches_hold_the_same_samples_on_one_and_two_ranks(tmp_path, data, monkeypatch):
    one = train(tmp_path / "one", data, 1, monkeypatch, train={"micro_batch": 32})
    two = train(
        tmp_path / "two", data, 2, monkeypatch, train={"micro_batch": 32},
        tracking={"mlflow": True, "log_every": 1},
    )  # fmt: skip
    one_steps = steps(tmp_path / "one", 1, 2)
    assert one_steps == steps(tmp_path / "two", 2, 1)
    assert len(one_steps) == STEPS and all(len(s) == 64 for s in one_steps)
    first_epoch = [i for s in one_steps[:22] for i in s]
    assert len(set(first_epoch)) == len(first_epoch) == 22 * 64  # no sample twice in an epoch
    want, got = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert got == pytest.approx(want, rel=RTOL)
    assert want[STEPS] < want[1] - 0.5  # it learns
    a, b = load_params(one.checkpoint), load_params(two.checkpoint)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=RTOL, atol=ATOL)
    config = (tmp_path / "two" / "config.toml").read_text()
    assert 'name = "parquet"' in config
    manifest = json.loads((Path(two.checkpoint) / "shardwise.json").read_text())
    assert manifest["data"]["kind"] == "parquet" and manifest["data"]["files"] == 3
    # MLflow says which data the run trained on (mlflow.log_input)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'two' / 'mlflow.db'}")
    (used,) = client.get_run(two.mlflow_run_id).inputs.dataset_inputs
    assert used.dataset.name == "test-training" and used.dataset.source_type == "parquet"
    assert json.loads(used.dataset.source)["version"] == manifest["data"]
    assert json.loads(used.dataset.profile)["rows"] == 1438


def test_a_killed_rank_resumes_on_exactly_the_samples_of_the_run_that_never_stopped(
    tmp_path, data, monkeypatch
):
    sections = {"checkpoint": {"every_steps": 8, "keep_last": 3}, "fault": {"max_restarts": 1}}
    straight = train(tmp_path / "straight", data, 2, monkeypatch, **sections)
    monkeypatch.setenv("SHARDWISE_FAULT", "kill:rank=1:step=13")
    killed = train(tmp_path / "killed", data, 2, monkeypatch, **sections)
    want, got = losses(tmp_path / "straight"), losses(tmp_path / "killed")
    assert [got[s] for s in range(1, STEPS + 1)] == [want[s] for s in range(1, STEPS + 1)]
    a, b = load_params(straight.checkpoint), load_params(killed.checkpoint)
    assert all(torch.equal(b[n], a[n]) for n in a)
    # each restarted rank read on from step 9 (after the checkpoint of step 8): what it read
    # before the kill, then again from there, as the run that never stopped
    for rank in range(2):
        (recorded,), (want_ids,) = (
            ids(tmp_path / "killed", [rank]),
            ids(tmp_path / "straight", [rank]),
        )
        assert recorded[:8] + recorded[-(STEPS - 8) :] == want_ids


def test_a_resume_on_changed_data_is_refused_in_one_line(tmp_path, data, monkeypatch):
    import shutil

    copy = tmp_path / "table"
    shutil.copytree(data, copy)
    train(tmp_path / "run", copy, 1, monkeypatch, train={"steps": 4})
    pq.write_table(pq.read_table(copy / "part-2.parquet").slice(0, 100), copy / "part-3.parquet")
    longer = {"train": {"steps": 6}}
    with pytest.raises(ConfigError, match="the training data changed since the checkpoint"):
        shardwise.train(job(tmp_path / "run", copy, **longer), nproc=1, resume="auto")
    allowed = job(tmp_path / "run", copy, allow_changed=True, **longer)
    summary = shardwise.train(allowed, nproc=1, resume="auto")
    assert summary is not None and summary.resumed_from == 4


def test_a_users_iterable_dataset_with_a_state_resumes_bitwise(tmp_path, monkeypatch):
    """tests.foreign_models:digits_stream shards itself by the dp_rank/dp_size it is given and
    keeps its position; read through torchdata's StatefulDataLoader, a killed run resumes
    bitwise."""
    sections = {
        "data": {"name": "foreign_models:digits_stream"},
        "checkpoint": {"every_steps": 8, "keep_last": 3},
        "fault": {"max_restarts": 1},
        "train": {"steps": 30, "global_batch": 64, "micro_batch": 16},
    }
    straight = shardwise.train(digits_job(tmp_path / "straight", **sections), nproc=2)
    monkeypatch.setenv("SHARDWISE_FAULT", "kill:rank=1:step=13")
    killed = shardwise.train(digits_job(tmp_path / "killed", **sections), nproc=2)
    assert straight is not None and killed is not None
    want, got = losses(tmp_path / "straight"), losses(tmp_path / "killed")
    assert [got[s] for s in range(1, 31)] == [want[s] for s in range(1, 31)]
    assert want[30] < want[1] - 0.5  # 30 steps cross an epoch of each rank's 719 samples
    a, b = load_params(straight.checkpoint), load_params(killed.checkpoint)
    assert all(torch.equal(b[n], a[n]) for n in a)


def test_a_bad_row_only_reading_finds_stops_the_run_in_one_line_and_it_resumes_once_mended(
    tmp_path, data, monkeypatch
):
    """A null in the last file, written without statistics (so the check before launch cannot
    see it): every rank stops, one line names the file, row group and row; the checkpoint
    before it is whole, and once the file is mended the run continues from it."""
    import shutil

    copy = tmp_path / "table"
    shutil.copytree(data, copy)
    whole = pq.read_table(copy / "part-2.parquet")
    tags = whole.column("tag").to_pylist()
    tags[200] = None
    broken = whole.set_column(1, "tag", pa.array(tags, pa.int64()))
    pq.write_table(broken, copy / "part-2.parquet", row_group_size=150, write_statistics=False)
    (tmp_path / "run" / "ids").mkdir(parents=True)
    monkeypatch.setenv("SHARDWISE_TEST_IDS", str(tmp_path / "run" / "ids"))
    sections = {"checkpoint": {"every_steps": 4}}
    with pytest.raises(ConfigError) as refused:
        shardwise.train(job(tmp_path / "run", copy, **sections), nproc=2)
    message = str(refused.value)
    assert "\n" not in message
    assert "column 'tag' has 1 missing values" in message
    assert "part-2.parquet, row group 1, row 50 first" in message
    assert "--resume auto --set data.allow_changed=true" in message
    saved = sorted((tmp_path / "run" / "checkpoints").glob("step_*"))
    assert saved and load_params(saved[-1])  # the last checkpoint loads
    pq.write_table(whole, copy / "part-2.parquet", row_group_size=150)  # mended
    mended = job(tmp_path / "run", copy, allow_changed=True, **sections)
    summary = shardwise.train(mended, nproc=2, resume="auto")
    assert summary is not None and summary.resumed_from == int(saved[-1].name.split("_")[1])
    assert max(losses(tmp_path / "run")) == STEPS
