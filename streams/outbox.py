"""Records that must reach the broker before their source is acknowledged: sent again until they are.

A producer's ``flush`` raises once for records the broker refused (kafka-python drops a record
whose delivery timed out) and forgets them; whoever flushes next sees nothing wrong. The learner's
dead letters must be on their topic before it commits the offsets past the records they replace
(docs/RELIABILITY.md: every refused record becomes exactly one dead letter), so the feed sends them
through an :class:`Outbox`: it keeps every record until the broker acknowledged it, and its
``flush`` sends the refused ones again and raises :class:`~streams.base.StreamUnavailable` until
none is left. A record acknowledged twice after a resend is the at-least-once price.
"""

from __future__ import annotations

import itertools
import threading

from streams.base import DeliveryReport, Producer, StreamUnavailable


class Outbox(Producer):
    """Sends through ``producer`` (not owned: ``close`` leaves it open) and keeps each record
    until its delivery report says the broker has it."""

    def __init__(self, producer: Producer) -> None:
        self._producer = producer
        self._ids = itertools.count()
        self._unacknowledged: dict[int, tuple[str, bytes, bytes | None]] = {}
        self._refused: set[int] = set()
        self._lock = threading.Lock()  # delivery reports arrive on the client's I/O thread

    @property
    def unacknowledged(self) -> int:
        with self._lock:
            return len(self._unacknowledged)

    def send(self, topic: str, value: bytes, key: bytes | None = None,
             on_delivery: DeliveryReport | None = None) -> None:
        if on_delivery is not None:
            raise ValueError("an Outbox reports deliveries through flush(), not per record")
        record_id = next(self._ids)
        with self._lock:
            self._unacknowledged[record_id] = (topic, value, key)
        self._send(record_id, topic, value, key)

    def _send(self, record_id: int, topic: str, value: bytes, key: bytes | None) -> None:
        """Hand the record to the producer; one it cannot take now (no metadata or a full buffer while
        the broker is away: StreamUnavailable) counts as refused and goes out again at the next flush.
        Raised, it escaped the learner's poll, and the record kept in the outbox was never sent again,
        so every later flush failed, the broker back or not."""
        try:
            self._producer.send(topic, value, key=key, on_delivery=lambda error: self._report(record_id, error))
        except StreamUnavailable:
            with self._lock:
                self._refused.add(record_id)

    def _report(self, record_id: int, error: BaseException | None) -> None:
        with self._lock:
            if error is None:
                self._unacknowledged.pop(record_id, None)
                self._refused.discard(record_id)
            elif record_id in self._unacknowledged:
                self._refused.add(record_id)

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait for the producer, send again what the broker refused, and raise StreamUnavailable
        while any record is still unacknowledged (call it again once the broker is back)."""
        try:
            self._producer.flush(timeout_s)
        except StreamUnavailable:
            pass  # which records failed is known per record: the refused ones go out again below
        with self._lock:
            again = [(record_id, self._unacknowledged[record_id]) for record_id in sorted(self._refused)]
            self._refused.clear()
        for record_id, (topic, value, key) in again:
            self._send(record_id, topic, value, key)
        left = self.unacknowledged
        if left:
            raise StreamUnavailable(f"{left} record(s) not acknowledged yet ({len(again)} sent again)")

    def close(self) -> None:
        """Nothing of its own to close: the producer belongs to the caller."""
