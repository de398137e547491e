"""Fault injection fires on a job's first attempt only, whoever restarted it."""

from __future__ import annotations

from shardwise.training.fault.inject import ENV, FaultPlan


def test_faults_fire_on_the_first_attempt_only_restarted_or_requeued():
    environ = {ENV: "slow:step=1:seconds=2,kill:rank=1:step=7"}
    assert len(FaultPlan.from_env(rank=1, attempt=0, environ=environ).faults) == 2
    assert FaultPlan.from_env(rank=1, attempt=1, environ=environ).faults == []  # the launcher's
    requeued = {**environ, "SLURM_RESTART_COUNT": "1"}  # Slurm's requeue: a new job attempt
    assert FaultPlan.from_env(rank=1, attempt=0, environ=requeued).faults == []
    first = {**environ, "SLURM_RESTART_COUNT": "0"}
    assert len(FaultPlan.from_env(rank=1, attempt=0, environ=first).faults) == 2
