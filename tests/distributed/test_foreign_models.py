"""Models nobody on the project wrote train under every layout as they do on one process:
BatchNorm (running statistics are buffers, which must never see anything but real batches), tied
weights, forwards that are not a sequence of blocks, and Hugging Face models.

Every job of one world size runs in one set of worker processes, one after another. Tolerance as
in test_layouts.py: layouts add in different orders, so fp32 results differ in the last bits;
losses agree to 1e-5 relative, parameters and buffers to 2e-5 absolute.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import Any, get_args

import pytest
import torch

from foreign_models import torchvision_problem
from helpers import assert_same_training, gpt_job, outcome, train_in_workers
from shardwise.training.checkpoint.export import export_safetensors, load_exported
from shardwise.training.config.schema import Schedule

pytestmark = pytest.mark.slow
LOSS_RTOL, PARAM_ATOL = 1e-5, 2e-5
STATS_ATOL = 5e-5  # torch's norms' running statistics (test_torchs_norms_train_in_every_stage…)
STEPS = 8
ALL = range(1, STEPS + 1)

BN_CNN = {
    "model": {"name": "tests.foreign_models:bn_cnn", "args": {}},
    "data": {"name": "digits", "args": {}},
    "train": {"steps": STEPS, "global_batch": 16, "micro_batch": 4, "lr": 1e-2},
    "eval": {"max_samples": 64},
}
# tied weights: the output layer is the embedding
TIED = {
    "model": {"name": "tests.foreign_models:tied_lm", "args": {}},
    "data": {"args": {"seq_len": 16, "max_bytes": 20_000}},
    "train": {"steps": STEPS, "global_batch": 8, "micro_batch": 2, "lr": 3e-3},
}
TIED_META = {**TIED, "model": {**TIED["model"], "init": "meta"}}
TIED_PLAN = "tests.foreign_models:tied_lm_tp_plan"
# models that are not a sequence of blocks: pipelines trace them
# (62 held-out samples in batches of 8: a traced pipeline pads the last one to its micro-batch)
TRACEABLE = {**BN_CNN, "eval": {"max_samples": 62, "batch": 8}}
# torch's own norms with running statistics in four blocks (foreign_models.norm_blocks): 8
# micro-batches of 4 per step, enough for every schedule (4 stages on 2 ranks for the looped and
# V ones); not of 2, where BatchNorm1d's output is ±1 whatever its input, so the weight before it
# gets gradients of rounding noise, which Adam makes full steps of, and the layouts part after 6
# steps
NORMS = {**BN_CNN, "model": {"name": "tests.foreign_models:norm_blocks", "args": {}}}
NORMS["train"] = {**BN_CNN["train"], "global_batch": 32, "micro_batch": 4}
SCHEDULES = get_args(Schedule)  # every schedule the config accepts
MP_CNN = {**TRACEABLE, "model": {"name": "tests.foreign_models:model_parallel_cnn", "args": {}}}
MARKED_CNN = {**TRACEABLE, "model": {"name": "tests.foreign_models:marked_cnn", "args": {}}}
RESIDUAL = {**TRACEABLE, "model": {"name": "tests.foreign_models:residual_mlp", "args": {}}}
LATE_NORM = {**TRACEABLE, "model": {"name": "tests.foreign_models:late_norm_cnn", "args": {}}}
# a stock Hugging Face GPT-2 (examples/hf_gpt2.py), without dropout so layouts compare exactly
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
NO_TRANSFORMERS = "transformers is not installed (pip install 'shardwise[hf]'; make test does)"
GPT2_ARGS = {"n_layer": 2, "n_embd": 32, "n_head": 4, "n_positions": 16}
GPT2_ARGS |= {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
HF_GPT2 = {
    **TIED,
    "model": {"name": "examples.hf_gpt2:build_model", "args": GPT2_ARGS},
    "checkpoint": {"every_steps": 4},
}
HF_LAYOUTS = {
    "hf-ddp": {},
    "hf-fsdp": {"dp_shard": 2},
    "hf-tp": {"tp": 2},
    "hf-pp": {"pp": 2},
    "hf-fsdp-recompute": {"dp_shard": 2, "activation_checkpoint": "full"},
}
HF_FOUR = {"hf-fsdp2-tp2": {"dp_shard": 2, "tp": 2}, "hf-dp2-pp2": {"dp_replicate": 2, "pp": 2}}
ONE_PROCESS = {
    "bn-cnn": (BN_CNN, {}),
    "norms": (NORMS, {}),
    "tied": (TIED, {}),
    "tied-meta": (TIED_META, {}),
    "mp-cnn": (MP_CNN, {}),
    "residual": (RESIDUAL, {}),
    "late-norm": (LATE_NORM, {}),
}
TWO_RANKS = {
    "bn-cnn-pp-GPipe": (BN_CNN, {"pp": 2, "pipeline_schedule": "GPipe"}),
    "bn-cnn-pp-1F1B": (BN_CNN, {"pp": 2, "pipeline_schedule": "1F1B"}),
}
# the built-in GPT with dropout, under a pipeline: resumed at step 4 it must draw the same masks
GPT_DROPOUT = {
    "model": {"args": {"layers": 2, "heads": 2, "hidden": 32, "seq_len": 16, "dropout": 0.1}},
    "data": {"args": {"seq_len": 16, "max_bytes": 20_000}},
    "train": {"steps": STEPS, "global_batch": 8, "micro_batch": 2, "lr": 3e-3},
    "checkpoint": {"every_steps": 4},
}
TWO_RANKS["gpt-dropout-pp"] = (GPT_DROPOUT, {"pp": 2})
TWO_RANKS |= {f"norms-pp-{s}": (NORMS, {"pp": 2, "pipeline_schedule": s}) for s in SCHEDULES}
TWO_RANKS |= {"norms-ddp": (NORMS, {}), "norms-fsdp": (NORMS, {"dp_shard": 2})}
TIED_LAYOUTS = {
    "tied-ddp": {},
    "tied-fsdp": {"dp_shard": 2},
    "tied-tp": {"tp": 2, "tp_plan": TIED_PLAN},
    "tied-pp-1F1B": {"pp": 2},
    "tied-pp-ZBVZeroBubble": {"pp": 2, "pipeline_schedule": "ZBVZeroBubble"},
}
TWO_RANKS |= {name: (TIED, parallel) for name, parallel in TIED_LAYOUTS.items()}
TWO_RANKS["tied-meta-fsdp"] = (TIED_META, {"dp_shard": 2})
TRACED = {
    "mp-cnn-split-by-name": (
        MP_CNN,
        {"pp": 2, "pipeline_schedule": "GPipe", "pipeline_split": ["classifier"]},
    ),
    "mp-cnn-pipe-split-markers": (MARKED_CNN, {"pp": 2}),
    "residual-pp-automatic": (RESIDUAL, {"pp": 2}),
    "residual-pp-interleaved": (RESIDUAL, {"pp": 2, "pipeline_schedule": "Interleaved1F1B"}),
    # a batch norm in the last stage: shape inference differentiates a forward of it
    "late-norm-split-by-name": (LATE_NORM, {"pp": 2, "pipeline_split": ["classifier"]}),
}
TRACED_REFERENCES = ("mp-cnn", "residual", "late-norm")  # the one-process runs
TWO_RANKS |= TRACED
TWO_RANKS["residual-fsdp"] = (RESIDUAL, {"dp_shard": 2})
if HAS_TRANSFORMERS:
    ONE_PROCESS["hf"] = (HF_GPT2, {})
    TWO_RANKS |= {name: (HF_GPT2, parallel) for name, parallel in HF_LAYOUTS.items()}
# torchvision's resnet18 on 32×32 three-channel digits, where torchvision loads
NO_TORCHVISION = torchvision_problem()
RESNET18 = {
    **BN_CNN,
    "model": {"name": "tests.foreign_models:torchvision_resnet18", "args": {}},
    "data": {"name": "digits", "args": {"image_size": 32, "channels": 3}},
    "train": {"steps": STEPS, "global_batch": 16, "micro_batch": 8, "lr": 1e-3},
    "eval": {"max_samples": 62, "batch": 8},
}
RESNET18_LAYOUTS = {"resnet18-ddp": {}, "resnet18-pp": {"pp": 2, "pipeline_schedule": "GPipe"}}
if NO_TORCHVISION is None:
    ONE_PROCESS["resnet18"] = (RESNET18, {})
    TWO_RANKS |= {name: (RESNET18, parallel) for name, parallel in RESNET18_LAYOUTS.items()}
RESUMED = {"gpt-dropout-pp-resumed": (GPT_DROPOUT, {"pp": 2}, "gpt-dropout-pp")}
FOUR_RANKS = {"bn-cnn-dp2-pp2": (BN_CNN, {"dp_replicate": 2, "pp": 2})}
if HAS_TRANSFORMERS:
    FOUR_RANKS |= {name: (HF_GPT2, parallel) for name, parallel in HF_FOUR.items()}
    RESUMED["hf-tp-resumed-on-one-process"] = (HF_GPT2, {}, "hf-tp")


def _world(parallel: dict[str, Any]) -> int:
    return math.prod(parallel.get(axis, 1) for axis in ("pp", "dp_replicate", "dp_shard", "tp"))


SOURCES = {source for _, _, source in RESUMED.values()}


def job(run_dir: Path, sections: dict[str, Any], parallel: dict[str, Any]) -> dict[str, Any]:
    """The run; only the resumed runs' sources save step 4 too (every run saves its last)."""
    merged = {k: dict(v) for k, v in sections.items()}
    merged["parallel"] = parallel
    if run_dir.name not in SOURCES:
        merged["checkpoint"] = {"every_steps": 0}
    return gpt_job(run_dir, **merged).model_dump(mode="json")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("foreign")
    failures: dict[str, str] = {}
    for world, jobs in ((1, ONE_PROCESS), (2, TWO_RANKS), (4, FOUR_RANKS)):
        todo = [(n, job(root / n, s, p), None) for n, (s, p) in jobs.items()]
        failures |= train_in_workers(world, todo)
    for world in (1, 2):  # after the runs they resume from
        todo = [
            (n, job(root / n, s, p), str(root / source / "checkpoints/step_00000004"))
            for n, (s, p, source) in RESUMED.items()
            if _world(p) == world
        ]
        if todo:
            failures |= train_in_workers(world, todo)
    return {"root": root, "failures": failures}


def evaluation(runs: dict[str, Any], name: str) -> dict[str, float]:
    summary = json.loads((runs["root"] / name / "summary.json").read_text())
    return {k: v for k, v in summary["metrics"].items() if k.startswith("eval/")}


@pytest.mark.parametrize("name", ["bn-cnn-pp-GPipe", "bn-cnn-pp-1F1B"])
def test_batchnorm_statistics_under_a_pipeline_match_one_process(runs, name):
    """Parameters and running statistics (mean, variance, batches tracked) as one process has
    them: the pipeline's shape inference never touches a buffer."""
    reference = outcome(runs, "bn-cnn", STEPS)
    assert reference[1]["1.num_batches_tracked"] == STEPS * 4  # one per micro-batch
    assert_same_training(outcome(runs, name, STEPS), reference, ALL)
    # evaluation normalises with those statistics
    assert evaluation(runs, name)["eval/loss"] == pytest.approx(
        evaluation(runs, "bn-cnn")["eval/loss"], rel=LOSS_RTOL
    )


def _exported_statistics(runs: dict[str, Any], name: str, tmp: Path) -> dict[str, torch.Tensor]:
    """The running statistics of the run's last checkpoint, as `shardwise export` writes them."""
    out = tmp / f"{name}.safetensors"
    export_safetensors(runs["root"] / name / "checkpoints" / f"step_{STEPS:08d}", out)
    weights = load_exported(out)
    return {k: v for k, v in weights.items() if "running" in k or "num_batches" in k}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_torchs_norms_train_in_every_stage_under_every_schedule(runs, schedule, tmp_path):
    """torch's BatchNorm2d (momentum 0.1 and None), InstanceNorm2d and BatchNorm1d, in the
    first and the last stage: the losses, parameters and running statistics (mean, variance,
    batches tracked, as the export shows them) are the one process's, which accumulates the
    same 8 micro-batches of 2. Tolerance: losses 1e-5 relative; parameters and statistics 5e-5
    absolute (the statistics follow the weights before them, which Adam moves from gradients
    summed in another order: measured 2.2e-5 on a running mean of 0.87 after 64 updates)."""
    name = f"norms-pp-{schedule}"
    assert name not in runs["failures"], runs["failures"][name]
    reference = outcome(runs, "norms", STEPS)
    assert reference[1]["first.1.num_batches_tracked"] == STEPS * 8  # one per micro-batch
    assert_same_training(outcome(runs, name, STEPS), reference, ALL, param_atol=STATS_ATOL)
    got = _exported_statistics(runs, name, tmp_path)
    want = _exported_statistics(runs, "norms", tmp_path)
    assert got.keys() == want.keys() and "third.1.running_mean" in got
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=STATS_ATOL, msg=key)


def test_under_data_parallelism_the_statistics_are_rank_0s(runs, tmp_path):
    """DDP broadcasts rank 0's buffers before every forward; FSDP leaves each rank its own, and
    the export holds rank 0's: either way the statistics are rank 0's, updated by its 4 of the
    step's 8 micro-batches, and the same under both (parameters, which the ranks average, are
    the one process's; tolerance as above, 5e-5)."""
    for name in ("norms-ddp", "norms-fsdp"):
        assert name not in runs["failures"], runs["failures"][name]
        losses, params = outcome(runs, name, STEPS)
        reference = outcome(runs, "norms", STEPS)
        assert [losses[s] for s in ALL] == pytest.approx(
            [reference[0][s] for s in ALL], rel=LOSS_RTOL
        )
        for key, value in reference[1].items():
            if "running" not in key and "num_batches" not in key:
                torch.testing.assert_close(params[key], value, rtol=0, atol=STATS_ATOL, msg=key)
    ddp = _exported_statistics(runs, "norms-ddp", tmp_path)
    fsdp = _exported_statistics(runs, "norms-fsdp", tmp_path)
    assert int(ddp["first.1.num_batches_tracked"]) == STEPS * 4
    for key, value in ddp.items():
        torch.testing.assert_close(fsdp[key], value, rtol=0, atol=STATS_ATOL, msg=key)


def test_batchnorm_under_data_and_pipeline_parallelism_evaluates(runs):
    """DP 2 × PP 2 (where a ResNet evaluated to nan): the parameters are one process's; each
    replica's running statistics come from its own half of the batch (as under DDP and FSDP), so
    they are not one process's, but real: finite, and counted once per micro-batch it ran."""
    reference = outcome(runs, "bn-cnn", STEPS)
    got_losses, got_state = outcome(runs, "bn-cnn-dp2-pp2", STEPS)
    assert got_losses == pytest.approx(reference[0], rel=LOSS_RTOL)
    for name, value in reference[1].items():
        if "running" in name or "num_batches" in name:
            assert torch.isfinite(got_state[name].float()).all(), name
        else:
            torch.testing.assert_close(got_state[name], value, rtol=0, atol=PARAM_ATOL, msg=name)
    assert got_state["1.num_batches_tracked"] == STEPS * 2  # 2 micro-batches per replica
    got, want = evaluation(runs, "bn-cnn-dp2-pp2"), evaluation(runs, "bn-cnn")
    assert math.isfinite(got["eval/loss"])
    assert got["eval/accuracy"] >= want["eval/accuracy"] - 0.1


def test_a_resumed_pipeline_draws_the_same_dropout_masks(runs):
    """Shape inference runs before the first step of every process, the resumed one included;
    it must leave no trace (buffers, random streams), or the resumed run is not the one that
    never stopped (bitwise, on the same layout)."""
    want_losses, want_state = outcome(runs, "gpt-dropout-pp", STEPS)
    got_losses, got_state = outcome(runs, "gpt-dropout-pp-resumed", STEPS)
    assert [got_losses[s] for s in range(5, STEPS + 1)] == [
        want_losses[s] for s in range(5, STEPS + 1)
    ]
    assert all(torch.equal(got_state[n], v) for n, v in want_state.items())


def assert_tied(state: dict[str, torch.Tensor]) -> None:
    assert torch.equal(state["embed.weight"], state["final.1.weight"])


def test_tied_weights_stay_tied_on_one_process(runs):
    assert_tied(outcome(runs, "tied", STEPS)[1])
    assert_tied(outcome(runs, "tied-meta", STEPS)[1])  # initialised on the meta device


@pytest.mark.parametrize("name", TIED_LAYOUTS)
def test_tied_weights_stay_tied_under_every_layout(runs, name):
    """One process's training, both ends of the tie equal: under a pipeline the stages that
    hold a copy add their gradients (Megatron's embedding group), on one rank or across ranks."""
    got = outcome(runs, name, STEPS)
    assert_tied(got[1])
    assert_same_training(got, outcome(runs, "tied", STEPS), ALL)
    exported = runs["root"] / name / "model.safetensors"
    export_safetensors(runs["root"] / name / "checkpoints" / f"step_{STEPS:08d}", exported)
    assert_tied(load_exported(exported))


def test_tied_weights_initialised_on_the_meta_device_under_fsdp(runs):
    got = outcome(runs, "tied-meta-fsdp", STEPS)
    assert_tied(got[1])
    assert_same_training(got, outcome(runs, "tied-meta", STEPS), ALL)


@pytest.mark.parametrize("name", TRACED)
def test_a_model_that_is_not_a_sequence_of_blocks_pipelines_by_tracing(runs, name):
    """Split by module name, by pipe_split() markers or automatically at its repeated layers:
    one process's losses, parameters and BatchNorm statistics; evaluation (the last batch padded
    to the traced size) with BatchNorm's statistics and without dropout, as in one process."""
    reference = next(r for r in TRACED_REFERENCES if name.startswith(r))
    assert_same_training(outcome(runs, name, STEPS), outcome(runs, reference, STEPS), ALL)
    assert evaluation(runs, name)["eval/loss"] == pytest.approx(
        evaluation(runs, reference)["eval/loss"], rel=LOSS_RTOL
    )


def test_repeated_layers_are_found_for_fsdp(runs):
    assert_same_training(
        outcome(runs, "residual-fsdp", STEPS), outcome(runs, "residual", STEPS), ALL
    )


hf = pytest.mark.skipif(not HAS_TRANSFORMERS, reason=NO_TRANSFORMERS)


@hf
@pytest.mark.parametrize("name", [*HF_LAYOUTS, *HF_FOUR])
def test_a_stock_hugging_face_model_trains_under_every_layout(runs, name):
    """GPT2LMHeadModel as transformers builds it: DDP, FSDP per GPT2Block (found in the
    model), tensor parallel (Conv1D layers, fused query/key/value), a traced pipeline, and
    hybrids; one process's losses and parameters, the tied embeddings tied."""
    got = outcome(runs, name, STEPS)
    assert_same_training(got, outcome(runs, "hf", STEPS), ALL)
    assert torch.equal(got[1]["transformer.wte.weight"], got[1]["lm_head.weight"])


@hf
def test_a_hugging_face_checkpoint_resumes_on_another_layout(runs):
    """Tensor parallel's fused query/key/value (a strided shard) is stored whole, so the
    checkpoint loads on one process and the curve continues."""
    resumed = outcome(runs, "hf-tp-resumed-on-one-process", STEPS)
    assert_same_training(resumed, outcome(runs, "hf", STEPS), range(5, STEPS + 1))


@hf
@pytest.mark.parametrize("name", ["hf-tp", "hf-pp", "hf-fsdp2-tp2"])
def test_a_hugging_face_export_loads_into_the_stock_model(runs, repo_cwd, name):
    from transformers import GPT2LMHeadModel

    from shardwise.common.imports import import_object

    build_model = import_object("examples.hf_gpt2:build_model", "model.name")

    exported = runs["root"] / name / "model.safetensors"
    export_safetensors(runs["root"] / name / "checkpoints" / f"step_{STEPS:08d}", exported)
    model = build_model(**GPT2_ARGS)
    assert isinstance(model, GPT2LMHeadModel)
    model.load_state_dict(load_exported(exported))  # strict: every name and shape
    reference = build_model(**GPT2_ARGS)
    reference.load_state_dict(outcome(runs, "hf", STEPS)[1])
    tokens = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(model(tokens).logits, reference(tokens).logits, rtol=0, atol=1e-4)


@pytest.mark.skipif(NO_TORCHVISION is not None, reason=str(NO_TORCHVISION))
@pytest.mark.parametrize("name", RESNET18_LAYOUTS)
def test_torchvisions_resnet18_trains_as_one_process(runs, name):
    """DDP (the batch norms' statistics rank 0's, so compared for being finite) and a traced
    GPipe pipeline (every statistic one process's)."""
    reference = outcome(runs, "resnet18", STEPS)
    got = outcome(runs, name, STEPS)
    if name == "resnet18-ddp":
        stats = [k for k in got[1] if "running" in k or "num_batches" in k]
        assert all(torch.isfinite(got[1][k].float()).all() for k in stats)
        got = (got[0], {k: v for k, v in got[1].items() if k not in stats})
        reference = (reference[0], {k: v for k, v in reference[1].items() if k not in stats})
    assert_same_training(got, reference, ALL, param_atol=STATS_ATOL)
