"""The models people train, as transformers builds them (tests/hf_models.py: tiny configs, no
download), under every layout against one process: Llama-family decoders (Llama untied and tied,
Mistral, Qwen2: rotary embeddings, RMSNorm, SwiGLU, grouped-query attention) split by the plans
transformers declares, BERT (masked language model and classifier) and transformers' ResNet
(batch norms in every pipeline stage), which declare none, by shardwise's plan and by tracing.

Each cell of `MATRIX` is what docs/training.md's table says (a test keeps the two the same):
`=` trains as one process does (losses within 1e-5 relative at every step; parameters and
buffers within 2e-5, batch-norm statistics 5e-5; the export loads strictly into the stock class
and gives the run's own evaluation loss), or a refusal before launch, one line, whose words are
given. Under data parallelism a batch norm's statistics are the first replica's, from its own
half of each batch (as docs/training.md says): there they are checked finite, not equal.

torchvision's resnet18 is not here: PyPI's torchvision builds load only beside torch's CUDA
build (`libc10_cuda.so`), and these machines run torch's CPU build (constraints.txt).
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import assert_same_training, gpt_job, outcome, train_in_workers

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("transformers") is None,
        reason="transformers is not installed (pip install 'shardwise[hf]'; make test does)",
    ),
]
STEPS = 6
ALL = range(1, STEPS + 1)
STATS_ATOL = 5e-5  # batch-norm statistics, as in test_foreign_models.py

TEXT = {"name": "text", "args": {"seq_len": 16, "max_bytes": 20_000}}
MASKED = {"name": "tests.hf_models:masked_text", "args": {"seq_len": 16, "max_bytes": 20_000}}
CLASSES = {"name": "tests.hf_models:text_classes", "args": {"seq_len": 16, "max_bytes": 20_000}}
DIGITS = {"name": "digits", "args": {"image_size": 64}}  # the last stage at 2×2, not 1×1
LM_TRAIN = {"steps": STEPS, "global_batch": 8, "micro_batch": 2, "lr": 3e-3}
# a traced pipeline pads the held-out set's last batch to its micro-batch: 62 in batches of 8
EVAL = {"max_samples": 62, "batch": 8}


def _model(name: str, **args: Any) -> dict[str, Any]:
    return {"name": f"tests.hf_models:{name}", "args": args}


# family: (its job's sections, the stock class its export loads into)
FAMILIES: dict[str, tuple[dict[str, Any], str]] = {
    "Llama": ({"model": _model("llama", layers=2), "data": TEXT}, "LlamaForCausalLM"),
    "Llama, tied embeddings": (
        {"model": _model("llama", layers=2, tied=True), "data": TEXT},
        "LlamaForCausalLM",
    ),
    "Mistral": (
        {"model": _model("decoder", family="mistral", layers=2), "data": TEXT},
        "MistralForCausalLM",
    ),
    "Qwen2": (
        {"model": _model("decoder", family="qwen2", layers=2), "data": TEXT},
        "Qwen2ForCausalLM",
    ),
    "BERT, masked LM": ({"model": _model("bert_mlm", layers=4), "data": MASKED}, "BertForMaskedLM"),
    "BERT, classifier": (
        {"model": _model("bert_classifier", layers=4), "data": CLASSES},
        "BertForSequenceClassification",
    ),
    "ResNet": (
        {
            "model": _model("resnet"),
            "data": DIGITS,
            "train": {"steps": STEPS, "global_batch": 16, "micro_batch": 4, "lr": 1e-2},
        },
        "ResNetForImageClassification",
    ),
}
BATCH_NORMS = {"ResNet"}

# layout: (its [parallel] section, world size)
PIPELINES = {
    "PP GPipe": {"pp": 2, "pipeline_schedule": "GPipe"},
    "PP 1F1B": {"pp": 2, "pipeline_schedule": "1F1B"},
    "PP Interleaved1F1B, 1 stage per rank": {
        "pp": 2,
        "pipeline_schedule": "Interleaved1F1B",
        "stages_per_rank": 1,
    },
    "PP Interleaved1F1B": {"pp": 2, "pipeline_schedule": "Interleaved1F1B"},
    "PP LoopedBFS": {"pp": 2, "pipeline_schedule": "LoopedBFS"},
    "PP InterleavedZeroBubble": {"pp": 2, "pipeline_schedule": "InterleavedZeroBubble"},
    "PP ZBVZeroBubble": {"pp": 2, "pipeline_schedule": "ZBVZeroBubble"},
    "PP DualPipeV": {"pp": 2, "pipeline_schedule": "DualPipeV"},
}
LAYOUTS: dict[str, tuple[dict[str, Any], int]] = {
    "DDP": ({}, 2),
    "FSDP": ({"dp_shard": 2}, 2),
    "FSDP + recompute": ({"dp_shard": 2, "activation_checkpoint": "full"}, 2),
    "TP": ({"tp": 2}, 2),
    **{name: (parallel, 2) for name, parallel in PIPELINES.items()},
    "FSDP 2 × TP 2": ({"dp_shard": 2, "tp": 2}, 4),
    "DP 2 × PP 2": ({"dp_replicate": 2, "pp": 2}, 4),
    "PP 2 × TP 2": ({"pp": 2, "tp": 2}, 4),
}
EQUAL = "="
NO_TP_TRACED = "refused: tensor parallelism cannot split a traced pipeline stage"
NO_TP_PLAN = "refused: needs a tensor-parallel plan (ResNetForImageClassification declares none)"
MATRIX: dict[str, dict[str, str]] = {family: dict.fromkeys(LAYOUTS, EQUAL) for family in FAMILIES}
for _family in ("BERT, masked LM", "BERT, classifier", "ResNet"):
    MATRIX[_family]["PP 2 × TP 2"] = NO_TP_TRACED  # not a sequence of blocks: traced
for _layout in ("TP", "FSDP 2 × TP 2"):
    MATRIX["ResNet"][_layout] = NO_TP_PLAN  # convolutions: no style of torch's splits them


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-")


def _job(root: Path, family: str, parallel: dict[str, Any]) -> dict[str, Any]:
    sections, _ = FAMILIES[family]
    merged: dict[str, Any] = {"train": LM_TRAIN, "eval": EVAL, **sections}
    merged = {k: dict(v) for k, v in merged.items()}
    merged["parallel"] = parallel
    merged["checkpoint"] = {"every_steps": 0}  # the last step's only
    return gpt_job(root, **merged).model_dump(mode="json")


def _run_name(family: str, layout: str) -> str:
    return f"{_slug(family)}--{_slug(layout)}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("hf-zoo")
    failures: dict[str, str] = {}
    by_world: dict[int, list[tuple[str, dict[str, Any], None]]] = {1: [], 2: [], 4: []}
    for family in FAMILIES:
        by_world[1].append(
            (_run_name(family, "one"), _job(root / _run_name(family, "one"), family, {}), None)
        )
        for layout, (parallel, world) in LAYOUTS.items():
            if MATRIX[family][layout] == EQUAL:
                name = _run_name(family, layout)
                by_world[world].append((name, _job(root / name, family, parallel), None))
    for world, todo in by_world.items():
        failures |= train_in_workers(world, todo, timeout=1800)
    return {"root": root, "failures": failures}


CELLS = [(f, layout) for f in FAMILIES for layout in LAYOUTS if MATRIX[f][layout] == EQUAL]


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first test also runs the module's ~110 jobs (2 min here)
@pytest.mark.parametrize(("family", "layout"), CELLS, ids=[_run_name(*c) for c in CELLS])
def test_every_layout_trains_as_one_process(runs, family, layout):
    reference = outcome(runs, _run_name(family, "one"), STEPS)
    got = outcome(runs, _run_name(family, layout), STEPS)
    statistics_apart = family in BATCH_NORMS and _data_parallel(LAYOUTS[layout][0])
    if statistics_apart:  # each replica's own statistics: real, not one process's
        for name, value in got[1].items():
            if "running" in name or "num_batches" in name:
                assert torch.isfinite(value.float()).all(), name
        got = (got[0], {k: v for k, v in got[1].items() if not _statistic(k)})
        reference = (reference[0], {k: v for k, v in reference[1].items() if not _statistic(k)})
    atol = STATS_ATOL if family in BATCH_NORMS else 2e-5
    assert_same_training(got, reference, ALL, param_atol=atol)


def _data_parallel(parallel: dict[str, Any]) -> bool:
    return parallel.get("dp_shard", 1) > 1 or parallel.get("dp_replicate", 1) > 1 or not parallel


def _statistic(name: str) -> bool:
    return "running" in name or "num_batches" in name


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("family", "layout"), CELLS, ids=[_run_name(*c) for c in CELLS])
def test_the_export_loads_into_the_stock_class_and_gives_the_runs_evaluation(
    runs, family, layout, tmp_path, repo_cwd
):
    """`shardwise export` of the run's last checkpoint loads strictly (every name and shape)
    into the stock transformers class, whose loss on the held-out samples the run evaluated is
    the run's own eval/loss: no buffer, tied weight or layer was left behind."""
    import transformers

    from shardwise.training import job_names
    from shardwise.training.checkpoint.export import export_safetensors, load_exported
    from shardwise.training.config.load import load_config
    from shardwise.training.trainer.step import batch_sums

    name = _run_name(family, layout)
    if name in runs["failures"]:
        pytest.fail(f"{name} failed:\n{runs['failures'][name]}")
    run_dir = runs["root"] / name
    config = load_config(run_dir / "config.toml")
    exported = tmp_path / "model.safetensors"
    export_safetensors(run_dir / "checkpoints" / f"step_{STEPS:08d}", exported)
    model = job_names.build_model(config)
    assert type(model) is getattr(transformers, FAMILIES[family][1])
    model.load_state_dict(load_exported(exported))  # strict
    _, held_out = job_names.build_datasets(config)
    count = min(len(held_out), config.eval.max_samples or len(held_out))
    inputs = torch.stack([held_out[i][0] for i in range(count)])
    target = torch.stack([held_out[i][1] for i in range(count)])
    model.eval()
    with torch.no_grad():
        sums = batch_sums(job_names.cross_entropy, model(inputs), target)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert math.isfinite(summary["metrics"]["eval/loss"])
    assert float(sums[0] / sums[2]) == pytest.approx(summary["metrics"]["eval/loss"], rel=1e-5)


REFUSED = [(f, layout) for f in FAMILIES for layout in LAYOUTS if MATRIX[f][layout] != EQUAL]


@pytest.mark.parametrize(("family", "layout"), REFUSED, ids=[_run_name(*c) for c in REFUSED])
def test_the_other_cells_are_refused_before_launch(family, layout, tmp_path, repo_cwd):
    from shardwise.common.errors import ConfigError
    from shardwise.training.config.derive import derive
    from shardwise.training.config.schema import JobConfig
    from shardwise.training.parallel.checks import check_layout

    parallel, world = LAYOUTS[layout]
    config = JobConfig.model_validate(_job(tmp_path, family, parallel))
    words = MATRIX[family][layout].removeprefix("refused: ").split(" (")[0]
    with pytest.raises(ConfigError, match=words):
        check_layout(config, derive(config, world))


def table() -> str:
    """The docs' table of families by layouts, from `MATRIX`."""
    columns = ["DDP", "FSDP", "FSDP + recompute", "TP", "PP, every schedule"]
    columns += ["FSDP 2 × TP 2", "DP 2 × PP 2", "PP 2 × TP 2"]
    refusals: list[str] = []

    def cell(family: str, column: str) -> str:
        if column == "PP, every schedule":
            values = {MATRIX[family][p] for p in PIPELINES}
            assert len(values) == 1, (family, values)
            value = values.pop()
        else:
            value = MATRIX[family][column]
        if value == EQUAL:
            return "="
        if value not in refusals:
            refusals.append(value)
        return f"refused ({refusals.index(value) + 1})"

    lines = ["| model | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    lines += [
        f"| {family} | " + " | ".join(cell(family, c) for c in columns) + " |"
        for family in FAMILIES
    ]
    notes = [f"({i + 1}) {r.removeprefix('refused: ')}" for i, r in enumerate(refusals)]
    return "\n".join(lines) + "\n\n" + "; ".join(notes) + "."


def test_the_docs_table_is_this_matrix(repo_cwd):
    """docs/training.md's table of model families and layouts is generated from MATRIX, which
    the tests above check cell by cell."""
    text = (repo_cwd / "docs" / "training.md").read_text()
    assert table() in text, "docs/training.md's model table differs from:\n" + table()
