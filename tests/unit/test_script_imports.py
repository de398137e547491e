"""The scripts outside the package (bench/, examples/, docs/) import only names the package has:
nothing runs them in the suite, so a name moved inside `shardwise` would otherwise break them
unnoticed (a moved constant once broke `bench/many_models.py`)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(
    p for folder in ("bench", "examples", "docs") for p in (ROOT / folder).glob("*.py")
)


def _imports(path: Path) -> list[tuple[str, str]]:
    """(module, name) for every `from shardwise… import name`, lazy ones included, and every
    string of code the script runs elsewhere that does the same."""
    found = []
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("shardwise"):
            found += [(node.module or "", alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(a.name, "") for a in node.names if a.name.startswith("shardwise")]
        elif isinstance(node, ast.Constant) and "from shardwise" in str(node.value):
            try:
                inner = ast.parse(str(node.value).strip())
            except SyntaxError:
                continue
            found += [
                (sub.module or "", a.name)
                for sub in ast.walk(inner)
                if isinstance(sub, ast.ImportFrom) and (sub.module or "").startswith("shardwise")
                for a in sub.names
            ]
    return found


def test_there_are_scripts_to_check():
    assert len(SCRIPTS) >= 10
    assert any(_imports(path) for path in SCRIPTS)


@pytest.mark.parametrize("path", SCRIPTS, ids=[str(p.relative_to(ROOT)) for p in SCRIPTS])
def test_a_script_imports_only_names_the_package_has(path):
    missing = []
    for module, name in _imports(path):
        loaded = importlib.import_module(module)
        if name and not hasattr(loaded, name):
            try:  # a submodule imported by name
                importlib.import_module(f"{module}.{name}")
            except ModuleNotFoundError:
                missing.append(f"from {module} import {name}")
    assert not missing, missing
