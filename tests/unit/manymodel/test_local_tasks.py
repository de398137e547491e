"""Where a many-models job's chunks run (issue 57 point 6): `runner.backend` resolved, and a
script without a `__main__` guard that calls the Python API runs its job once."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref
from pathlib import Path

import polars as pl
import pytest

from shardwise.common.environment import visible_cpus as cores
from shardwise.common.errors import ConfigError
from shardwise.common.job_files import validate_as
from shardwise.manymodel.config import ManyModelsConfig
from shardwise.manymodel.features.feature_files import FeatureChunks
from shardwise.manymodel.run.chunk_result import ChunkResult
from shardwise.manymodel.run.local_tasks import _Tasks, in_parts
from shardwise.manymodel.run.placement import choose, describe


def config(**runner) -> ManyModelsConfig:
    return validate_as(ManyModelsConfig, {"runner": runner})


@pytest.mark.parametrize(
    ("runner", "global_models", "ray_running", "name", "why"),
    [
        ({}, False, False, "processes", "no Ray cluster, global model or GPU asked for"),
        ({"num_cpus": 64}, False, False, "in-process", "one task at a time fits"),
        ({"ray_address": "auto"}, False, False, "ray", "runner.ray_address = 'auto'"),
        ({}, True, False, "ray", "global models fit on Ray's actors"),
        ({"num_gpus": 0.5}, False, False, "ray", "runner.num_gpus shares GPUs"),
        ({}, False, True, "ray", "Ray already runs in this process"),
        ({"backend": "local"}, False, True, "processes", "runner.backend = 'local'"),
        ({"backend": "ray"}, False, False, "ray", "runner.backend = 'ray'"),
    ],
)
def test_auto_takes_ray_only_where_it_pays(runner, global_models, ray_running, name, why):
    backend = choose(config(**runner), global_models, ray_running)
    assert backend.name == name and why in backend.why
    assert why in describe(backend)
    if name == "processes":
        assert backend.slots == cores() // int(runner.get("num_cpus", 1))


def test_local_refuses_what_only_ray_gives():
    with pytest.raises(ConfigError, match=r"runner\.backend = 'local' cannot run this job: global"):
        choose(config(backend="local"), True, False)


def test_a_script_without_a_main_guard_runs_its_job_once(tmp_path):
    """spawn imports the caller's `__main__` in each worker: without the guard every worker would
    start the job again (common/spawned.py keeps it out)."""
    script = tmp_path / "forecast.py"
    script.write_text(
        "import shardwise\n"
        "print('script ran', flush=True)\n"
        "jobs = shardwise.load_many_models('examples/us-employment-stats.toml', [\n"
        f"    'job.run_dir={tmp_path / 'run'}', 'data.num_series=4', 'tracking.mlflow=true',\n"
        "    'models.names=[\"seasonal_naive\"]', 'backtest.levels=[]', 'runner.chunk_size=1'])\n"
        "print(shardwise.many_models(jobs).completed)\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["script ran", "4"]
    assert "models run in" in done.stderr


@pytest.mark.parametrize(
    ("series", "slots", "size"),
    [(20, 2, 2), (500, 2, 50), (1000, 2, 100), (10_000, 2, 100), (7, 2, 1), (20, 4, 1)],
)
def test_chunks_fill_the_slots_last_round(series, slots, size):
    """Chunks of equal work end together: 20 series on 2 slots were 7 chunks of 3 (one slot
    idle for the last round, a third longer than the 10 series each could take), now 10 of 2;
    and at least 4 chunks a slot where the series allow, at most 100 series a chunk."""
    from shardwise.manymodel.run.chunk_store import even_chunk_size

    got = even_chunk_size(series, slots)
    chunks = -(-series // got)
    assert got == size
    assert -(-chunks // slots) * got == -(-series // slots)  # the busiest slot: its fair share
    assert got <= 100 and (chunks >= 4 * slots or got == 1)


def _three_chunks() -> FeatureChunks:
    """6 series in 3 chunks of 2."""
    return FeatureChunks(Path("."), 2, 6, (1,) * 3, pl.Schema(), "t")


def test_the_last_round_runs_in_parts_of_whole_series():
    """Chunks run whole, except the last `slots` where there are more chunks than slots: each
    in up to 8 parts, together every one of its series once, in order."""
    features = FeatureChunks(Path("."), 25, 95, (1,) * 4, pl.Schema(), "t")
    parts = in_parts(features, [3, 0, 1, 2], slots=2)
    assert [(p.index, p.of) for p in parts[:2]] == [(3, 1), (0, 1)]
    assert parts[0].series == range(75, 95) and parts[1].series == range(0, 25)
    for index in (1, 2):
        mine = [p for p in parts if p.index == index]
        assert len(mine) == 8 and {p.of for p in mine} == {8}
        assert [s for p in mine for s in p.series] == list(features.series_of(index))
        assert {len(p.series) for p in mine} <= {3, 4}
    assert [p.index for p in parts[2:]] == [1] * 8 + [2] * 8
    whole = in_parts(features, [0, 1], slots=2)  # no more chunks than slots: one round
    assert [(p.index, p.of) for p in whole] == [(0, 1), (1, 1)]
    small = in_parts(_three_chunks(), [0, 1, 2], 2)
    assert [(p.index, len(p.series)) for p in small] == [(0, 2), (1, 1), (1, 1), (2, 1), (2, 1)]


def test_a_chunk_handed_on_is_not_held_by_the_pool():
    """Once a chunk's parts have all come and it is handed on (written), the pool keeps no
    result of it: the driver's memory does not grow with the chunks run."""

    class Written:
        def __init__(self):
            self.chunks = []

        def chunk(self, index, result, took, spans=None):
            self.chunks.append((index, took, len(spans)))

    features = _three_chunks()
    written = Written()
    tasks = _Tasks(features, [0, 1, 2], slots=2, done=written)  # chunk 0 whole, 1 and 2 in 2
    held = []
    for position, part in enumerate(tasks.parts):
        result = ChunkResult(series=len(part.series), started=0.0, finished=1.0)
        held.append(weakref.ref(result))
        tasks.finish(position, result, 1.0)
        del result
    assert written.chunks == [(0, 1.0, 1), (1, 2.0, 2), (2, 2.0, 2)]
    gc.collect()
    assert [ref() for ref in held] == [None] * 5
