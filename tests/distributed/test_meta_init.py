"""A model larger than one rank can hold still starts under FSDP: it is built on the meta device and
each rank allocates and initialises only its shard, one module at a time. Measured as the growth of
each process's peak resident memory while the layout is built, for a 100M-parameter (400 MB) GPT
sharded over 2 ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import gpt_job, run_distributed

pytestmark = pytest.mark.slow
BIG = {"layers": 8, "heads": 8, "hidden": 1024, "seq_len": 128, "mlp_ratio": 4}


def _peak_growth(config_data: dict) -> tuple[int, int]:
    """(growth of this process's peak resident memory while the layout is built, bytes of this
    rank's parameters)."""
    import torch
    import torch.distributed as dist

    from shardwise.training.config.derive import derive
    from shardwise.training.config.schema import JobConfig
    from shardwise.training.parallel.mesh import build_mesh
    from shardwise.training.trainer.build import build_layout
    from shardwise.training.trainer.memory import state_bytes

    config = JobConfig.model_validate(config_data)
    derived = derive(config, dist.get_world_size())
    mesh = build_mesh(derived.degrees, "cpu")
    # Code is not the model's memory: FSDP2 imports TorchDynamo (some 50 MB of modules) on first
    # use, which a rank of a run without a pipeline has not done before (parallel/stage.py).
    import torch._dynamo

    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current RSS
    before = _status_kib("VmRSS")
    layout = build_layout(config, derived, mesh, torch.device("cpu"), sample=None)
    return (_status_kib("VmHWM") - before) * 1024, state_bytes(layout.parts)["params"]


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"{field} not in /proc/self/status")


def test_meta_init_allocates_only_this_ranks_shard(tmp_path):
    whole = 0
    growth = {}
    for init in ("meta", "full"):
        config = gpt_job(
            tmp_path, model={"args": BIG, "init": init}, parallel={"dp_shard": 2}
        ).model_dump(mode="json")
        results = run_distributed(_peak_growth, 2, config, timeout=300)
        growth[init] = max(g for g, _ in results)
        whole = sum(p for _, p in results)
    assert whole > 400e6  # the model: 100M fp32 parameters
    # meta: half the model plus one module's full-size copy (the largest is 16 MB)
    assert growth["meta"] < 0.5 * whole + 40e6, growth
    # full: every rank first builds the whole model, then keeps half
    assert growth["full"] > 0.95 * whole, growth
