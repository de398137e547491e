"""Hundreds of generated malformed inputs, each answered by one line and exit 2, never a
traceback or a hang, and none touching the runs already on disk.

The cases are generated, not hand-picked: for every key of the training and many-models job
files, values that key can never take (its wrong type, `true` for a number, inf and nan, each
side of its bounds); job files that are not UTF-8 TOML; command-line flags out of range; data
files broken in the ways real exports break; checkpoints whose manifest is not shardwise's. Every
case runs through `shardwise.cli.main` in this process (a process per case would take the suite's
whole budget), under a wall-clock limit, pointed at a finished training run and a finished
many-models run whose files are hashed before and after.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import shutil
import signal
import time
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import annotated_types
import pytest
import tomli_w
from pydantic import BaseModel

import shardwise
from helpers import digits_job
from shardwise.cli import build_parser, main
from shardwise.manymodel.config import ManyModelsConfig
from shardwise.plan.plan_arguments import NUMBERS
from shardwise.training.checkpoint.disk_layout import MANIFEST
from shardwise.training.config.schema import JobConfig

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
LIMIT_S = 20  # per case: the promise is an answer within seconds, never a hang


class Hang(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise Hang


def outcome(argv: list[str]) -> tuple[Any, str]:
    """(exit code, or what went wrong instead; stderr) of `shardwise ARGV`, in this process."""
    out, err = io.StringIO(), io.StringIO()
    # The alarm is pytest-timeout's too: take it for the case, then give back what is left.
    previous = signal.signal(signal.SIGALRM, _alarm)
    outer, _ = signal.setitimer(signal.ITIMER_REAL, LIMIT_S)
    started = time.monotonic()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code: Any = main(argv)
    except SystemExit as e:  # argparse
        code = e.code
    except Hang:
        code = f"no answer within {LIMIT_S} s"
    except BaseException as e:  # any escape is the finding
        code = f"raised {type(e).__name__}: {str(e)[:200]}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer:
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - started), 0.01))
    return code, err.getvalue()


def verdict(argv: list[str]) -> str | None:
    """What is wrong with how `shardwise ARGV` answered, or None for one line and exit 2."""
    code, err = outcome(argv)
    lines = err.strip().splitlines()
    if code != 2:
        return f"exit {code}: {err.strip()[-300:]}"
    if "Traceback" in err or len(lines) != 1 or not lines[0].startswith("shardwise: error: "):
        return f"not one error line: {err.strip()[:300]}"
    return None


# ---- values a key can never take ----------------------------------------------------------


def leaves(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, Any, list[Any]]]:
    for name, field in model.model_fields.items():
        key = prefix + (field.alias or name)
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            yield from leaves(field.annotation, key + ".")
        else:
            yield key, field.annotation, list(field.metadata)


def never_valid(annotation: Any, metadata: list[Any]) -> list[Any]:
    """Values of TOML types that `annotation` with `metadata` bounds rejects, whatever else."""
    optional = isinstance(annotation, types.UnionType)  # `int | None`: the int
    base = typing.get_args(annotation)[0] if optional else annotation
    origin = typing.get_origin(base)
    if base is int:
        values: list[Any] = [True, 1.5, "abc", [1], math.inf, math.nan]
    elif base is float:
        values = [False, "abc", [1.0], math.inf, -math.inf, math.nan]
    elif base is bool:
        values = [2.5, [1], {"a": 1}, "maybe"]
    elif base is str:
        values = [5, [1], True, {"a": 1}]
    elif origin is Literal:
        values = ["no-such-choice", 3]
    elif origin is list:
        values = [5, {"a": 1}, [{"a": 1}]]
    elif origin is dict:
        values = [5, "x", [1]]
    elif origin is tuple:
        values = ["x", [0.5], [True, 0.5], [math.nan, 0.5]]
    else:
        values = []
    for bound in metadata:
        if isinstance(bound, annotated_types.Gt):
            values.append(bound.gt)
        elif isinstance(bound, annotated_types.Ge):
            values.append(bound.ge - 1)
        elif isinstance(bound, annotated_types.Lt):
            values.append(bound.lt)
        elif isinstance(bound, annotated_types.Le):
            values.append(bound.le + 1)
    return values


def _fields(section: Any) -> list[Any]:
    model = section.annotation
    return list(model.model_fields.values()) if isinstance(model, type) else []


def with_value(raw: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    copy = json.loads(json.dumps(raw))
    node = copy
    *sections, last = key.split(".")
    for part in sections:
        node = node.setdefault(part, {})
    node[last] = value
    return copy


def job_file_cases(raw: dict[str, Any], schema: type[BaseModel]) -> Iterator[tuple[str, bytes]]:
    """(name, bytes) of job files: `raw` with one key set to a value it never takes, and job
    files broken as text."""
    for key, annotation, metadata in leaves(schema):
        for value in never_valid(annotation, metadata):
            yield f"{key}={value!r}", tomli_w.dumps(with_value(raw, key, value)).encode()
    text = tomli_w.dumps(raw)
    yield "utf-16", text.encode("utf-16")
    yield "latin-1 byte", text.encode() + b"\n# caf\xe9\n"
    yield "NUL byte", text.encode().replace(b"\n", b"\n\x00", 1)
    yield "binary", bytes(range(256)) * 4
    if any(f.is_required() for s in schema.model_fields.values() for f in _fields(s)):
        yield "empty", b""  # (a many-models job of defaults only is a job)
    yield "deep arrays", b"a = " + b"[" * 50_000 + b"]" * 50_000
    yield "deep tables", b"x = " + b"{a=" * 5_000 + b"1" + b"}" * 5_000
    for section in raw:
        yield (
            f"{section} = 5",
            tomli_w.dumps({**raw, section: {}})
            .replace(f"[{section}]", f"{section} = 5\n[unused_{section}]")
            .encode(),
        )
        yield f"{section}.bogus", tomli_w.dumps(with_value(raw, f"{section}.bogus", 1)).encode()
    quoted = [i for i, c in enumerate(text) if c == '"']
    for i in quoted[1::2][:10]:  # cut just inside a string: an unterminated string
        yield f"cut at {i}", text[:i].encode()
    yield "duplicate key", (text + "\n[job]\nseed = 1\n").encode()


# ---- what is on disk already --------------------------------------------------------------


def fingerprint(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A finished training run (its checkpoint included)."""
    run_dir = tmp_path_factory.mktemp("trained")
    summary = shardwise.train(digits_job(run_dir, train={"steps": 2}), nproc=1)
    assert summary is not None and summary.checkpoint is not None
    return run_dir


@pytest.fixture(scope="module")
def forecast(tmp_path_factory) -> Path:
    """A finished many-models run."""
    run_dir = tmp_path_factory.mktemp("forecast")
    config = shardwise.load_many_models(
        REPO / "examples" / "retail-synthetic.toml",
        [f"job.run_dir='{run_dir}'", "data.num_series=4", "models.names=['seasonal_naive']",
         "tracking.mlflow=false"],
    )  # fmt: skip
    shardwise.many_models(config)
    return run_dir


def test_malformed_inputs_get_one_line_and_exit_2_and_lose_nothing(
    tmp_path, trained, forecast, repo_cwd
):
    before = {trained: fingerprint(trained), forecast: fingerprint(forecast)}
    cases: list[tuple[str, list[str]]] = []
    files = tmp_path / "cases"
    files.mkdir()

    def job(name: str, content: bytes) -> str:
        path = files / f"{len(cases):04d}.toml"
        path.write_bytes(content)
        return str(path)

    # training job files, at the finished run (--resume auto: it would continue it)
    train_raw = digits_job(trained).model_dump(mode="json", exclude_none=True)
    for name, content in job_file_cases(train_raw, JobConfig):
        cases.append((f"train {name}", ["train", job(name, content), "--resume", "auto"]))
    # many-models job files, at the finished run
    many_raw = shardwise.load_many_models(
        REPO / "examples" / "retail-synthetic.toml",
        [f"job.run_dir='{forecast}'", "data.num_series=4", "tracking.mlflow=false"],
    ).model_dump(mode="json")
    for name, content in job_file_cases(many_raw, ManyModelsConfig):
        cases.append((f"many-models {name}", ["many-models", job(name, content), "--resume"]))

    # flags
    digits = str(REPO / "examples" / "digits.toml")
    at_run = ["--set", f"job.run_dir='{trained}'"]
    for flags in (
        ["--nproc", "0"], ["--nproc", "-1"], ["--nproc", "abc"], ["--nnodes", "0"],
        ["--nnodes", "x"], ["--nnodes", "2", "--rdzv-endpoint", ":"],
        ["--nnodes", "2", "--rdzv-endpoint", "host:"], ["--nnodes", "2", "--rdzv-endpoint", "h:0"],
        ["--nnodes", "2", "--rdzv-endpoint", "h:99999"],
        ["--nnodes", "2", "--rdzv-endpoint", "no-such-host.invalid:29400"],
        ["--rdzv-id", "x"], ["--resume", "/no/such/checkpoint"], ["--resume", digits],
        ["--resume", str(tmp_path)], ["--set", ""], ["--set", "="], ["--set", "a"],
        ["--set", ".=1"], ["--set", "a..b=1"], ["--set", "train.steps=["],
        ["--set", "train.steps=" + "9" * 5000], ["--bogus"],
    ):  # fmt: skip
        cases.append((f"train {flags}", ["train", digits, *at_run, *flags]))
    # checkpoints whose manifest is not shardwise's, resumed and exported
    checkpoint = next((trained / "checkpoints").iterdir())
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    for name, bad in {
        "a list": [manifest],
        "no files": {**manifest, "files": None},
        "an empty name": {**manifest, "files": {**manifest["files"], "": {}}},
        "a ../ name": {**manifest, "files": {**manifest["files"], "../x": {}}},
        "no size": {**manifest, "files": {**manifest["files"], ".metadata": {"sha256": "0"}}},
        "a step that is text": {**manifest, "step": "two"},
        "not JSON": "{",
    }.items():
        copy = tmp_path / "doctored" / name.replace(" ", "_") / checkpoint.name
        shutil.copytree(checkpoint, copy)
        (copy / MANIFEST).write_text(bad if isinstance(bad, str) else json.dumps(bad))
        cases.append((f"resume {name}", ["train", digits, *at_run, "--resume", str(copy)]))
        out = tmp_path / f"{name}.safetensors"
        cases.append((f"export {name}", ["export", str(copy), str(out)]))
    for out in (trained, trained / "config.toml" / "x.safetensors", Path("/proc/x.safetensors")):
        cases.append((f"export to {out}", ["export", str(checkpoint), str(out)]))

    # many-models data files, broken as real exports break
    good = "store,item,week,units,promo\n" + "".join(
        f"s1,i{i},{2020 + w // 52}-{1 + w % 12:02d}-{1 + w % 28:02d},{w % 7},0\n"
        for i in range(2)
        for w in range(60)
    )
    header, *rows = good.splitlines(keepends=True)
    for name, content in {
        "empty": b"",
        "header only": header.encode(),
        "ragged row": (header + rows[0].rstrip("\n") + ",9,9\n" + "".join(rows[1:])).encode(),
        "unterminated quote": (header + '"s1,i0\n' + "".join(rows)).encode(),
        "null id": (header + "," + rows[0].split(",", 1)[1] + "".join(rows[1:])).encode(),
        "inf target": (header + rows[0].replace(",0,0\n", ",inf,0\n") + "".join(rows)).encode(),
        "text target": (header + rows[0].replace(",0,0\n", ",many,0\n") + "".join(rows)).encode(),
        "bad timestamp": (header + "s1,i0,someday,1,0\n" + "".join(rows)).encode(),
        "duplicate row": (header + rows[0] + "".join(rows)).encode(),
        "no target column": good.replace("units", "sold").encode(),
        "utf-16": good.encode("utf-16"),
        "binary": bytes(range(256)) * 8,
    }.items():
        data = files / f"{name.replace(' ', '_')}.csv"
        data.write_bytes(content)
        raw = {
            "job": {"name": "fuzz", "run_dir": str(tmp_path / "many" / data.stem)},
            "data": {"source": str(data), "id_columns": ["store", "item"], "timestamp": "week",
                     "target": "units", "covariates": ["promo"]},
            "models": {"names": ["seasonal_naive"]},
            "backtest": {"horizon": 2, "n_windows": 1},
            "tracking": {"mlflow": False},
        }  # fmt: skip
        cases.append((f"data {name}", ["many-models", job(name, tomli_w.dumps(raw).encode())]))

    # plan: every numeric flag, values no flag takes
    plan = build_parser()._subparsers._group_actions[0].choices["plan"]  # type: ignore[union-attr]
    numeric = [a.option_strings[0] for a in plan._actions if a.dest in NUMBERS]
    assert len(numeric) == len(NUMBERS), numeric
    for flag in numeric:
        for value in ("-1", "nan", "inf", "-inf", "abc", "", "1e400"):
            cases.append((f"plan {flag} {value}", ["plan", "--params", "1e8", flag, value]))

    assert len(cases) >= 500, len(cases)
    found = [f"{name}: {wrong}" for name, argv in cases if (wrong := verdict(argv)) is not None]
    assert found == [], f"{len(found)} of {len(cases)} cases:\n" + "\n".join(found[:40])
    assert before == {trained: fingerprint(trained), forecast: fingerprint(forecast)}
