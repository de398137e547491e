"""Export a checkpoint's model as one safetensors file for inference, from any layout.

A shardwise checkpoint stores parameters by the user's module names, sharded however the run was
laid out; DCP reassembles full tensors in a single process (no process group needed). The file's
metadata names the step and the model builder and its arguments, so the weights load into
`build_model(**args)` with `model.load_state_dict(safetensors.torch.load_file(path))`.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

from shardwise.checkpoint.layout import is_complete, read_manifest
from shardwise.config import ConfigError


def export_safetensors(checkpoint: str | Path, output: Path) -> dict[str, Any]:
    """Write the model of `checkpoint` (a path or an fsspec URL) to `output`; returns what was
    written (tensors, bytes, step)."""
    from safetensors.torch import save_file

    if not is_complete(checkpoint):
        raise ConfigError(
            f"{checkpoint} is not a complete shardwise checkpoint (a step_NNNNNNNN directory "
            "with shardwise.json and .metadata)"
        )
    if output.suffix != ".safetensors":
        raise ConfigError(f"{output}: the output file must end in .safetensors")
    manifest = read_manifest(checkpoint)
    with warnings.catch_warnings():  # "no process group: loading in a single process", as meant
        warnings.simplefilter("ignore", UserWarning)
        state = _load_state_dict_from_keys(keys={"model"}, checkpoint_id=str(checkpoint))
    tensors = {name: t.detach().contiguous() for name, t in sorted(state["model"].items())}
    metadata = {
        "format": "pt",
        "step": str(manifest["step"]),
        "model": json.dumps(manifest.get("model", {})),
        "source": str(checkpoint),
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(output.name + ".partial")
    save_file(tensors, str(partial), metadata=metadata)
    os.replace(partial, output)  # never a half-written file under the final name
    return {
        "tensors": len(tensors),
        "parameters": sum(t.numel() for t in tensors.values()),
        "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
        "step": manifest["step"],
        "dtype": str(next(iter(tensors.values())).dtype).removeprefix("torch.") if tensors else "",
    }


def load_exported(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of an exported file (what an inference script does)."""
    from safetensors.torch import load_file

    loaded: dict[str, torch.Tensor] = load_file(str(path))
    return loaded
