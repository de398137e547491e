"""shardwise: distributed training for PyTorch.

    import shardwise
    config = shardwise.load_config("examples/digits.toml")
    summary = shardwise.train(config, nproc=2)

    jobs = shardwise.load_many_models("examples/us-employment.toml")
    result = shardwise.many_models(jobs)

Names are imported on first use, so `shardwise --help` does not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "ConfigError": "shardwise.common.errors",
    "JobConfig": "shardwise.training.config.schema",
    "load_config": "shardwise.training.config.load",
    "train": "shardwise.training.run",
    "Nodes": "shardwise.training.launch.agent",
    "WorkerFailed": "shardwise.training.launch.outcome",
    "TrainSummary": "shardwise.training.trainer.train_summary",
    "ManyModelsConfig": "shardwise.manymodel.config",
    "load_many_models": "shardwise.manymodel.config",
    "many_models": "shardwise.manymodel.run.runner",
}

if TYPE_CHECKING:
    from shardwise.common.errors import ConfigError
    from shardwise.manymodel.config import ManyModelsConfig, load_many_models
    from shardwise.manymodel.run.runner import many_models
    from shardwise.training.config.load import load_config
    from shardwise.training.config.schema import JobConfig
    from shardwise.training.launch.agent import Nodes
    from shardwise.training.launch.outcome import WorkerFailed
    from shardwise.training.run import train
    from shardwise.training.trainer.train_summary import TrainSummary

__all__ = [
    "ConfigError",
    "JobConfig",
    "ManyModelsConfig",
    "Nodes",
    "TrainSummary",
    "WorkerFailed",
    "__version__",
    "load_config",
    "load_many_models",
    "many_models",
    "train",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'shardwise' has no attribute {name!r}")
