"""Real engines for the many-models tests, started once per session on loopback: a local Ray
instance with 2 CPUs and a Spark `local[2]` session. Both are started before any test's
leaked-process snapshot, and stopped at the end of the session."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    from shardwise.common.ray_cluster import loopback_ray

    here = os.path.dirname(__file__)  # the test models (bad_models.py), for the workers
    with loopback_ray():  # as `shardwise many-models` starts it
        import ray

        ray.init(
            address="local",  # never a cluster another test or user started on this machine
            num_cpus=2,
            include_dashboard=False,
            logging_level="WARNING",
            runtime_env={"env_vars": {"PYTHONPATH": here, "OMP_NUM_THREADS": "1"}},
        )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def spark():
    from shardwise.common.spark import session

    spark = session("local[2]")
    yield spark
    spark.stop()
