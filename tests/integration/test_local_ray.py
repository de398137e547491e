"""The local Ray instance `shardwise many-models` starts: its workers import user models from the
working directory and their numeric libraries run one thread each, and the job asks for no
runtime environment, so the workers Ray starts with the instance run its tasks. With a runtime
environment (as the thread limits and the working directory had been given), Ray started new
workers for it and let the ones it had started idle: two more interpreters a run, and the first
task about a second later (0.57 against 1.5 s from `ray.init` to the results of 8 tasks,
measured on a 2-core machine)."""

from __future__ import annotations

import os

import pytest

from shardwise.common.job_files import validate_as
from shardwise.manymodel.config import ManyModelsConfig
from shardwise.manymodel.run.ray_tasks import start_ray
from shardwise.manymodel.run.warm_imports import THREAD_ENV

pytestmark = pytest.mark.slow


def test_a_local_instance_gives_its_workers_the_working_directory_and_one_thread(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "user_model_here.py").write_text("ANSWER = 42\n")
    config = validate_as(ManyModelsConfig, {"job": {"name": "mm", "run_dir": str(tmp_path)}})
    ours = [*THREAD_ENV, "PYTHONPATH"]
    before = {name: os.environ.get(name) for name in ours}
    ray, started = start_ray(config)
    try:
        assert started
        # the driver's own environment is left as it was (Ray sets some of its own variables)
        assert {name: os.environ.get(name) for name in ours} == before

        @ray.remote
        def seen() -> tuple[dict[str, str | None], int, str]:
            import user_model_here  # from the working directory, as user models are

            limits = {name: os.environ.get(name) for name in THREAD_ENV}
            # on PYTHONPATH too, for the processes a model starts (joblib's, multiprocessing's)
            first = os.environ.get("PYTHONPATH", "").split(os.pathsep)[0]
            return limits, user_model_here.ANSWER, first

        limits, answer, first = ray.get(seen.remote())
        assert limits == THREAD_ENV and answer == 42 and first == str(tmp_path)
        # The job asks for no runtime environment, which is what lets the workers Ray started
        # with the instance serve its tasks (this checks the cause, not which worker ran them).
        assert ray.get_runtime_context().runtime_env == {}
    finally:
        ray.shutdown()
