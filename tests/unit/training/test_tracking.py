import multiprocessing
import os
import signal
import sqlite3
import subprocess
import sys
import time
import warnings
from contextlib import closing
from pathlib import Path

import mlflow
from mlflow.tracking import MlflowClient

from helpers import free_port
from shardwise.common.mlflow import (
    MlflowTracker,
    experiment_id,
    hasten,
    open_client,
    wait_while_working,
)
from shardwise.training.tracking.metrics import JsonlTracker, read_metrics


def test_jsonl_appends_and_marks_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    first = JsonlTracker(path)
    first.log_metrics({"loss": 1.5}, step=1)
    first.close("FINISHED")
    second = JsonlTracker(path, resumed_from=1)
    second.log_metrics({"loss": 1.0}, step=2)
    second.close("FINISHED")
    records = read_metrics(path)
    assert [r.get("loss") for r in records] == [None, 1.5, None, 1.0]
    assert [r.get("event") for r in records] == ["start", None, "resume", None]


def test_mlflow_records_params_metrics_and_reopens_the_run(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = MlflowTracker(
        uri=uri,
        experiment="exp",
        run_name="r",
        artifact_dir=tmp_path / "art",
        id_file=tmp_path / "run_id",
    )
    tracker.log_params({"train.lr": "0.1"})
    for step in range(1, 2501):  # more than one batch of 1000
        tracker.log_metrics({"loss": 1.0 / step}, step)
    (tmp_path / "config.toml").write_text("x = 1\n")
    tracker.log_artifact(tmp_path / "config.toml")
    tracker.close("FINISHED")
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(tracker.run_id)
    assert run.data.params == {"train.lr": "0.1"}
    assert run.info.status == "FINISHED"
    assert len(client.get_metric_history(tracker.run_id, "loss")) == 2500
    assert (tmp_path / "run_id").read_text() == tracker.run_id
    assert [a.path for a in client.list_artifacts(tracker.run_id)] == ["config.toml"]

    again = MlflowTracker(
        uri=uri, experiment="exp", run_name="r", artifact_dir=None, run_id=tracker.run_id
    )
    again.log_params({"train.lr": "0.1", "train.steps": "5"})
    again.log_metrics({"loss": 0.0}, 2501)
    again.close("FINISHED")
    assert again.run_id == tracker.run_id
    assert client.get_run(tracker.run_id).data.params["train.steps"] == "5"
    assert len(client.get_metric_history(tracker.run_id, "loss")) == 2501


def test_mlflow_samples_the_machine_while_the_run_is_open(tmp_path):
    """CPU and memory of the trainer's machine (GPU too where one is), as MLflow's system
    metrics, sampled in the tracking process; `system_metrics_s = 0` turns them off."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    sampled = MlflowTracker(
        uri=uri, experiment="exp", run_name="on", artifact_dir=None, system_metrics_s=0.5
    )
    sampled.log_metrics({"loss": 1.0}, 1)
    deadline = time.monotonic() + 120  # the tracking process runs at nice 19: slow when busy
    # Opened as the tracker opens it: MlflowClient itself would build the new store's schema in
    # place while the tracking process builds it too (their migrations collide: CI saw
    # "AttributeError: dimension_attributes" in the tracker and a run that never opened).
    client = open_client(uri)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        while time.monotonic() < deadline:  # the run exists once the tracking process opened it
            run_id = sampled.run_id
            stopped = [str(w.message) for w in caught if "tracking stopped" in str(w.message)]
            assert not stopped, stopped[0]
            metrics = client.get_run(run_id).data.metrics if run_id else {}
            if "system/cpu_utilization_percentage" in metrics:
                break
            time.sleep(0.5)
    sampled.close("FINISHED")
    metrics = client.get_run(sampled.run_id).data.metrics
    assert "system/cpu_utilization_percentage" in metrics
    assert metrics["system/system_memory_usage_megabytes"] > 0

    quiet = MlflowTracker(
        uri=uri, experiment="exp", run_name="off", artifact_dir=None, system_metrics_s=0
    )
    quiet.log_metrics({"loss": 1.0}, 1)
    time.sleep(1.5)
    quiet.close("FINISHED")
    assert not any(k.startswith("system/") for k in client.get_run(quiet.run_id).data.metrics)


def test_mlflow_down_warns_and_never_raises(monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tracker = MlflowTracker(uri=uri, experiment="e", run_name="r", artifact_dir=None)
        tracker.log_metrics({"loss": 1.0}, 1)
        tracker.close("FINISHED")
    assert any("MLflow tracking stopped" in str(w.message) for w in caught)
    assert tracker.run_id is None


def test_mlflow_bad_uri_warns():
    # The warning comes from the tracker's thread, so record around its whole life.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tracker = MlflowTracker(
            uri="bogus-scheme://nowhere", experiment="e", run_name="r", artifact_dir=None
        )
        tracker.close("FINISHED")
    assert any("training continues" in str(w.message) for w in caught)


def _experiments(uri: str, names: list[str], barrier, results) -> None:
    client = open_client(uri)
    found = []
    for name in names:
        barrier.wait()  # every process asks for the experiment at once
        try:
            found.append(experiment_id(client, name, None))
        except Exception as e:  # what the test reports
            found.append(f"{type(e).__name__}: {e}"[:200])
    results.put(found)


def test_processes_opening_a_new_experiment_at_once_all_get_it(tmp_path):
    """Runs that start together on a new experiment (a live replica taking the reporting over
    while the one it replaces still opens the run; two jobs launched at once) each find the
    experiment that one of them created: none fails on "already exists"."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    open_client(uri)
    context = multiprocessing.get_context("fork")
    barrier, results = context.Barrier(3, timeout=60), context.Queue()
    names = [f"new-{i}" for i in range(8)]
    processes = [
        context.Process(target=_experiments, args=(uri, names, barrier, results)) for _ in range(3)
    ]
    for process in processes:
        process.start()
    found = [results.get(timeout=120) for _ in processes]
    for process in processes:
        process.join(timeout=60)
    assert all(process.exitcode == 0 for process in processes)
    assert found[0] == found[1] == found[2], found
    assert all(id.isdigit() for id in found[0]), found


def _busy(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def _niced_with_a_thread(ready) -> None:
    import threading

    os.nice(19)
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
    ready.set()
    time.sleep(60)


def test_closing_waits_for_the_tracker_while_it_works_and_not_once_it_is_stuck():
    """The MLflow process runs at nice 19: on a machine other work keeps busy it can take
    minutes to flush, and the run waits for it; one that has used no CPU for the limit is
    stuck, and the wait ends."""
    context = multiprocessing.get_context("fork")
    working = context.Process(target=_busy, args=(3.0,))  # 3 CPU-s: past the 1 s limit
    working.start()
    assert wait_while_working(working, stalled_s=1.0)
    assert working.exitcode == 0
    stuck = context.Process(target=time.sleep, args=(60,))
    stuck.start()
    assert not wait_while_working(stuck, stalled_s=1.0)
    assert stuck.exitcode is None
    stuck.terminate()
    stuck.join()


def test_the_tracker_is_run_at_the_trainers_priority_once_the_trainer_waits_on_it():
    """Closing the run: every thread of the nice-19 MLflow process gets this process's priority
    where the system lets a process raise one (root here and in CI); elsewhere it keeps its
    own."""
    import psutil

    context = multiprocessing.get_context("fork")
    ready = context.Event()
    niced = context.Process(target=_niced_with_a_thread, args=(ready,), daemon=True)
    niced.start()
    try:
        assert ready.wait(60)
        threads = [t.id for t in psutil.Process(niced.pid).threads()]
        assert len(threads) == 2
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        hasten(niced.pid)
        allowed = os.geteuid() == 0
        expected = mine if allowed else min(19, mine + 19)
        assert [os.getpriority(os.PRIO_PROCESS, t) for t in threads] == [expected] * 2
    finally:
        niced.terminate()
        niced.join()
    hasten(niced.pid)  # gone: nothing to do, and no error


def test_an_uneven_pipeline_is_told_how_to_balance():
    from shardwise.training.trainer.display import bubble_advice

    def ranks(*bubbles):
        return [{"rank": r, "bubble": b, "bubble_theory": 0.2} for r, b in enumerate(bubbles)]

    advice = bubble_advice(ranks(0.55, 0.21), fix="use cost")
    assert advice == (
        "pipeline: ranks idled up to 55% of each step where the schedule needs 20%: the stages' "
        "work is uneven; use cost"
    )
    assert bubble_advice(ranks(0.3, 0.25), fix="use cost") is None  # near the theory
    assert bubble_advice(ranks(0.55, 0.5), fix=None) is None  # nothing to suggest
    assert bubble_advice([{"rank": 0}], fix="use cost") is None  # not a pipeline


def test_a_store_whose_creator_was_killed_midway_opens(tmp_path, monkeypatch):
    """MLflow builds a new SQLite store's schema in some 60 migrations, seconds of work; a process
    killed among them (a run stopped in its first seconds, a Spark stage cancelled) must not leave
    a database that every later open refuses ("table … already exists"), nor a half-built empty
    store in shardwise's cache (what new stores are copied from)."""
    monkeypatch.setenv("SHARDWISE_CACHE", str(tmp_path / "cache"))  # empty: built, and killed
    (tmp_path / "run").mkdir()
    uri = f"sqlite:///{tmp_path / 'run' / 'mlflow.db'}"
    killed_midway = f"""
import os, signal
from sqlalchemy import event
from sqlalchemy.engine import Engine
created = []
@event.listens_for(Engine, "after_cursor_execute")
def _kill(conn, cursor, statement, *args):
    if statement.lstrip().upper().startswith("CREATE TABLE"):
        created.append(statement)
        if len(created) == 12:
            os.kill(os.getpid(), signal.SIGKILL)
from shardwise.common.mlflow import open_client
open_client({uri!r})
"""
    done = subprocess.run([sys.executable, "-c", killed_midway], capture_output=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()
    client = open_client(uri)
    run = client.create_run(client.create_experiment("after-a-kill"))
    client.log_metric(run.info.run_id, "loss", 1.0)
    assert client.get_run(run.info.run_id).data.metrics == {"loss": 1.0}
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) in (
        ["mlflow.db"],
        ["artifacts", "mlflow.db"],
    )
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [
        f"mlflow-{mlflow.__version__}-empty.db"
    ]


def test_a_new_store_is_a_copy_of_mlflows_own_empty_store_made_here(tmp_path, monkeypatch):
    """A new run directory's store is copied from an empty store MLflow built once in
    shardwise's cache (its migrations cost 1.8 CPU-s in every new run directory): the same
    schema, version and rows as a store MLflow builds itself in that directory, the Default
    experiment's artifacts under this working directory, and it records runs."""
    monkeypatch.setenv("SHARDWISE_CACHE", str(tmp_path / "cache"))
    for name in ("first", "second", "mlflows"):
        (tmp_path / name).mkdir()

    def dump(db: Path) -> tuple[list, list]:
        with closing(sqlite3.connect(db)) as conn:
            # a table's clauses in any order: MLflow's own builds differ in it (hash seeds)
            schema = [
                (kind, name, sorted(line.strip().rstrip(",") for line in (sql or "").split("\n")))
                for kind, name, sql in conn.execute("SELECT type, name, sql FROM sqlite_master")
            ]
            rows = conn.execute(
                "SELECT experiment_id, name, artifact_location, lifecycle_stage, workspace "
                "FROM experiments UNION ALL SELECT 'version', version_num, '', '', '' FROM "
                "alembic_version UNION ALL SELECT 'ws', name, '', '', '' FROM workspaces"
            )
            return sorted(schema), rows.fetchall()

    monkeypatch.chdir(tmp_path / "mlflows")
    MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflows' / 'own.db'}")  # MLflow's own
    own_schema, own_rows = dump(tmp_path / "mlflows" / "own.db")
    for name in ("first", "second"):  # the first builds the empty store, the second copies it
        monkeypatch.chdir(tmp_path / name)
        client = open_client(f"sqlite:///{tmp_path / name / 'mlflow.db'}")
        schema, rows = dump(tmp_path / name / "mlflow.db")
        assert schema == own_schema
        assert rows == [
            (r[0], r[1], str(tmp_path / name / "mlruns" / "0"), *r[3:]) if r[0] == 0 else r
            for r in own_rows
        ]
        run = client.create_run(client.create_experiment("e")).info.run_id
        client.log_metric(run, "loss", 1.5, step=1)
        assert client.get_run(run).data.metrics == {"loss": 1.5}
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [
        f"mlflow-{mlflow.__version__}-empty.db"
    ]
