"""After a crash: which spooled records the broker took already.

The spool's acknowledgement watermark is written after the broker acknowledges a
record, so a crash between the two leaves records on the topic that the spool
still holds as pending. Sending them again would put a second copy on the topic
for every consumer of it. Before the first replay of a restarted spool, the sender
reads back what its topics received since the oldest record that may have been
sent (:data:`TopicTail`) and treats every pending record whose exact bytes are
there as acknowledged.

Which records may have been sent: the sender hands the producer only records among
the first ``window`` pending ones, and the watermark only moves forward, so every
record the broker may hold without a watermark is among the first ``window``
pending records of the restarted spool, where ``window`` is the widest
``serving.log_window`` any process used since the spool was last empty (``spool.window``,
:meth:`serving.spool.Spool.readback_window`; every pending record when that file is missing).
The read starts at the oldest of their
creation times (every record carries ``created_at``; the producer stamps a record
when it sends it, with the same clock, so any copy on the topic is stamped later),
less :data:`READBACK_MARGIN_S`. A wall clock that stepped back between a record's creation and
its send stamps the copy earlier than that; :mod:`serving.spool_clock` writes such a step down and
the read back starts at it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable

from serving.spool_format import SpoolEntry
from streams.base import StreamMessage

TopicTail = Callable[[list[str], float], Iterable[StreamMessage]]
"""``(topics, since_s)`` -> every record of those topics stamped at or after ``since_s``
(seconds since the epoch), to the partitions' current end; StreamUnavailable when the
broker cannot be read. Consumed once, as it comes: only the candidates' digests are kept."""

READBACK_MARGIN_S = 60.0
"""Read this much earlier than the oldest candidate's creation time: a topic stamping
records with the broker's clock (LogAppendTime) may run a little behind serving's."""


def created_at(entry: SpoolEntry) -> float:
    """The creation time every record type carries (0: read the whole topic, for an entry whose
    bytes do not say)."""
    try:
        value = json.loads(entry.value).get("created_at")
    except (ValueError, AttributeError):
        return 0.0
    return float(value) if isinstance(value, (int, float)) else 0.0


def already_on_topic(candidates: list[SpoolEntry], tail: TopicTail, floor_s: float | None = None) -> set[int]:
    """Sequence numbers of the candidates whose exact bytes their topic already holds; ``floor_s``: the
    wall clock stepped back to this reading while they were pending (serving.spool_clock)."""
    if not candidates:
        return set()
    since = min([*map(created_at, candidates), *([floor_s] if floor_s is not None else [])]) - READBACK_MARGIN_S
    topics = sorted({entry.topic for entry in candidates})
    wanted: dict[tuple[str, bytes], list[int]] = {}
    for entry in candidates:
        wanted.setdefault((entry.topic, hashlib.sha256(entry.value).digest()), []).append(entry.seq)
    found: set[int] = set()
    for message in tail(topics, since):
        found.update(wanted.get((message.topic, hashlib.sha256(message.value).digest()), ()))
    return found
