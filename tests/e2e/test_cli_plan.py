"""`shardwise plan --calibrate` measures this machine for real (two gloo ranks, every core busy),
and the job's own plan then uses that profile."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
SHARDWISE = str(Path(sys.executable).parent / "shardwise")


def test_calibrate_then_plan_the_job_on_this_machine(tmp_path):
    env = {
        "SHARDWISE_CACHE": str(tmp_path),
        "PATH": str(Path(sys.executable).parent),
        "TMPDIR": tempfile.gettempdir(),  # the session's
    }
    calibrated = subprocess.run(
        [SHARDWISE, "plan", "--calibrate"], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert calibrated.returncode == 0, calibrated.stderr
    profile = json.loads((tmp_path / "this-machine.json").read_text())
    # every figure measured: present, finite and positive (how large is bench/'s to say)
    assert profile["calibrated"] and 0 < profile["utilisation"] <= 1
    assert 0 < profile["tensor_parallel_efficiency"] <= 1
    measured = ["peak_flops", "intra_latency", "intra_bandwidth", "memory_bandwidth",
                "half_codec_rate", "int8_codec_rate", "powersgd_codec_rate",
                "powersgd_matrix_seconds"]  # fmt: skip
    measured += [f"{kind}_{what}" for kind in ("all_gather", "reduce_scatter")
                 for what in ("latency", "bandwidth")]  # fmt: skip
    for name in measured:
        assert 0 < profile[name] < math.inf, name
    assert 0 <= profile["layer_overhead"] < math.inf
    assert "PowerSGD r=4" in calibrated.stdout + calibrated.stderr
    planned = subprocess.run(
        [SHARDWISE, "plan", "examples/text-gpt.toml", "--nproc", "2", "--json"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert planned.returncode == 0, planned.stderr
    plan = json.loads(planned.stdout)
    assert plan["hardware"]["name"] == "this-machine"
    assert plan["job_layout"]["layout"]["dp"] == 2 and plan["job_layout"]["fits"]
