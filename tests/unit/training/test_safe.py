"""Checkpoints load as data: DCP's metadata through an unpickler that knows only DCP's own
classes, values through torch's weights-only loader, random-number states as tensors. One
process, no process group (DCP saves and loads in a single process)."""

from __future__ import annotations

import pickle
import random
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from shardwise.common.errors import ConfigError
from shardwise.training.checkpoint import safe
from shardwise.training.trainer import state


class Touches:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def save(path: Path, values: dict) -> None:
    with warnings.catch_warnings():  # "no process group: saving in a single process", as meant
        warnings.simplefilter("ignore", UserWarning)
        dcp_save(values, checkpoint_id=path)


def load(path: Path, template: dict) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        safe.load(template, path)


def test_plain_values_and_tensors_load(tmp_path):
    values = {"w": torch.arange(4.0), "train": {"step": 7, "betas": (0.9, 0.95), "name": "x"}}
    save(tmp_path, values)
    template = {"w": torch.zeros(4), "train": {"step": 0, "betas": (0.0, 0.0), "name": ""}}
    load(tmp_path, template)
    assert torch.equal(template["w"], values["w"]) and template["train"] == values["train"]
    assert safe.keys(tmp_path) == {"w", "train.step", "train.betas", "train.name"}


def test_a_value_that_would_run_code_is_refused(tmp_path):
    marker = tmp_path / "ran"
    save(tmp_path / "ckpt", {"train": {"note": Touches(marker)}})
    with pytest.raises(ConfigError, match=r"train\.note is not plain data.*could run code"):
        load(tmp_path / "ckpt", {"train": {"note": None}})
    assert not marker.exists()


def test_metadata_that_would_run_code_is_refused(tmp_path):
    marker = tmp_path / "ran"
    save(tmp_path, {"w": torch.zeros(2)})
    (tmp_path / ".metadata").write_bytes(pickle.dumps(Touches(marker)))
    with pytest.raises(ConfigError, match=r"holds pathlib\.Path\.touch|holds .*touch"):
        safe.check_metadata(tmp_path)
    with pytest.raises(ConfigError, match="could run code"):
        load(tmp_path, {"w": torch.zeros(2)})
    assert not marker.exists()


def test_random_states_are_tensors_and_come_back_exactly():
    random.seed(3)
    np.random.seed(4)
    torch.manual_seed(5)
    random.gauss(0, 1)  # a cached Gaussian in both generators
    np.random.randn()
    saved = state.rng_tensors()
    assert all(isinstance(t, torch.Tensor) for t in saved.values())
    draws = (random.random(), random.gauss(0, 1), np.random.rand(), np.random.randn())
    draws += (torch.rand(1).item(),)
    state._set_rng_tensors(saved)
    again = (random.random(), random.gauss(0, 1), np.random.rand(), np.random.randn())
    again += (torch.rand(1).item(),)
    assert again == draws
