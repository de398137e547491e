"""A Spark session, for the products that start one: many-models' features
(manymodel/features/spark_features.py) and training on Spark (launch/spark_tasks.py)."""

from __future__ import annotations

from typing import Any

from shardwise.common.environment import environment


def session(master: str, *, app: str = "shardwise-features", python: str | None = None) -> Any:
    """A Spark session on `master`, every server of it bound to loopback for local masters;
    `python`: the interpreter its Python workers run (Spark's default otherwise)."""
    from pyspark.sql import SparkSession

    builder = (
        SparkSession.builder.master(master)
        .appName(app)
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
    )
    if master.startswith("local"):
        builder = (
            builder.config("spark.driver.host", "127.0.0.1")
            .config("spark.driver.bindAddress", "127.0.0.1")
            .config("spark.sql.shuffle.partitions", "8")
        )
    # SparkContext takes its workers' interpreter from PYSPARK_PYTHON when it starts; a local
    # cluster's master, workers and executors (their block managers, RPC servers) bind to the
    # address in SPARK_LOCAL_IP, else to the host's first non-loopback one
    started = {"PYSPARK_PYTHON": python} if python else {}
    if master.startswith("local"):
        started["SPARK_LOCAL_IP"] = "127.0.0.1"
    with environment(started):
        spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark
