"""What a training run returns: rank 0's summary, handed back to the launcher. Its own module,
light to import: the launcher unpickles it and must not import the trainer (DTensor, FSDP,
torch._dynamo: 0.5 s) to read it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TrainSummary:
    """What `shardwise.train` returns (from rank 0)."""

    step: int
    metrics: dict[str, float]
    checkpoint: str | None
    run_dir: str
    mlflow_run_id: str | None
    samples_per_second: float
    resumed_from: int | None = None
    preempted: bool = False
    """The run stopped early on SIGTERM, after saving a checkpoint."""
    memory: list[dict[str, Any]] = field(default_factory=list)
    """Per rank: parameter, gradient and optimizer-state bytes, peak memory, pipeline bubble."""
    model_uri: str | None = None
    """Where `tracking.log_model` logged the final model (`models:/NAME/VERSION` if registered)."""
    model_error: str | None = None
    """Why it was not logged (the MLflow store was down); the checkpoint is intact."""
