"""No pipeline stage starts from uninitialised memory: right after its layout is built, every
parameter and buffer of every stage on every rank holds the value one process starts from, under
every schedule, with one and with several stages per rank, for a model initialised on the meta
device. And a buffer its model computes in `__init__` (a rotary embedding's frequencies, which no
initialiser sets) holds that value, as in a model built in full.

The values must be bitwise equal: each module is initialised on its own, from a generator seeded
by its name, whatever the layout (parallel/meta_init.py)."""

from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path
from typing import Any, get_args

import numpy as np
import pytest
import torch

from helpers import gpt_job, run_distributed
from shardwise.training.config.schema import SINGLE_STAGE_SCHEDULES, V_SCHEDULES, Schedule

pytestmark = pytest.mark.slow

ROPE_LM = {
    "model": {"name": "tests.foreign_models:rope_lm", "args": {}, "init": "meta"},
    "data": {"args": {"seq_len": 8, "max_bytes": 4_000}},
    "train": {"global_batch": 12, "micro_batch": 2},
}
# a stock Llama split by the plan transformers declares: its rotary embedding is outside the
# blocks, its output layer tied to the embedding on another stage
HF_LLAMA = {
    "model": {"name": "tests.hf_models:llama", "args": {"layers": 4, "tied": True}},
    "data": {"args": {"seq_len": 16, "max_bytes": 4_000}},
    "train": {"global_batch": 12, "micro_batch": 2},
}
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
# (schedule, stages per rank): one and several stages per rank wherever the schedule allows
CASES = [
    (schedule, per_rank)
    for schedule in get_args(Schedule)
    for per_rank in (
        [1]
        if schedule in SINGLE_STAGE_SCHEDULES
        else [2]
        if schedule in V_SCHEDULES
        else [1, 2, 3]
        if schedule == "Interleaved1F1B"
        else [2]
    )
]


def _job(root: Path, sections: dict[str, Any], parallel: dict[str, Any]) -> dict[str, Any]:
    merged = {k: dict(v) for k, v in sections.items()}
    merged["parallel"] = parallel
    return gpt_job(root, **merged).model_dump(mode="json")


def _initial_states(configs: list[dict[str, Any]]) -> list[dict[tuple[int, str], np.ndarray]]:
    """In each rank: build each job's layout and return every stage's parameters and buffers
    (by stage index and name) as they are before the first step (as arrays: a tensor would
    travel as a handle to this process's memory, gone when it ends)."""
    import torch.distributed as dist

    from shardwise.training import job_names
    from shardwise.training.config.derive import derive
    from shardwise.training.config.schema import JobConfig
    from shardwise.training.parallel.mesh import build_mesh
    from shardwise.training.parallel.ties import clean_name
    from shardwise.training.trainer.build import build_layout

    states = []
    for data in configs:
        config = JobConfig.model_validate(data)
        derived = derive(config, dist.get_world_size())
        mesh = build_mesh(derived.degrees, "cpu")
        train, _ = job_names.build_datasets(config)
        layout = build_layout(config, derived, mesh, torch.device("cpu"), sample=train[0])
        pipe = layout.pipeline
        parts = pipe.modules if pipe is not None else dict(enumerate(layout.parts))
        state = {}
        for index, part in parts.items():
            tensors = itertools.chain(
                part.named_parameters(remove_duplicate=False),
                part.named_buffers(remove_duplicate=False),
            )
            for name, tensor in tensors:
                state[(index, clean_name(name))] = tensor.detach().numpy().copy()
        states.append(state)
    return states


def _full_build_buffers(config_data: dict[str, Any]) -> dict[str, np.ndarray]:
    from shardwise.training import job_names
    from shardwise.training.config.schema import JobConfig

    model = job_names.build_model(JobConfig.model_validate(config_data))
    return {name: b.numpy().copy() for name, b in model.named_buffers()}


@pytest.mark.parametrize(
    "sections",
    [
        ROPE_LM,
        pytest.param(
            HF_LLAMA,
            marks=pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed"),
        ),
    ],
    ids=["rope-lm", "hf-llama"],
)
def test_every_stage_starts_from_one_process_values(tmp_path, sections):
    (reference,) = run_distributed(_initial_states, 1, [_job(tmp_path, sections, {})])[0]
    one = {name: value for (_, name), value in reference.items()}
    # the buffer no initialiser sets holds what the model's __init__ computed
    built = _full_build_buffers(_job(tmp_path, sections, {}))
    assert built.keys() and built.keys() <= one.keys()
    for name, value in built.items():
        assert np.array_equal(one[name], value), name
    configs = [
        _job(tmp_path, sections, {"pp": 2, "pipeline_schedule": s, "stages_per_rank": n})
        for s, n in CASES
    ]
    per_rank = run_distributed(_initial_states, 2, configs, timeout=300)
    for (schedule, per_stage), *states in zip(CASES, *per_rank, strict=True):
        stages = {index for state in states for index, _ in state}
        assert stages == set(range(2 * per_stage)), (schedule, stages)
        for state in states:
            for (index, name), value in state.items():
                assert np.array_equal(value, one[name]), f"{schedule}: stage {index} {name}"
