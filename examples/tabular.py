"""A user-supplied model, datasets, loss and tensor-parallel plan, loaded by shardwise from their
import paths.

    shardwise train examples/tabular.toml --nproc 2
    shardwise train examples/tabular.toml --nproc 2 --set parallel.tp=2 \
        --set parallel.tp_plan=examples.tabular:tp_plan
    shardwise train examples/tabular.toml --nproc 2 --set parallel.pp=2

The contracts (see docs/training.md, "Bring your own model and data"):
- build_model(**model.args) -> torch.nn.Module, called with the same seed on every rank;
- build_datasets(**data.args) -> (train, held_out): map-style datasets of (inputs, target) pairs,
  held_out may be None;
- loss(outputs, target) -> scalar tensor, the mean over the batch;
- tp_plan(model, *, sequence_parallel) -> {module name: torch parallel style}, for parallel.tp > 1;
- pipeline parallelism needs nothing more: the model is an nn.Sequential, a sequence of blocks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.utils.data import TensorDataset


def build_model(*, hidden: int = 32, dropout: float = 0.1) -> nn.Module:
    return nn.Sequential(
        nn.Linear(30, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, 2)
    )


def build_datasets(*, eval_fraction: float = 0.25) -> tuple[TensorDataset, TensorDataset]:
    """The Wisconsin breast-cancer table shipped with scikit-learn (569 rows, 30 features),
    standardised with the training split's statistics. scikit-learn is imported here, not at the
    top: the launcher imports this module only to check the job's names, and importing
    scikit-learn costs it seconds."""
    from sklearn.datasets import load_breast_cancer

    table = load_breast_cancer()
    features = torch.tensor(table.data, dtype=torch.float32)
    labels = torch.tensor(table.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    cut = int(len(labels) * (1 - eval_fraction))
    train, held_out = order[:cut], order[cut:]
    mean, std = features[train].mean(0), features[train].std(0)
    features = (features - mean) / std
    return (
        TensorDataset(features[train], labels[train]),
        TensorDataset(features[held_out], labels[held_out]),
    )


def loss(outputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy with a little label smoothing."""
    return F.cross_entropy(outputs, target, label_smoothing=0.05)


def tp_plan(model: nn.Module, *, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """Megatron's MLP split: the first layer by output columns (each rank a slice of the hidden
    units; ReLU and dropout work on the slice), the last by input rows, summed across ranks.
    There is no sequence here, so `sequence_parallel` changes nothing."""
    del sequence_parallel
    return {"0": ColwiseParallel(), "3": RowwiseParallel()}
