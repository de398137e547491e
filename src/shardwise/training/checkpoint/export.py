"""Export a checkpoint's model as one safetensors file for inference, from any layout.

A shardwise checkpoint stores parameters by the user's module names, sharded however the run was
laid out; DCP reassembles full tensors in a single process (no process group needed). The file's
metadata names the step and the model builder and its arguments, so the weights load into
`build_model(**args)` with `model.load_state_dict(safetensors.torch.load_file(path))`.
"""

from __future__ import annotations

import itertools
import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardwise.common.errors import ConfigError
from shardwise.common.redact import redact
from shardwise.training.checkpoint.disk_layout import is_complete, problem, read_manifest


def export_safetensors(checkpoint: str | Path, output: Path) -> dict[str, Any]:
    """Write the model of `checkpoint` (a path or an fsspec URL) to `output`; returns what was
    written (tensors, bytes, step)."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    from shardwise.training.checkpoint import safe  # DCP, DTensor: not for the launcher's checks

    require_complete(checkpoint)
    _check_output(output)
    wrong = problem(checkpoint)
    if wrong is not None:
        raise ConfigError(f"{checkpoint}: {wrong}; export a good checkpoint")
    safe.check_metadata(checkpoint)
    manifest = read_manifest(checkpoint)
    with warnings.catch_warnings():  # "no process group: loading in a single process", as meant
        warnings.simplefilter("ignore", UserWarning)
        state = _load_state_dict_from_keys(keys={"model"}, storage_reader=safe.reader(checkpoint))
    tensors = {name: t.detach().contiguous() for name, t in sorted(state["model"].items())}
    metadata = {
        "format": "pt",
        "step": str(manifest["step"]),
        "model": json.dumps(manifest.get("model", {})),
        "source": redact(str(checkpoint)),
    }
    partial = output.with_name(output.name + ".partial")
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(partial), metadata=metadata)
        os.replace(partial, output)  # never a half-written file under the final name
    except (OSError, SafetensorError) as e:
        reason = (
            e.strerror if isinstance(e, OSError) and e.strerror else str(e).split(" at path")[0]
        )
        raise ConfigError(f"{output}: cannot write it ({reason})") from None
    finally:
        partial.unlink(missing_ok=True)
    return {
        "tensors": len(tensors),
        "parameters": sum(t.numel() for t in tensors.values()),
        "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
        "step": manifest["step"],
        "dtype": str(next(iter(tensors.values())).dtype).removeprefix("torch.") if tensors else "",
    }


def require_complete(checkpoint: str | Path) -> None:
    """Refuse, in one line, what is not a complete shardwise checkpoint."""
    if not is_complete(checkpoint):
        raise ConfigError(
            f"{checkpoint} is not a complete shardwise checkpoint (a step_NNNNNNNN directory "
            "with shardwise.json and .metadata)"
        )


def _check_output(output: Path) -> None:
    """Where the export goes: a new or replaced `.safetensors` file in a directory."""
    if output.is_dir():
        raise ConfigError(f"{output} is a directory; give a file name ending in .safetensors")
    if output.suffix != ".safetensors":
        raise ConfigError(f"{output}: the output file must end in .safetensors")
    parent = next((p for p in output.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise ConfigError(f"{output}: {parent} is not a directory")


def load_exported(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of an exported file (what an inference script does)."""
    from safetensors.torch import load_file

    loaded: dict[str, torch.Tensor] = load_file(str(path))
    return loaded


def check_weights(path: str, model: nn.Module) -> None:
    """Refuse, before launch, a `model.init_from` file that is not the model's weights: not a
    safetensors file, a name missing or left over, a shape that differs."""
    from safetensors import SafetensorError, safe_open

    where = f"model.init_from = {path!r}"
    if not os.path.isfile(path):
        raise ConfigError(f"{where}: no such file; give the .safetensors file `export` wrote")
    try:
        with safe_open(path, framework="pt") as f:
            shapes = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}  # noqa: SIM118
    except (SafetensorError, OSError) as e:
        raise ConfigError(f"{where}: not a safetensors file ({e})") from None
    wanted = {n: tuple(t.shape) for n, t in model.state_dict(keep_vars=True).items()}
    missing, extra = sorted(wanted.keys() - shapes.keys()), sorted(shapes.keys() - wanted.keys())
    if missing or extra:
        what = f"lacks {missing[0]}" if missing else f"holds {extra[0]}, which the model has not"
        count = len(missing) + len(extra)
        raise ConfigError(
            f"{where} {what} ({count} name(s) differ): it is not this model's weights"
        )
    for name, shape in wanted.items():
        if shapes[name] != shape:
            raise ConfigError(
                f"{where}: {name} is {list(shapes[name])} in the file, {list(shape)} in the model"
            )


def load_weights(parts: list[nn.Module], path: str) -> None:
    """Copy the weights in the safetensors file at `path` into this rank's share of the model
    (its shard of every DTensor), by the user's names whatever the wrapper."""
    from safetensors import safe_open

    from shardwise.training.parallel.meta_init import copy_slice
    from shardwise.training.parallel.ties import clean_name

    with safe_open(path, framework="pt") as f, torch.no_grad():
        saved = set(f.keys())
        for part in parts:
            for name, target in itertools.chain(part.named_parameters(), part.named_buffers()):
                if clean_name(name) in saved:  # not the buffers a model keeps out of its state
                    copy_slice(f.get_tensor(clean_name(name)).to(target.dtype), target)
