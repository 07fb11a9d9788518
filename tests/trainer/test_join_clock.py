"""The join's clock limit while several partitions are read: trainer/join_clock.py."""

from __future__ import annotations

import math

from streams.base import TopicPartition
from trainer.join_clock import JoinClock

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
