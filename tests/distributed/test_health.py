"""The health check's cadence (fault/health.py) on a one-rank gloo group: adaptive where the
ranks meet every step anyway, the reporting interval where they do not (async)."""

from __future__ import annotations

from shardwise.training.fault.health import RankHealth


def health(*, adaptive: bool) -> RankHealth:
    checks = RankHealth(
        straggler_factor=0, straggler_windows=3, every=16, interval_s=2.0, adaptive=adaptive
    )
    checks.add(own=0.01, step=0.05)  # 50 ms steps: 40 of them in 2 s
    return checks


def test_the_cadence_follows_the_step_time_where_ranks_meet_every_step(one_rank):
    checks = health(adaptive=True)
    checks.check()
    assert checks.every == 40
    assert not checks.due(16) and checks.due(40)


def test_under_async_the_check_stays_at_the_reporting_interval(one_rank):
    """A collective every couple of seconds would make async workers wait for each other."""
    checks = health(adaptive=False)
    checks.check()
    assert checks.every == 16
    assert checks.due(16) and checks.due(32) and not checks.due(40)
