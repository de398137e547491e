"""The slow link between two simulated machines is real: data sent over it with sockets arrives at
the rate it was shaped to, in both directions, without loss at the queue, and a round trip takes at
least twice the one-way delay; the unshaped link is much faster."""

from __future__ import annotations

import pytest

from netns import measure_rtt, measure_transfer, queue_stats, two_nodes

pytestmark = pytest.mark.slow


def test_a_link_shaped_to_100_mbit_and_2_ms_carries_that():
    with two_nodes(mbit=100, delay_ms=2) as (a, b):
        for sender, receiver in ((a, b), (b, a)):
            seconds, mbit = measure_transfer(sender, receiver, 6_000_000)
            assert 70 <= mbit <= 130, (sender.namespace, seconds, mbit)
        rtt_ms = measure_rtt(a, b)
        counters = [queue_stats(node) for node in (a, b)]
    assert rtt_ms >= 2 * 2
    assert rtt_ms < 2 * 2 + 20  # the delay line adds some, not tens of milliseconds
    for counted in counters:  # the bucket made packets wait; it dropped (almost) none
        assert counted["bytes"] >= 6_000_000 and counted["overlimits"] > 0
        assert counted["drops"] <= counted["packets"] // 100, counted


def test_an_unshaped_link_is_much_faster():
    with two_nodes() as (a, b):
        _, mbit = measure_transfer(a, b, 60_000_000)
        rtt_ms = measure_rtt(a, b)
    assert mbit > 5 * 100
    assert rtt_ms < 2
