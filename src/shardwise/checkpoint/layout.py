"""How checkpoints are laid out on disk, readable without torch: `<dir>/step_00000100/` holds
DCP's files, its `.metadata`, and shardwise's manifest `shardwise.json` (step, world size, layout,
config hash). A checkpoint is complete when its directory has its final name and both files;
names sort by step. The launcher uses this to pick a checkpoint before any worker starts.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

MANIFEST = "shardwise.json"
_COMPLETE = re.compile(r"^step_(\d{8})$")


def complete_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints in `directory`, oldest first."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if _COMPLETE.match(p.name) and is_complete(p)]
    return sorted(found, key=lambda p: p.name)


def read_manifest(path: Path) -> dict[str, Any]:
    manifest: dict[str, Any] = json.loads((path / MANIFEST).read_text())
    return manifest


def is_complete(path: Path) -> bool:
    return (path / MANIFEST).is_file() and (path / ".metadata").is_file()
