"""User code named in a job file: `package.module:attribute` (or a bare module), imported relative
to the directory shardwise runs from, with one-line errors."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

from shardwise.common.errors import ConfigError


def import_object(path: str, key: str) -> Any:
    """The object `path` names; `key` is the job-file key that holds it, for error messages."""
    module_name, _, attr = path.partition(":")
    cwd = str(Path.cwd())
    if cwd not in sys.path:
        sys.path.insert(0, cwd)  # like `python -m`: user modules resolve from where you run
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        colon = _colon_form(module_name) if not attr and e.name == module_name else None
        if colon:
            raise ConfigError(
                f"{key} = '{path}': '{module_name}' is not a module; did you mean '{colon}'? "
                "(a class or function is named module:attribute)"
            ) from None
        raise ConfigError(
            f"{key} = '{path}': cannot import module '{e.name}'; check the spelling and run "
            "from the directory that contains the package"
        ) from None
    if not attr:
        return module
    if not hasattr(module, attr):
        raise ConfigError(f"{key} = '{path}': module '{module_name}' has no attribute '{attr}'")
    return getattr(module, attr)


def _colon_form(dotted: str) -> str | None:
    """`package.module:Name` where `dotted` is `package.module.Name` and that module has `Name`."""
    parent, _, name = dotted.rpartition(".")
    if not parent:
        return None
    try:
        module = importlib.import_module(parent)
    except ImportError:
        return None
    return f"{parent}:{name}" if hasattr(module, name) else None
