"""What a logged model carries besides its weights, and how a store that cannot take it is
refused before any work (the registry itself is exercised in tests/e2e/test_registry.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import free_port
from shardwise.common.model_registry import Destination, RegistryError, check_reachable, log_pyfunc
from shardwise.training.tracking.registered_model import _code_paths, _requirements


def test_a_users_model_code_travels_with_the_model_and_an_installed_ones_does_not(repo_cwd):
    (found,) = _code_paths("examples.hf_gpt2:build_model")
    # the package the model was built from: the repository's, or a copy an earlier load of a
    # logged model put first on sys.path (MLflow's code_paths), in this same process
    assert Path(found).name == "examples" and (Path(found) / "hf_gpt2.py").is_file()
    assert _code_paths("cnn") is None  # a built-in: shardwise's own
    assert _code_paths("shardwise.models.gpt:build_gpt") is None
    assert _code_paths("polars:DataFrame") is None  # an installed package


def test_requirements_pin_what_the_model_loads_with():
    pinned = dict(r.split("==") for r in _requirements())
    assert {"torch", "safetensors", "numpy", "shardwise"} <= pinned.keys()
    assert "+" not in pinned["torch"]  # a local build tag pip could not resolve


def test_a_store_that_is_down_is_refused_within_seconds(tmp_path):
    with pytest.raises(RegistryError, match=r"MLflow at http://127\.0\.0\.1:\d+ did not answer"):
        check_reachable(f"http://127.0.0.1:{free_port()}")  # its own timeout: no hang
    with pytest.raises(RegistryError, match="no directory"):
        check_reachable(f"sqlite:///{tmp_path}/missing/mlflow.db")
    check_reachable(f"sqlite:///{tmp_path}/mlflow.db")  # a new store in an existing directory


def test_a_damaged_local_store_is_one_line(tmp_path):
    """A local store's database that cannot be read (SQLAlchemy's errors, not MLflow's) is a
    RegistryError naming the store, not a traceback."""
    database = tmp_path / "mlflow.db"
    database.write_bytes(b"not a database" * 100)
    destination = Destination(uri=f"sqlite:///{database}", experiment="e", run_name="r")
    with pytest.raises(RegistryError, match=r"mlflow\.db: the model was not logged"):
        log_pyfunc(destination, python_model=None)
    assert database.read_bytes() == b"not a database" * 100
