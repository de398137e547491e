"""Every `shardwise …` command the README and the pages of docs/ show parses with the CLI's own
parser, and where it names a job file of this repository, that file with the command's `--set`
overrides loads and validates (every key exists in the schema, every value has its type): the
commands work as written, and a renamed flag or key fails here, not in a user's shell. A command
shown with the error it ends in (`$ shardwise …` then `shardwise: error: …`) ends in that error.

Every config key the pages quote exists in the schema of the job file it belongs to, also where
no job file of the repository can check it: the keys of a placeholder's `--set` overrides
(`shardwise train job.toml --set …`), of the TOML blocks (```toml: `[section]` headers and
`key = value` lines), and of the keys written in the text (`train.precision = "auto"`). A key
that was renamed in the schema and not in the pages fails here. Free-form tables (a builder's
`args`, the per-model tables of many-models) take any key below them."""

from __future__ import annotations

import itertools
import re
import shlex
import tomllib
import typing
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from shardwise.cli import build_parser, main
from shardwise.manymodel.config import ManyModelsConfig, load_many_models
from shardwise.training.config.load import load_config
from shardwise.training.config.schema import JobConfig

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
"""The README and every page of docs/: every command and key they show is checked."""
SHELL = {">", ">>", "|", "&&", ";", "&", "2>&1"}
"""Where the command ends and the shell's redirections or the next command begin."""
SCHEMAS: dict[str, type[BaseModel]] = {"training": JobConfig, "many-models": ManyModelsConfig}
"""The two job files; a command's or a block's keys are checked against the one it belongs to."""
COMMAND_SCHEMA = {
    "train": "training",
    "launch": "training",
    "plan": "training",
    "many-models": "many-models",
}
"""The job file each command that takes `--set` reads."""


def page_name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def code_blocks(page: Path) -> list[tuple[str, str]]:
    """Each fenced code block of a page: its language ("" where none) and its text."""
    return re.findall(r"```([a-z]*)\n(.*?)```", page.read_text(), re.S)


def docs_commands() -> list[tuple[str, str, str]]:
    """Each command, the page it is on, and the error line the page shows after it ("" where
    none)."""
    found = []
    for page in PAGES:
        for _, block in code_blocks(page):
            lines = [line.strip() for line in block.replace("\\\n", " ").splitlines()]
            for line, after in zip(lines, [*lines[1:], ""], strict=True):
                line = line.removeprefix("$ ")
                if line.startswith("shardwise "):
                    shown = after if after.startswith("shardwise: error: ") else ""
                    found.append((page_name(page), line, shown))
    return found


def _args(line: str) -> list[str]:
    words = shlex.split(line, comments=True)[1:]
    cut = next((i for i, word in enumerate(words) if word in SHELL), len(words))
    return words[:cut]


COMMANDS = docs_commands()
COMMAND_IDS = [f"{page}: {line}" for page, line, _ in COMMANDS]


def test_the_docs_show_the_commands():
    kinds = {_args(line)[0] for _, line, _ in COMMANDS}
    assert {"train", "many-models", "plan", "export", "report", "launch"} <= kinds
    assert len(COMMANDS) >= 50


def test_the_readme_shows_a_command_for_each_product():
    """A newcomer sees one example each of training, many models and the planner."""
    kinds = {_args(line)[0] for page, line, _ in COMMANDS if page == "README.md"}
    assert {"train", "many-models", "plan"} <= kinds


@pytest.mark.parametrize(("page", "line", "error"), COMMANDS, ids=COMMAND_IDS)
def test_a_docs_command_parses_and_its_job_loads(page, line, error, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    args = build_parser().parse_args(_args(line))  # argparse exits (a failure) on a bad flag
    if error:  # it stops before any process starts, with the line shown
        assert main(_args(line)) == 2
        assert capsys.readouterr().err.strip() == error
        return
    job = getattr(args, "job", None)
    if job is None or not (ROOT / job).is_file():
        return  # a placeholder (job.toml) or no job file
    overrides = getattr(args, "overrides", None) or []
    if args.command == "many-models":
        load_many_models(job, overrides)
    elif args.command in ("train", "launch", "plan"):
        load_config(job, overrides)


def unknown(schema: type[BaseModel], key: str) -> bool:
    """Whether a dotted key (`train.lr`, `models.args.mstl`) is not in the schema. Below a
    free-form table (a `dict` field) any key is in it."""
    model: type[BaseModel] | None = schema
    for part in key.split("."):
        if model is None:  # below a value that is not a table
            return True
        fields = {field.alias or name: field for name, field in model.model_fields.items()}
        fields |= model.model_fields  # populate_by_name: the Python name works too
        if part not in fields:
            return True
        annotation = fields[part].annotation
        if typing.get_origin(annotation) is dict:
            return False
        is_model = isinstance(annotation, type) and issubclass(annotation, BaseModel)
        model = annotation if is_model else None
    return False


def set_keys() -> list[tuple[str, str, str, str]]:
    """Each key a command's `--set` overrides: its page, the command, the job file, the key. A
    command shown with its error is left out: it may show an unknown key (`train.stpes`)."""
    found = []
    for page, line, error in COMMANDS:
        args = _args(line)
        if error or args[0] not in COMMAND_SCHEMA:
            continue
        for flag, item in itertools.pairwise(args):
            if flag == "--set":
                found.append((page, line, COMMAND_SCHEMA[args[0]], item.partition("=")[0]))
    return found


SET_KEYS = set_keys()


@pytest.mark.parametrize(
    ("page", "line", "job_file", "key"),
    SET_KEYS,
    ids=[f"{page}: --set {key} in {line}" for page, line, _, key in SET_KEYS],
)
def test_a_key_a_command_sets_is_in_its_job_files_schema(page, line, job_file, key):
    assert not unknown(SCHEMAS[job_file], key), (
        f"{page}: `{line}` sets {key}, which the {job_file} job file does not have"
    )


def toml_keys(table: dict[str, Any], prefix: str = "") -> list[str]:
    """Every dotted key of a parsed TOML table, its tables' names included."""
    keys = []
    for name, value in table.items():
        keys.append(prefix + name)
        if isinstance(value, dict):
            keys += toml_keys(value, f"{prefix}{name}.")
    return keys


TOML_BLOCKS = [
    (page_name(page), block)
    for page in PAGES
    for language, block in code_blocks(page)
    if language == "toml"
]


@pytest.mark.parametrize(
    ("page", "block"),
    TOML_BLOCKS,
    ids=[f"{page}: {block.splitlines()[0]}" for page, block in TOML_BLOCKS],
)
def test_a_toml_block_has_only_keys_of_its_job_file(page, block):
    """A block belongs to the job file that has every one of its sections, and where both do
    (`[data]`, `[tracking]`), to the one that has every one of its keys."""
    table = tomllib.loads(block)  # a block that is not TOML fails here
    owners = [name for name, schema in SCHEMAS.items() if set(table) <= set(schema.model_fields)]
    assert owners, f"{page}: sections {sorted(table)} are not all in one job file"
    missing = {
        name: [key for key in toml_keys(table) if unknown(SCHEMAS[name], key)] for name in owners
    }
    assert any(not keys for keys in missing.values()), f"{page}: unknown keys {missing}"


def test_the_job_files_overview_names_every_key():
    """The training job file's overview (a TOML block of every section, each with its keys in a
    comment, docs/training.md) names every key of the schema: a key added to the schema and not
    to the overview fails here."""
    sections = set(JobConfig.model_fields)
    ((page, block),) = [
        (page, block)
        for page, block in TOML_BLOCKS
        if set(tomllib.loads(block)) == sections and "#" in block
    ]
    comments: dict[str, str] = {}
    section = ""
    for line in block.splitlines():
        header = re.match(r"\[(\w+)\]", line)
        section = header.group(1) if header else section
        comments[section] = comments.get(section, "") + line.partition("#")[2]
    for name, field in JobConfig.model_fields.items():
        model = field.annotation
        assert isinstance(model, type)
        assert issubclass(model, BaseModel)
        named = set(re.findall(r"\w+", comments[name]))
        keys = [inner.alias or key for key, inner in model.model_fields.items()]
        assert [key for key in keys if key not in named] == [], f"{page}: [{name}]"


FILE_NAME = re.compile(r"\.(py|toml|json|jsonl|md|html|png|parquet|db|yaml|sh)$")
"""`data.py`, `job.toml`: a file, not a key."""


def text_keys() -> list[tuple[str, str]]:
    """Each key a page's text writes in a code span (`train.lr`, `model.init = "meta"`,
    `--set train.steps=100`) whose first part is a section of a job file, once per page."""
    sections = {section for schema in SCHEMAS.values() for section in schema.model_fields}
    found = {}
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for span in re.findall(r"`([^`\n]+)`", text):
            span = span.removeprefix("--set ").strip("'\"")
            key = re.split(r"\s*=", span, maxsplit=1)[0]
            is_key = re.fullmatch(r"[a-z_]+(\.[A-Za-z0-9_<>]+)+", key)
            if is_key and key.split(".")[0] in sections and not FILE_NAME.search(key):
                found[(page_name(page), key)] = None
    return list(found)


TEXT_KEYS = text_keys()


@pytest.mark.parametrize(("page", "key"), TEXT_KEYS, ids=[f"{p}: {k}" for p, k in TEXT_KEYS])
def test_a_key_the_text_names_is_in_a_job_files_schema(page, key):
    assert any(not unknown(schema, key) for schema in SCHEMAS.values()), (
        f"{page} names {key}, which no job file has"
    )


def test_the_docs_quote_keys():
    """The checks above see the pages' keys: a change in how pages are read cannot silently
    leave them without any."""
    assert len(SET_KEYS) >= 40
    assert len(TOML_BLOCKS) >= 5
    assert len(TEXT_KEYS) >= 50
