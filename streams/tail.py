"""Reading back what a topic received since a moment: the records of a time range, to their end.

Serving uses it after a crash to find which of its spooled records the broker took before the
crash (their acknowledgement watermark was not written yet), so it does not send them again.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from streams.base import StreamBackend, StreamMessage, StreamUnavailable

TAIL_POLL_S = 0.5
"""Wait of one poll while reading the range."""


def records_since(backend: StreamBackend, topics: list[str], since_ms: int, timeout_s: float) -> list[StreamMessage]:
    """:func:`iter_records_since`, as a list."""
    return list(iter_records_since(backend, topics, since_ms, timeout_s))


def iter_records_since(backend: StreamBackend, topics: list[str], since_ms: int,
                       timeout_s: float) -> Iterator[StreamMessage]:
    """Every record of ``topics`` stamped at or after ``since_ms``, up to the end each partition
    had when the call began, one poll at a time (a range of millions of records is never held).
    StreamUnavailable when the broker cannot be reached or no record of the range arrives for
    ``timeout_s``: a long range that is being read is read to its end (a limit on the whole read
    would fail a range too long for it on every try, for good)."""
    consumer = backend.consumer(topics, group_id=None, start="latest")
    try:
        ends = consumer.end_offsets()
        # before the epoch means from the start: Kafka refuses a negative time (ValueError, which killed
        # serving's logger thread for a spool entry whose bytes give no creation time: since -60 s)
        starts = consumer.offsets_for_time(max(0, since_ms))
        remaining: dict = {}
        for tp, end in ends.items():
            start = starts.get(tp)
            if start is not None and start < end:
                consumer.seek(tp, start)
                remaining[tp] = end
        read = 0
        deadline = time.monotonic() + timeout_s
        while remaining:
            if time.monotonic() > deadline:
                raise StreamUnavailable(f"reading back {sorted(t.topic for t in remaining)}: no record of the range "
                                        f"for {timeout_s:g} s ({read} read)")
            for msg in consumer.poll(timeout_s=TAIL_POLL_S):
                end = remaining.get(msg.tp)
                if end is None or msg.offset >= end:
                    continue
                read += 1
                yield msg
                deadline = time.monotonic() + timeout_s  # progress
                if msg.offset + 1 >= end:
                    del remaining[msg.tp]
    finally:
        consumer.close()
