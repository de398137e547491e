"""Loading a training job file: a TOML file with `--set` overrides, or a parsed dict, validated
into a `JobConfig`. Every user mistake surfaces as a `ConfigError` whose message is one line naming
the key and the fix; loading is cheap and pure (no torch, no processes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardwise.common.job_files import load_job_file, validate_as
from shardwise.training.config.schema import JobConfig


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> JobConfig:
    """Read a TOML training job file, apply `a.b=value` overrides, and validate it."""
    return load_job_file(path, overrides, JobConfig)


def validate(raw: dict[str, Any], *, source: str = "config") -> JobConfig:
    """Validate a nested dict (a parsed job file) into a `JobConfig`, one line per mistake."""
    return validate_as(JobConfig, raw, source=source)
