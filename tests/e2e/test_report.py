"""`shardwise report`: one self-contained HTML page from a run's files, written at the end of
every run and logged to MLflow, checked in a real headless browser (Chromium from the system's
packages): the page renders and its charts are drawn."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from PIL import Image

import helpers
import shardwise
from helpers import gpt_job

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
CHARTS = {"loss.png", "throughput.png", "memory.png", "bubble.png", "time.png"}


def browser() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.skip("Chromium is not installed (make install puts it there with apt as root)")
    return found


def test_a_pipelined_run_writes_a_report_that_renders(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDWISE_FAULT", "nan:step=3")
    job = gpt_job(
        tmp_path / "run",
        train={"steps": 12},
        parallel={"pp": 2, "pipeline_schedule": "1F1B"},
        eval={"every_steps": 6},
        fault={"on_nonfinite": "skip"},
        tracking={"log_every": 2, "profile_step": 4, "mlflow": True, "report": True},
    )
    summary = shardwise.train(job, nproc=2)
    assert summary is not None
    report = tmp_path / "run" / "report"
    assert {p.name for p in report.glob("*.png")} == CHARTS
    page = (report / "report.html").read_text()
    assert page.count("data:image/png;base64,") == len(CHARTS)  # self-contained
    assert "skipped steps so far: 1" in page
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'run' / 'mlflow.db'}")
    logged = [a.path for a in client.list_artifacts(summary.mlflow_run_id, "report")]
    assert "report/report.html" in logged and "report/time.png" in logged

    shot = tmp_path / "shot.png"
    rendered = subprocess.run(
        [
            browser(),
            *("--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"),
            *("--window-size=1000,4200", f"--screenshot={shot}"),
            (report / "report.html").as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert rendered.returncode == 0, rendered.stderr
    image = Image.open(shot).convert("RGB")
    assert image.size == (1000, 4200)
    colours = image.getcolors(maxcolors=1 << 20) or []
    # charts draw lines and bars in many colours; a page that failed to show them is text only
    assert len(colours) > 500
    dom = subprocess.run(
        [browser(), "--headless", "--no-sandbox", "--dump-dom", (report / "report.html").as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert len(re.findall(r"<img ", dom.stdout)) == len(CHARTS)

    again = helpers.shardwise_command(
        "report", str(tmp_path / "run"), "--out", str(tmp_path / "again")
    )
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == f"report: {tmp_path / 'again' / 'report.html'}"
    assert {p.name for p in (tmp_path / "again").glob("*.png")} == CHARTS


def test_a_directory_that_is_no_run_is_refused_in_one_line(tmp_path):
    done = helpers.shardwise_command("report", str(tmp_path))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"shardwise: error: {tmp_path} has no metrics.jsonl: give the run_dir of a shardwise "
        "training run (the job's job.run_dir)"
    ]
