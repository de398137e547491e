"""Where a run starts: the resume policy every launcher shares. `resume_point` turns the user's
`--resume` (never, auto, or a path) into the checkpoint to start from, refusing to overwrite an
earlier run and refusing a checkpoint of another model in one line; `start_point` is what the
workers use after a restart (the newest good checkpoint)."""

from __future__ import annotations

import inspect
from typing import Any

from shardwise.common.console import warn
from shardwise.common.errors import ConfigError
from shardwise.common.job_files import redacted_dump
from shardwise.training import job_names
from shardwise.training.checkpoint.disk_layout import (
    MANIFEST,
    complete_checkpoints,
    is_complete,
    name_of,
    newest_good,
    probe_writable,
    problem,
    read_manifest,
)
from shardwise.training.config.schema import JobConfig
from shardwise.training.data.stream.loader import changed_message


def resume_point(config: JobConfig, resume: str) -> str | None:
    """The checkpoint to start from, or None for a fresh start; refuses to overwrite a run. The
    checkpoint directory must take a write (checked now, not at the first save an hour in)."""
    wrong = probe_writable(config.checkpoint_dir)
    if wrong is not None:
        raise ConfigError(
            f"checkpoint.dir = {config.checkpoint_dir!r}: {wrong}; check the path or URL, and "
            "for object stores the credentials and endpoint (AWS_ACCESS_KEY_ID, "
            "AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL)"
        )
    found = complete_checkpoints(config.checkpoint_dir)
    if resume == "never":
        if found:
            raise ConfigError(
                f"{config.checkpoint_dir} already holds checkpoints of an earlier run (newest: "
                f"{name_of(found[-1])}); pass --resume auto to continue it, or set job.run_dir "
                "to start a new run"
            )
        return None
    if resume == "auto":
        newest = _newest_good(config)
        if newest is not None:
            check_model(newest, config)
            check_data(newest, config)
        return newest
    path = resume
    if not is_complete(path):
        raise ConfigError(
            f"--resume {resume}: not a complete checkpoint (expected a step_NNNNNNNN directory "
            f"with {MANIFEST}); use --resume auto to pick the newest one"
        )
    wrong = problem(path)
    if wrong is not None:
        raise ConfigError(
            f"--resume {resume}: {wrong}; use --resume auto to pick the newest good checkpoint"
        )
    _check_metadata(path)
    check_model(path, config)
    check_data(path, config)
    return path


def check_model(path: str, config: JobConfig) -> None:
    """Refuse a checkpoint of another model (another builder, or other arguments) in one line,
    before DCP fails in every rank on the first name it cannot find."""
    saved = read_manifest(path).get("model")
    if not saved:
        return  # an older manifest: DCP's own check remains
    theirs, ours = _model_label(saved), _model_label(redacted_dump(config.model))
    if theirs != ours:
        raise ConfigError(
            f"{name_of(path)}: checkpoint is for model {theirs}, this job builds {ours}; resume "
            "with the job that wrote it, or start the new model from its weights "
            "(shardwise export, then model.init_from)"
        )


def check_data(path: str, config: JobConfig) -> None:
    """Refuse, in one line and before launch, to resume a streamed run on data that changed
    since the checkpoint (another Delta version, Iceberg snapshot, or set of files), unless the
    job allows it: the resumed run would not read the samples the run would have read."""
    saved = read_manifest(path).get("data")
    if not saved or config.data.allow_changed or config.data.name not in job_names.STREAMED:
        return
    now = job_names.stream_version(config)
    if now != saved:
        raise ConfigError(f"{name_of(path)}: {changed_message(saved, now)}")


def _model_label(model: dict[str, Any]) -> str:
    """`cnn(channels=16)`: the builder and its arguments, defaults filled in where the builder
    can be found, so a default written out and one left out are the same model."""
    name, args = str(model.get("name")), dict(model.get("args") or {})
    try:
        builder = job_names.resolve(name, job_names.MODELS, "model.name")
        bound = inspect.signature(builder).bind_partial(**args)
        bound.apply_defaults()
        args = {k: v for k, v in bound.arguments.items() if not k.startswith("_")}
    except (ConfigError, TypeError, ValueError):
        pass  # compare as written
    return f"{name}({', '.join(f'{k}={v!r}' for k, v in sorted(args.items()))})"


def _newest_good(config: JobConfig) -> str | None:
    """The newest checkpoint whose files match its manifest; a warning names each one skipped."""
    path, skipped = newest_good(config.checkpoint_dir)
    for message in skipped:
        warn(f"{message}; resuming from {name_of(path) if path else 'the start'}", stacklevel=3)
    if path is not None:
        _check_metadata(path)
    return path


def _check_metadata(path: str) -> None:
    # imported here: DCP imports DTensor (0.5 s), which a launcher starting afresh never needs
    from shardwise.training.checkpoint.safe import check_metadata

    check_metadata(path)


def start_point(config: JobConfig, resume: str | None, restarts: int, decided: bool) -> str | None:
    """The checkpoint to start from: after a restart the newest good one (the warnings name any
    skipped), else what the launcher chose or what the `--resume` request resolves to."""
    if restarts and (newest := _newest_good(config)):
        return newest
    return resume if decided else resume_point(config, resume or "never")
