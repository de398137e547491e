"""Real engines for the many-models tests, started once per test module on loopback: a local Ray
instance with 2 CPUs and a Spark `local[2]` session. Both are started before any test's
leaked-process snapshot, and stopped at the end of the module: an idle Ray instance takes about
4 CPU-s a minute (its log monitor polls its files ten times a second, its raylet, GCS and idle
workers keep time), and a session's instance stayed up 11 minutes after its module in `make
test`'s run at 2c7a6f2, against about 10 CPU-s to start one."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="module")
def ray_cluster():
    from shardwise.common.ray_cluster import loopback_ray

    here = os.path.dirname(__file__)  # the test models (bad_models.py), for the workers
    # as `shardwise many-models` starts it: loopback only, what the workers need given at start
    with loopback_ray(workers={"PYTHONPATH": here, "OMP_NUM_THREADS": "1"}):
        import ray

        ray.init(
            address="local",  # never a cluster another test or user started on this machine
            num_cpus=2,
            include_dashboard=False,
            logging_level="WARNING",
        )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def spark():
    from shardwise.common.spark_session import session

    spark = session("local[2]")
    yield spark
    spark.stop()
