"""Reading job files, any product's: TOML in UTF-8, `--set section.key=value` overrides, pydantic
validation turned into one line per mistake, and the config shown as plain data with credentials
redacted. The schemas themselves belong to the products (training/config/schema.py,
manymodel/config.py); what they share is here.

Nothing here imports torch, starts processes or touches the file system beyond reading the job file.
"""

from __future__ import annotations

import difflib
import tomllib
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from shardwise.common.errors import ConfigError
from shardwise.common.redact import redacted


def _not_only_dots(name: str) -> str:
    if set(name) == {"."}:
        raise ValueError("a name of dots only would point outside runs/; use letters or digits")
    return name


RunName = Annotated[
    str, StringConstraints(pattern=r"^[A-Za-z0-9._-]+$"), AfterValidator(_not_only_dots)
]
"""A name that is also a directory under `runs/`: letters, digits, `.`, `_` and `-`, no path
separators, and not `.` or `..`."""


class Section(BaseModel):
    """A job-file section: unknown keys are errors, assignments are validated, numbers are finite
    and never `true`/`false` (pydantic would read `steps = true` as 1)."""

    model_config = ConfigDict(
        extra="forbid",
        validate_assignment=True,
        populate_by_name=True,
        serialize_by_alias=True,
        allow_inf_nan=False,
    )

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields.get(info.field_name or "")
        if isinstance(value, bool) and field is not None and not accepts_bool(field.annotation):
            raise ValueError(f"expected {kind_of(field.annotation)}, not {str(value).lower()}")
        return value


def accepts_bool(annotation: Any) -> bool:
    """Whether a field or argument annotated so takes `true`/`false`."""
    if annotation in (bool, Any, object) or annotation is None:
        return annotation is not None
    if typing.get_origin(annotation) is Literal:
        return any(isinstance(a, bool) for a in typing.get_args(annotation))
    return any(accepts_bool(a) for a in typing.get_args(annotation))


def accepts_str(annotation: Any) -> bool:
    """Whether a field or argument annotated so takes a string (a path, a name, a choice)."""
    if annotation in (str, Any, object) or annotation is None:
        return annotation is not None
    if isinstance(annotation, type) and issubclass(annotation, str | Path):
        return True
    if typing.get_origin(annotation) is Literal:
        return any(isinstance(a, str) for a in typing.get_args(annotation))
    return any(accepts_str(a) for a in typing.get_args(annotation))


def kind_of(annotation: Any) -> str:
    """What an annotation takes, in words: an integer, a number, a value of its type."""
    found = {a for a in (annotation, *typing.get_args(annotation)) if a in (int, float)}
    return "an integer" if found == {int} else "a number" if found else "a value of its type"


Schema = TypeVar("Schema", bound=BaseModel)


def load_job_file(
    path: str | Path, overrides: list[str] | tuple[str, ...], schema: type[Schema]
) -> Schema:
    """Read any shardwise job file (training, many-models) into its schema, with overrides."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"job file {path} does not exist; check the path") from None
    except IsADirectoryError:
        raise ConfigError(f"{path} is a directory; pass the job's .toml file") from None
    except OSError as e:
        raise ConfigError(f"cannot read job file {path}: {e.strerror or e}") from None
    raw = read_toml(data, str(path))
    for item in overrides:
        apply_override(raw, item)
    return validate_as(schema, raw, source=str(path))


def read_toml(data: bytes, source: str) -> dict[str, Any]:
    """A job file's TOML as a dict, or one line saying what is wrong."""
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise ConfigError(f"{source} is UTF-16 text; TOML files are UTF-8: save it as UTF-8")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ConfigError(
            f"{source} is not UTF-8 text (byte {data[e.start]:#04x} on line {line}); TOML files "
            "are UTF-8: save it as UTF-8"
        ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source} is not valid TOML: {e}") from None
    except RecursionError:
        raise ConfigError(f"{source} nests arrays or tables too deeply to read") from None
    except ValueError as e:  # a number Python will not read (over 4300 digits)
        raise ConfigError(f"{source}: {str(e).split(';')[0]}") from None


def validate_as(schema: type[Schema], raw: dict[str, Any], *, source: str = "config") -> Schema:
    """Validate a nested dict into `schema`; every mistake becomes part of one `ConfigError`."""
    try:
        return schema.model_validate(raw)
    except ValidationError as e:
        problems = [_describe(err, schema) for err in e.errors()]
        raise ConfigError(f"{source}: " + "; ".join(problems)) from None


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply one `--set section.key=value` to a parsed job file; the value is read as TOML."""
    key, sep, text = item.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts):
        raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. train.lr=3e-4")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text  # a bare word such as `gpt` or a path: keep it as a string
    except RecursionError:
        raise ConfigError(f"--set {key.strip()}=…: the value nests too deeply to read") from None
    except ValueError as e:  # a number Python will not read (over 4300 digits)
        raise ConfigError(f"--set {key.strip()}=…: {str(e).split(';')[0]}") from None
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {item!r}: {part} is a value, not a section")
        node = child
    node[parts[-1]] = value


def flatten(config: BaseModel) -> dict[str, str]:
    """The resolved config as dotted keys and string values (for tracking params), credentials
    redacted."""
    out: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            out[prefix] = str(value)

    walk("", redacted_dump(config))
    return out


def redacted_dump(config: BaseModel, *, exclude_none: bool = False) -> dict[str, Any]:
    """The config as plain data to show or store (files, logs, metadata): credentials in URIs
    redacted (redact.py). Only the config in memory holds them."""
    return redacted(config.model_dump(mode="json", exclude_none=exclude_none))


def _describe(err: Any, schema: type[BaseModel]) -> str:
    loc = ".".join(str(p) for p in err["loc"])
    kind = err["type"]
    if kind == "extra_forbidden":
        return f"unknown key '{loc}'{_did_you_mean(err['loc'], schema)}"
    if kind == "missing":
        return f"missing key '{loc}'"
    got = err.get("input")
    message = err["msg"].lower().removeprefix("value error, ")
    if isinstance(got, bool | float | int | str) and len(repr(got)) > 60:
        got = f"{repr(got)[:40]}…"  # one line, not a page of digits
    return f"{loc}: {message} (got {got!r})"


def _did_you_mean(loc: tuple[Any, ...], schema: type[BaseModel]) -> str:
    model = schema
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        annotation = field.annotation if field else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return ""
        model = annotation
    close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1, cutoff=0.6)
    prefix = ".".join(str(p) for p in loc[:-1])
    if close:
        return f"; did you mean '{prefix + '.' if prefix else ''}{close[0]}'?"
    return f"; valid keys here: {', '.join(model.model_fields)}"
