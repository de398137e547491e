"""A checkpoint's model logged to MLflow and registered in its Model Registry, from any layout.

What is logged (`tracking.log_model`, and `shardwise export CHECKPOINT --mlflow NAME`): an MLflow
pyfunc (tracking/trained_pyfunc.py) holding the model's weights as one safetensors file (exported
from the checkpoint in one process, whatever layout wrote it: checkpoint/export.py), the job file it
was trained with, the model's own code when it is not an installed package (`code_paths`), a
signature and an input example taken from the first samples of the job's training data, and pinned
requirements. With a registered name it becomes that model's next version, tagged with the run's
final metrics, the step and the checkpoint.

The job comes from the checkpoint's manifest (it records the job, credentials hidden), so a
checkpoint exports on its own; an older checkpoint's run directory holds it as `config.toml`.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import tempfile
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import tomli_w

from shardwise.common.errors import ConfigError
from shardwise.common.imports import import_object
from shardwise.common.job_files import redacted_dump
from shardwise.common.model_registry import (
    Destination,
    Registered,
    check_reachable,
    log_pyfunc,
    pinned,
)
from shardwise.common.redact import redact
from shardwise.training import job_names
from shardwise.training.checkpoint.disk_layout import read_manifest
from shardwise.training.checkpoint.export import export_safetensors, require_complete
from shardwise.training.config.load import validate
from shardwise.training.config.schema import JobConfig

EXAMPLE_SAMPLES = 2
"""Samples in the logged input example."""


def log_checkpoint(
    checkpoint: str,
    *,
    name: str,
    uri: str | None = None,
    run_id: str | None = None,
    metrics: dict[str, float] | None = None,
) -> Registered:
    """Log the model of `checkpoint` (a path or fsspec URL) to MLflow and, with `name`, register
    it as that model's next version. `uri`: the store (default: `MLFLOW_TRACKING_URI`, else the
    job's `tracking.uri` or its run's embedded store); `run_id`: the run to log into (default: a
    new run in the job's experiment); `metrics`: the version's tags besides step and checkpoint."""
    require_complete(checkpoint)
    manifest = read_manifest(checkpoint)
    config = _job(checkpoint, manifest)
    store = uri or os.environ.get("MLFLOW_TRACKING_URI") or config.tracking_uri
    check_reachable(store)  # before the work: a registry that is down costs seconds
    step = manifest["step"]
    tags = {
        **{k: f"{v:.6g}" for k, v in sorted((metrics or {}).items())},
        "shardwise.step": str(step),
        "shardwise.checkpoint": redact(str(checkpoint)),
        "shardwise.layout": ",".join(f"{k}={v}" for k, v in manifest["degrees"].items()),
    }
    with tempfile.TemporaryDirectory(prefix="shardwise-model-") as folder:
        artifacts = {"weights": str(Path(folder, "model.safetensors")), "job": f"{folder}/job.toml"}
        export_safetensors(checkpoint, Path(artifacts["weights"]))
        Path(artifacts["job"]).write_text(tomli_w.dumps(redacted_dump(config, exclude_none=True)))
        example, output = _example(config, artifacts)
        from mlflow.models import infer_signature

        from shardwise.training.tracking import trained_pyfunc

        destination = Destination(
            uri=store,
            experiment=config.tracking.experiment or config.job.name,
            run_name=f"{config.job.name}-step{step}",
            run_id=run_id,
            registered_name=name,
            tags=tags,
        )
        return log_pyfunc(
            destination,
            python_model=str(Path(trained_pyfunc.__file__).with_name("served_model.py")),
            artifacts=artifacts,
            signature=infer_signature(example, output),
            input_example=example,
            code_paths=_code_paths(config.model.name),
            pip_requirements=_requirements(),
        )


def _job(checkpoint: str, manifest: dict[str, Any]) -> JobConfig:
    """The job the checkpoint was trained with: its manifest's, else its run directory's."""
    if "job" in manifest:
        return validate(manifest["job"], source=f"{checkpoint}/shardwise.json")
    beside = Path(checkpoint).resolve().parents[1] / "config.toml"
    if beside.is_file():
        return validate(tomllib.loads(beside.read_text()), source=str(beside))
    raise ConfigError(
        f"{checkpoint}: its manifest does not name the job (a checkpoint from before shardwise "
        f"recorded it) and there is no {beside}; export it with `shardwise export` to a "
        "safetensors file instead"
    )


def _example(config: JobConfig, artifacts: dict[str, str]) -> tuple[Any, Any]:
    """The first samples' inputs from the job's data, and what the logged model (loaded as
    MLflow will load it) predicts for them: the signature's two sides."""
    import mlflow.pyfunc

    from shardwise.training.tracking.trained_pyfunc import TrainedModel

    inputs = job_names.first_inputs(config, EXAMPLE_SAMPLES)
    example = (
        {k: v.numpy() for k, v in inputs.items()} if isinstance(inputs, dict) else inputs.numpy()
    )
    model = TrainedModel()
    model.load_context(mlflow.pyfunc.PythonModelContext(artifacts=artifacts, model_config={}))
    output = model.predict(None, example)  # type: ignore[arg-type]  # or a dict of them
    return example, np.asarray(output)


def _code_paths(model_name: str) -> list[str] | None:
    """The model's own code when it is not part of an installed package: the top-level package
    (or module) that `package.module:function` names, copied into the logged model."""
    if ":" not in model_name:
        return None  # a built-in: shardwise's own
    module = model_name.split(":", 1)[0]
    top = module.split(".", 1)[0]
    if top == "shardwise":
        return None
    import_object(module, "model.name")  # as training resolved it: from where shardwise runs
    package = sys.modules[top]
    places = list(getattr(package, "__path__", []))
    where = Path(places[0]) if places else Path(package.__file__ or "")
    installed = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    if any(where.is_relative_to(p) for p in installed):
        return None
    return [str(where)]


def _requirements() -> list[str]:
    """What the logged model needs to load: torch, safetensors, numpy, shardwise, and the model's
    libraries that are loaded now (Hugging Face transformers)."""
    names = ["torch", "safetensors", "numpy", "shardwise"]
    return pinned(names + [n for n in ("transformers",) if n in sys.modules])
