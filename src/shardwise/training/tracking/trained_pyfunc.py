"""The MLflow pyfunc a trained model is logged as: it rebuilds the model from the job file
(`model.name` and `model.args`, through the same builders training used) and loads the
checkpoint's weights from a safetensors file, so no pickled module is stored and the model loads
wherever shardwise (and the model's own code, shipped with it) imports.

`predict` takes what the model's forward takes: an array (or a dict of named arrays) of a batch
of inputs, the signature's dtype and shape; it returns the model's output tensor (a Hugging Face
model's logits) as an array. It runs under `torch.no_grad()` in eval mode, in float32, on a GPU
when there is one.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import mlflow.pyfunc
import numpy as np


class TrainedModel(mlflow.pyfunc.PythonModel):  # type: ignore[misc]
    """A shardwise checkpoint's model, as MLflow loads and serves it (artifacts: `job`, the job
    file; `weights`, the exported safetensors file)."""

    def load_context(self, context: Any) -> None:
        """Build the model from the job and load its weights, in eval mode."""
        import torch
        from safetensors.torch import load_file

        from shardwise.training import job_names
        from shardwise.training.config.load import validate

        job = tomllib.loads(Path(context.artifacts["job"]).read_text())
        config = validate(job, source=context.artifacts["job"])
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model = job_names.build_model(config)
        model.load_state_dict(load_file(context.artifacts["weights"]))
        self.model = model.float().to(self.device).eval()

    def predict(
        self, context: Any, model_input: np.ndarray, params: dict[str, Any] | None = None
    ) -> np.ndarray:
        import torch

        from shardwise.training.job_names import model_output

        with torch.no_grad():
            outputs = self.model(_tensors(model_input, self.device))
        return model_output(outputs).float().cpu().numpy()


def _tensors(value: Any, device: Any) -> Any:
    """The model's inputs from what MLflow hands `predict`: arrays (a DataFrame's values), or a
    dict of them."""
    import torch

    if isinstance(value, dict):
        return {k: _tensors(v, device) for k, v in value.items()}
    if hasattr(value, "to_numpy"):  # a DataFrame: its rows are the batch
        value = value.to_numpy()
    return torch.from_numpy(np.ascontiguousarray(value)).to(device)
