"""One chunk of series, the unit of work a Ray task runs: build the models once, then backtest,
select and forecast each series (backtest.py), threads pinned and memory capped (limits.py)."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import polars as pl

from shardwise.manymodel.columns import SERIES
from shardwise.manymodel.evaluation.backtest import Given, Plan, forecast_series
from shardwise.manymodel.models.per_series import build
from shardwise.manymodel.models.transforms import TARGET
from shardwise.manymodel.run.chunk_result import ChunkResult
from shardwise.manymodel.run.limits import memory_cap, one_thread


def run_chunk(rows: Any, plan: Plan, given: Any = None) -> ChunkResult:
    """Backtest, select and forecast every series in `rows` (an Arrow table or polars frame of
    whole series, features included), with the global models' forecasts of them `given`
    (global_models.GIVEN_SCHEMA). Threads are pinned to one; `plan.memory_mb` caps the address
    space while the chunk runs."""
    result = ChunkResult(started=time.time(), pid=os.getpid(), levels=plan.levels)
    frame = rows if isinstance(rows, pl.DataFrame) else pl.from_arrow(rows)
    assert isinstance(frame, pl.DataFrame)
    if plan.columns.target != TARGET:
        frame = frame.rename({plan.columns.target: TARGET})
    uses_torch = "torch" in sys.modules or any(name == "mlp" for _, name, _ in plan.models)
    with one_thread(torch_too=uses_torch), memory_cap(plan.memory_mb):
        models = {
            label: build(name, args, plan.context)
            if label not in plan.global_models
            else Given(label, given)
            for label, name, args in plan.models
        }
        for part in frame.partition_by(SERIES, maintain_order=True):
            forecast_series(part, plan, models, result)
    result.finished = time.time()
    return result
