"""How far the reward join's clock may move while several partitions are read at once.

The join (trainer/join.py) measures reward windows on record time: its clock is the newest record
time it was given. Reading a backlog, one partition's records come before another's (a poll
returns one partition's records before the next one's, and rewards are smaller than interactions),
so a clock moved by the partitions read first closes windows whose rewards are only unread yet (in a
2-hour backlog with every interaction rewarded 5 s after it, the feed dropped 910 of 2400).
:class:`JoinClock` holds the clock at the newest time read from the partition that is furthest
behind, over the partitions with records still to read. The learner's feed (trainer/feed.py) and
the history read for value pre-training (trainer/history.py) both hold it.
"""

from __future__ import annotations

import math

from streams.base import TopicPartition


class JoinClock:
    """The newest record time read per partition, and the clock limit they give."""

    def __init__(self) -> None:
        self.newest_read: dict[TopicPartition, float] = {}
        """Per partition, the newest record time read from it."""

    def read(self, tp: TopicPartition, ts: float) -> None:
        """A record of ``tp`` with time ``ts`` was read."""
        self.newest_read[tp] = max(ts, self.newest_read.get(tp, ts))

    def limit(self, left: dict[TopicPartition, int]) -> float | None:
        """How far the join's clock may move, given the records ``left`` to read per partition: the
        newest time read from the partition furthest behind among those with records left (-inf
        while one of them has not been read from at all: the clock waits for it); None when every
        partition is read to its end (the record's own time moves the clock, as with live traffic)."""
        behind = [self.newest_read.get(tp, -math.inf) for tp, count in left.items() if count > 0]
        return min(behind) if behind else None
