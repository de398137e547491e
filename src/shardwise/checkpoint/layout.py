"""How checkpoints are laid out on disk, readable without torch: `<dir>/step_00000100/` holds
DCP's files, its `.metadata`, and shardwise's manifest `shardwise.json` (step, world size, layout,
config hash, and the size and SHA-256 of every file). A checkpoint is complete when its directory
has its final name and both files; it is good when every file the manifest lists is there with
its size (and, checked fully, its checksum). Names sort by step. The launcher uses this to pick a
checkpoint before any worker starts.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

MANIFEST = "shardwise.json"
_PREFIX = "step_"


def complete_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints in `directory`, oldest first."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if _is_step_dir(p.name) and is_complete(p)]
    return sorted(found, key=lambda p: p.name)


def _is_step_dir(name: str) -> bool:
    digits = name.removeprefix(_PREFIX)
    return name.startswith(_PREFIX) and len(digits) == 8 and digits.isdigit()


def read_manifest(path: Path) -> dict[str, Any]:
    manifest: dict[str, Any] = json.loads((path / MANIFEST).read_text())
    return manifest


def is_complete(path: Path) -> bool:
    return (path / MANIFEST).is_file() and (path / ".metadata").is_file()


def file_digest(path: Path) -> dict[str, Any]:
    """Size and SHA-256 of one file, as the manifest records them."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def problem(path: Path, *, checksums: bool = True) -> str | None:
    """What is wrong with the checkpoint at `path`, or None when it is good: a missing or
    unreadable manifest, a listed file missing, truncated or (with `checksums`) corrupted."""
    if not is_complete(path):
        return "it has no manifest or no DCP metadata (an interrupted save)"
    try:
        files: dict[str, dict[str, Any]] = read_manifest(path).get("files", {})
    except (OSError, ValueError) as e:
        return f"its manifest cannot be read ({e})"
    for name, expected in sorted(files.items()):
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        size = file.stat().st_size
        if size != expected["bytes"]:
            return f"{name} is {size} bytes, the manifest says {expected['bytes']} (truncated)"
        if checksums and file_digest(file)["sha256"] != expected["sha256"]:
            return f"{name} does not match its checksum (corrupted)"
    return None


def retention_victims(directory: Path, keep_last: int) -> list[Path]:
    """Checkpoints `keep_last` retention deletes: those older than the newest `keep_last` whose
    files are all there at full size. A damaged checkpoint does not count as kept, so retention
    never deletes the last good one."""
    kept, victims = 0, []
    for path in reversed(complete_checkpoints(directory)):
        if kept >= keep_last:
            victims.append(path)
        elif problem(path, checksums=False) is None:
            kept += 1
    return victims


def newest_good(directory: Path) -> tuple[Path | None, list[str]]:
    """The newest checkpoint that passes `problem`, and a warning for each newer one skipped."""
    warnings: list[str] = []
    if not directory.is_dir():
        return None, warnings
    named = sorted(p for p in directory.iterdir() if _is_step_dir(p.name))
    for path in reversed(named):
        wrong = problem(path)
        if wrong is None:
            return path, warnings
        warnings.append(f"skipping checkpoint {path.name}: {wrong}")
    return None, warnings
