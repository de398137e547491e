"""Every `shardwise …` command the README shows parses with the CLI's own parser, and where it
names a job file of this repository, that file with the command's `--set` overrides loads and
validates (every key exists in the schema, every value has its type): the README's commands
work as written, and a renamed flag or key fails here, not in a user's shell. A command shown
with the error it ends in (`$ shardwise …` then `shardwise: error: …`) ends in that error."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from shardwise.cli import build_parser, main
from shardwise.manymodel.config import load_many_models
from shardwise.training.config.load import load_config

ROOT = Path(__file__).resolve().parents[2]
SHELL = {">", ">>", "|", "&&", ";", "&", "2>&1"}
"""Where the command ends and the shell's redirections or the next command begin."""


def readme_commands() -> list[tuple[str, str]]:
    """Each command, and the error line the README shows after it ("" where none)."""
    text = (ROOT / "README.md").read_text()
    found = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
        lines = [line.strip() for line in block.replace("\\\n", " ").splitlines()]
        for line, after in zip(lines, [*lines[1:], ""], strict=True):
            line = line.removeprefix("$ ")
            if line.startswith("shardwise "):
                shown = after if after.startswith("shardwise: error: ") else ""
                found.append((line, shown))
    return found


def _args(line: str) -> list[str]:
    words = shlex.split(line, comments=True)[1:]
    cut = next((i for i, word in enumerate(words) if word in SHELL), len(words))
    return words[:cut]


COMMANDS = readme_commands()


def test_the_readme_shows_the_commands():
    kinds = {_args(line)[0] for line, _ in COMMANDS}
    assert {"train", "many-models", "plan", "export", "report", "launch"} <= kinds
    assert len(COMMANDS) >= 50


@pytest.mark.parametrize(("line", "error"), COMMANDS, ids=[line for line, _ in COMMANDS])
def test_a_readme_command_parses_and_its_job_loads(line, error, monkeypatch, capsys):
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
