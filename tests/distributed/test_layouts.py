"""Every parallel layout trains the same model as one process does: FSDP (ZeRO-2 and ZeRO-3),
tensor parallelism (with and without sequence parallelism), pipeline parallelism under each of
torch's schedules, and the hybrids on 4 ranks. A checkpoint written under one layout resumes under
another and continues the same loss curve.

Every run is the same small GPT (6 pipeline blocks, 4 heads, no dropout) on the same data for 6
steps of global batch 8 (the loss falls by 0.45 in them; 10 steps checked nothing more). The
runs of one world size share one set of worker processes (run one after another), which keeps
the start-up cost of these tests down.

Tolerance: the layouts add and multiply in different orders (sharded reductions, split matmuls,
micro-batches through a pipeline), so fp32 results differ in the last bits; losses agree to 1e-5
relative and parameters to 2e-5 absolute (measured: at most 1e-7 and 2.5e-6).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import (
    assert_same_training,
    gpt_job,
    outcome,
    run_distributed,
    train_in_workers,
)

# The module's runs share one fixture, set up within its first test's time limit: 139 s on the
# development machine, 268 s on one half as fast, and over the default 300 s with a third pytest
# worker on it (tests/DURATIONS.md).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
STEPS = 6
SAVED = 3
"""The step the resumes start from."""
ALL = range(1, STEPS + 1)

MODEL = {"layers": 4, "heads": 4, "hidden": 32, "seq_len": 16, "mlp_ratio": 2, "dropout": 0.0}
BASE = {
    "model": {"args": MODEL},
    "data": {"args": {"seq_len": 16, "max_bytes": 20_000}},
    "train": {"steps": STEPS, "global_batch": 8, "micro_batch": 2, "lr": 3e-3, "warmup_steps": 2},
    "eval": {"max_samples": 16},
    "checkpoint": {"every_steps": SAVED, "keep_last": 5},
}

SCHEDULES = [
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
]
TWO_RANKS: dict[str, dict[str, Any]] = {
    "fsdp-zero3": {"dp_shard": 2},
    "fsdp-zero2": {"dp_shard": 2, "reshard_after_forward": False},
    "fsdp-zero3-full-recompute": {"dp_shard": 2, "activation_checkpoint": "full"},
    "tp": {"tp": 2},
    "tp-sequence-parallel": {"tp": 2, "sequence_parallel": True},
    "tp-selective-recompute": {"tp": 2, "activation_checkpoint": "selective"},
    **{f"pp-{s}": {"pp": 2, "pipeline_schedule": s} for s in SCHEDULES},
}
FOUR_RANKS: dict[str, dict[str, Any]] = {
    "dp2-tp2": {"dp_replicate": 2, "tp": 2},
    "dp2-pp2": {"dp_replicate": 2, "pp": 2},
    "pp2-tp2": {"pp": 2, "tp": 2},
    "hsdp-2x2": {"dp_replicate": 2, "dp_shard": 2},
    "fsdp2-tp2": {"dp_shard": 2, "tp": 2},
}
# A user's model by import path (examples/tabular.py, an nn.Sequential): its own tensor-parallel
# plan, and a pipeline split balanced by measured cost.
USER_MODEL = {
    "model": {"name": "examples.tabular:build_model", "args": {"hidden": 32, "dropout": 0.0}},
    "data": {"name": "examples.tabular:build_datasets", "args": {}},
    "train": {"steps": STEPS, "global_batch": 32, "micro_batch": 8, "lr": 1e-2},
    "eval": {"max_samples": 64},
}
USER_LAYOUTS: dict[str, dict[str, Any]] = {
    "user-tp": {"tp": 2, "tp_plan": "examples.tabular:tp_plan"},
    "user-pp-cost": {"pp": 2, "pipeline_schedule": "GPipe", "pipeline_balance": "cost"},
}
# (name, saved by, resumed under, world size): checkpoints at step SAVED continue under another
# layout
RESUMES = [
    ("fsdp2-to-one-process", "fsdp-zero3", {}, 1),
    ("pp2-to-one-process", "pp-1F1B", {}, 1),
    ("tp2-to-fsdp2", "tp", {"dp_shard": 2}, 2),
]


SOURCES = {source for _, source, _, _ in RESUMES}


def job(run_dir: Path, parallel: dict[str, Any]) -> dict[str, Any]:
    """The layout's run; only the resumes' sources also save step SAVED (every run saves its
    last: the others' mid-run saves were 6% of the fixture's time)."""
    sections = {k: dict(v) for k, v in BASE.items()}
    sections["parallel"] = parallel
    if run_dir.name not in SOURCES:
        sections["checkpoint"] = {"every_steps": 0}
    return gpt_job(run_dir, **sections).model_dump(mode="json")


def user_job(run_dir: Path, parallel: dict[str, Any]) -> dict[str, Any]:
    sections = {**USER_MODEL, "parallel": parallel}
    sections["train"] = {**USER_MODEL["train"], "loss": "examples.tabular:loss"}
    return gpt_job(run_dir, **sections).model_dump(mode="json")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("layouts")
    failures = train_in_workers(
        1,
        [
            ("reference", job(root / "reference", {}), None),
            ("user-reference", user_job(root / "user-reference", {}), None),
        ],
    )
    failures |= train_in_workers(
        2,
        [(n, job(root / n, p), None) for n, p in TWO_RANKS.items()]
        + [(n, user_job(root / n, p), None) for n, p in USER_LAYOUTS.items()],
    )
    failures |= train_in_workers(4, [(n, job(root / n, p), None) for n, p in FOUR_RANKS.items()])
    for world in (1, 2):
        failures |= train_in_workers(
            world,
            [
                (
                    name,
                    job(root / name, layout),
                    str(root / source / f"checkpoints/step_{SAVED:08d}"),
                )
                for name, source, layout, size in RESUMES
                if size == world
            ],
        )
    return {"root": root, "failures": failures}


def summary(runs: dict[str, Any], name: str) -> dict[str, Any]:
    return json.loads((runs["root"] / name / "summary.json").read_text())


@pytest.mark.parametrize("name", [*TWO_RANKS, *FOUR_RANKS])
def test_layout_matches_one_process(runs, name):
    reference = outcome(runs, "reference", STEPS)
    assert reference[0][STEPS] < reference[0][1] - 0.3  # it trains: equality is not trivial
    assert_same_training(outcome(runs, name, STEPS), reference, ALL)


@pytest.mark.parametrize("name", USER_LAYOUTS)
def test_user_model_layout_matches_one_process(runs, name):
    reference = outcome(runs, "user-reference", STEPS)
    assert reference[0][STEPS] < reference[0][1] - 0.1
    assert_same_training(outcome(runs, name, STEPS), reference, ALL)


@pytest.mark.parametrize(("name", "source", "layout", "world"), RESUMES)
def test_checkpoint_resumes_under_another_layout(runs, name, source, layout, world):
    """Model, optimizer and data position carry over: the resumed run reads the samples the
    first run would have read next and follows the uninterrupted curve."""
    assert summary(runs, name)["resumed_from"] == SAVED
    assert_same_training(
        outcome(runs, name, STEPS), outcome(runs, "reference", STEPS), range(SAVED + 1, STEPS + 1)
    )


def test_fsdp_holds_half_of_the_state_per_rank(runs):
    whole = summary(runs, "reference")["memory"][0]
    for rank in summary(runs, "fsdp-zero3")["memory"]:
        for key in ("params", "grads", "optimizer"):
            assert rank[key] == pytest.approx(whole[key] / 2, rel=0.03), key


def test_tensor_parallel_splits_the_layers(runs):
    whole = summary(runs, "reference")["memory"][0]["params"]
    for rank in summary(runs, "tp")["memory"]:
        # embeddings, norms and biases of row-split layers stay whole; the matrices split
        assert whole * 0.5 < rank["params"] < whole * 0.75


def test_pipeline_reports_measured_and_theoretical_bubble(runs):
    for rank in summary(runs, "pp-GPipe")["memory"]:
        assert rank["bubble_theory"] == pytest.approx((2 - 1) / (4 + 2 - 1))
        assert 0.0 <= rank["bubble"] < 1.0


def _dry_run_each(jobs: list[tuple[str, dict[str, Any]]]) -> dict[str, str]:
    import traceback

    from shardwise.training.config.schema import JobConfig
    from shardwise.training.trainer.dry_run import dry_run

    failures = {}
    for name, config in jobs:
        try:
            dry_run(JobConfig.model_validate(config), torch.device("cpu"))
        except Exception:
            failures[name] = traceback.format_exc()
    return failures


@pytest.mark.parametrize(
    ("world", "layouts"),
    [(2, {"ddp": {}, **TWO_RANKS}), (4, FOUR_RANKS)],
    ids=["2-ranks", "4-ranks"],
)
def test_dry_run_builds_every_layout(tmp_path, world, layouts):
    """`--dry-run` lays the model out on the meta device under every layout (DDP included,
    which cannot wrap meta parameters) and allocates nothing."""
    jobs = [(n, job(tmp_path / n, p)) for n, p in layouts.items()]
    failed = {n: tb for f in run_distributed(_dry_run_each, world, jobs) for n, tb in f.items()}
    assert not failed, "\n".join(f"{n}:\n{tb}" for n, tb in failed.items())
    assert not any((tmp_path / n).exists() for n in layouts)  # nothing written
