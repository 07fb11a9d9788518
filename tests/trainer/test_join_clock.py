"""The join's clock limit while several partitions are read: trainer/join_clock.py."""

from __future__ import annotations

import math

from streams.base import TopicPartition
from trainer.join_clock import MAX_RECORD_BEHIND_S, JoinClock, max_ahead_s, max_behind_s

A, B = TopicPartition("interactions", 0), TopicPartition("rewards", 0)


def test_the_clock_waits_for_a_partition_with_records_left_and_none_read():
    clock = JoinClock()
    clock.read(A, 100.0)
    assert clock.limit({A: 3, B: 2}) == -math.inf


def test_the_clock_is_held_at_the_newest_time_of_the_partition_furthest_behind():
    clock = JoinClock()
    for tp, ts in [(A, 100.0), (A, 250.0), (B, 120.0), (B, 110.0)]:  # B's second record is older
        clock.read(tp, ts)
    assert clock.limit({A: 5, B: 1}) == 120.0
    assert clock.limit({A: 5, B: 0}) == 250.0  # B read to its end: only A holds it


def test_the_clock_is_free_once_every_partition_is_read_to_its_end():
    clock = JoinClock()
    clock.read(A, 100.0)
    assert clock.limit({A: 0, B: 0}) is None
    assert clock.limit({}) is None


def test_a_record_is_read_at_most_a_minute_behind_its_partition_or_the_joins_clock():
    assert MAX_RECORD_BEHIND_S == 60.0  # the literals below
    clock = JoinClock()
    assert clock.floor(A, 100.0, None) == 100.0  # nothing read: as stamped
    clock.read(A, 250.0)
    assert clock.floor(A, 100.0, 120.0) == 190.0  # its partition's newest, 250, less a minute
    assert clock.floor(A, 200.0, 120.0) == 200.0  # 50 s behind: as stamped
    assert clock.floor(A, 100.0, 400.0) == 340.0  # the join's clock, 400, less a minute
    assert clock.floor(B, 100.0, 120.0) == 100.0  # B read nothing; 20 s behind the clock


def test_with_a_short_reward_window_a_record_is_read_at_most_half_a_window_behind():
    """A minute behind, a record's 20 s window had closed before it was read."""
    assert (max_behind_s(300.0), max_behind_s(120.0), max_behind_s(20.0)) == (60.0, 60.0, 10.0)
    clock = JoinClock(max_behind_s(20.0))
    clock.read(A, 250.0)
    assert clock.floor(A, 100.0, None) == 240.0  # its partition's newest, 250, less 10 s
    assert clock.floor(A, 245.0, None) == 245.0  # 5 s behind: as stamped


def test_with_a_short_reward_window_a_record_is_read_at_most_half_a_window_ahead():
    """A minute ahead, a record closed every open 20 s window: the on-time rewards after it were late."""
    assert (max_ahead_s(300.0), max_ahead_s(120.0), max_ahead_s(20.0)) == (60.0, 60.0, 10.0)
