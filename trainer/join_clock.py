"""How far the reward join's clock may move while several partitions are read at once.

The join (trainer/join.py) measures reward windows on record time: its clock is the newest record
time it was given. Reading a backlog, one partition's records come before another's (a poll
returns one partition's records before the next one's, and rewards are smaller than interactions),
so a clock moved by the partitions read first closes windows whose rewards are only unread yet (in a
2-hour backlog with every interaction rewarded 5 s after it, the feed dropped 910 of 2400).
:class:`JoinClock` holds the clock at the newest time read from the partition that is furthest
behind, over the partitions with records still to read. The learner's feed (trainer/feed.py) and
the history read for value pre-training (trainer/history.py) both hold it.

A record stamped by a producer whose clock runs behind the others' (a serving replica minutes slow)
would otherwise enter the join minutes in the past: its reward window would close as soon as it
arrived, and its reward would be counted late. :meth:`JoinClock.floor` reads such a record as at
most :data:`MAX_RECORD_BEHIND_S` behind the newer of the join's clock and the newest record read
before it from its own partition, and at most half a reward window behind it where the window is
shorter than two minutes (:func:`max_behind_s`: a minute behind, a 20 s window would have closed).
That only ever moves a record's time later, toward when the broker took it: a partition's records
are appended in order, and the join's clock is never ahead of the records read (it is held back
while catching up), so neither was set by a record the broker took much after this one. A slow
producer that alone writes a partition is not corrected until the join's clock passes it. The
newest times per partition are not checkpointed: a restarted learner floors by the join's clock
alone until it has read from a partition again.

A record stamped by a producer whose clock runs ahead moves the join's clock ahead with it, closing
the windows of the records read before it. The feed reads such a record as at most
:func:`max_ahead_s` ahead of its host's clock: :data:`MAX_RECORD_AHEAD_S`, and at most half a reward
window where the window is shorter than two minutes (a minute ahead, every open 20 s window closed:
on-time rewards of the records read before counted late).
"""

from __future__ import annotations

import math

from streams.base import TopicPartition

MAX_RECORD_BEHIND_S = 60.0
"""How far behind the join's clock a record's timestamp may put it (module docstring). Records of
producers with good clocks arrive out of order by the time a record waits in a producer (its
retries, two minutes at most with kafka-python's defaults) and by a poll's partition order: a
minute leaves room for the common cases, and moving a later one forward only lengthens its window."""
MAX_WINDOW_SHARE_BEHIND = 0.5
"""The most of its reward window a record read as behind may have lost: it keeps at least half of it
for its reward (a window of 20 s left a record read a minute behind none: closed on arrival, its
reward late). Short of MAX_RECORD_BEHIND_S only for windows under two minutes."""


MAX_RECORD_AHEAD_S = 60.0
"""How far ahead of this host's clock a record's timestamp may put the join's clock. The join runs on
record time (trainer/join.py), and one record stamped 50 minutes ahead (a producer with a fast clock;
Kafka 4 accepts up to an hour ahead by default) closed every window and expired every held reward of
the next 50 minutes. Hosts kept by NTP agree to milliseconds; a minute leaves room for worse."""
MAX_WINDOW_SHARE_AHEAD = 0.5
"""The most of their reward windows a record read as ahead may take from the records read before it:
the join's clock moves ahead by its lead, so every open window loses that much, and one that had just
opened keeps at least half for its reward (a record read a minute ahead closed every open 20 s window:
the on-time rewards that followed counted late). Short of MAX_RECORD_AHEAD_S only for windows under
two minutes."""


def max_behind_s(window_s: float) -> float:
    """How far behind :meth:`JoinClock.floor` may read a record when reward windows last ``window_s``."""
    return min(MAX_RECORD_BEHIND_S, MAX_WINDOW_SHARE_BEHIND * window_s)


def max_ahead_s(window_s: float) -> float:
    """How far ahead of the reading host's clock a record may be read when reward windows last ``window_s``."""
    return min(MAX_RECORD_AHEAD_S, MAX_WINDOW_SHARE_AHEAD * window_s)


class JoinClock:
    """The newest record time read per partition, and the clock limit they give."""

    def __init__(self, max_behind_s: float = MAX_RECORD_BEHIND_S) -> None:
        self.max_behind_s = max_behind_s
        """How far behind :meth:`floor` may read a record (:func:`max_behind_s` of the reward window)."""
        self.newest_read: dict[TopicPartition, float] = {}
        """Per partition, the newest record time read from it."""

    def read(self, tp: TopicPartition, ts: float) -> None:
        """A record of ``tp`` with time ``ts`` was read."""
        self.newest_read[tp] = max(ts, self.newest_read.get(tp, ts))

    def floor(self, tp: TopicPartition, ts: float, watermark: float | None) -> float:
        """``ts`` of a record of ``tp`` read next, at most :attr:`max_behind_s` behind the newer of
        ``watermark`` (the join's clock; None: nothing read yet) and the newest time read from ``tp``
        (module docstring)."""
        newest = max((t for t in (watermark, self.newest_read.get(tp)) if t is not None), default=None)
        return ts if newest is None else max(ts, newest - self.max_behind_s)

    def limit(self, left: dict[TopicPartition, int]) -> float | None:
        """How far the join's clock may move, given the records ``left`` to read per partition: the
        newest time read from the partition furthest behind among those with records left (-inf
        while one of them has not been read from at all: the clock waits for it); None when every
        partition is read to its end (the record's own time moves the clock, as with live traffic)."""
        behind = [self.newest_read.get(tp, -math.inf) for tp, count in left.items() if count > 0]
        return min(behind) if behind else None
