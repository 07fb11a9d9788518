"""An in-memory broker with a retention, for long runs: a record is dropped once every consumer group
reading its topic has committed past it, so the broker's size stays flat while offsets keep counting.

Kafka deletes old log segments by time or size whoever has read them; here what every reader committed
is what may go, so a run never loses a record the learner has not taken (benchmarks/bench_learner_memory.py).
"""

from __future__ import annotations

from streams.base import StreamMessage, TopicPartition
from streams.memory import InMemoryBackend, InMemoryConsumer

KEEP_UNREAD = 16
"""Records kept per partition of a topic no consumer group reads (weights, dead letters): a retention."""


class TrimmedLog:
    """A partition's records from offset ``base`` on; offsets stay absolute (Kafka's log start)."""

    def __init__(self) -> None:
        self.base = 0
        self.items: list[StreamMessage] = []

    def __len__(self) -> int:  # the end offset: InMemoryBackend numbers a new record len(log)
        return self.base + len(self.items)

    def append(self, message: StreamMessage) -> None:
        self.items.append(message)

    def __iter__(self):  # the records held (offsets_for_time scans them)
        return iter(self.items)

    def __getitem__(self, index):
        if isinstance(index, slice):
            start = max((index.start or 0) - self.base, 0)
            stop = None if index.stop is None else max(index.stop - self.base, 0)
            return self.items[start:stop]
        return self.items[index - self.base]

    def trim(self, upto: int) -> None:
        """Drop every record below offset ``upto``."""
        n = min(upto - self.base, len(self.items))
        if n > 0:
            del self.items[:n]
            self.base += n


class TrimmingBackend(InMemoryBackend):
    """The in-memory broker with a retention: below the lowest offset committed by the groups that read
    a topic its records are gone; of a topic no group reads it keeps the last :data:`KEEP_UNREAD`."""

    def create_topic(self, name: str, partitions: int) -> None:
        super().create_topic(name, partitions)
        with self._lock:  # a new topic's empty lists become TrimmedLogs; an existing topic keeps its logs
            self._logs[name] = [log if isinstance(log, TrimmedLog) else TrimmedLog() for log in self._logs[name]]

    def consumer(self, topics, group_id=None, start="earliest", instance_id=None) -> InMemoryConsumer:
        consumer = super().consumer(topics, group_id, start, instance_id)
        consumer.__class__ = TrimmingConsumer  # the same state; the base backend builds its own class
        return consumer

    def _append(self, topic: str, value: bytes, key: bytes | None) -> None:
        super()._append(topic, value, key)
        with self._lock:
            if not self._readers(topic):
                for log in self._logs[topic]:
                    log.trim(len(log) - KEEP_UNREAD)

    def _readers(self, topic: str) -> list:
        return [g for g in self._groups.values() if any(topic in m.topics for m in g.members)]

    def trim(self) -> None:
        """Drop every record below the lowest offset committed by the groups reading its topic."""
        with self._lock:
            for topic, parts in self._logs.items():
                groups = self._readers(topic)
                for p, log in enumerate(parts):
                    tp = TopicPartition(topic, p)
                    if groups and all(tp in g.committed for g in groups):
                        log.trim(min(g.committed[tp] for g in groups))

    def log_start(self, tp: TopicPartition) -> int:
        return self._partition_log(tp).base

    def records_held(self) -> int:
        with self._lock:
            return sum(len(log.items) for parts in self._logs.values() for log in parts)


class TrimmingConsumer(InMemoryConsumer):
    """A consumer of :class:`TrimmingBackend`: a position below the log start moves to it (Kafka's
    ``auto.offset.reset=earliest``), and a commit lets the broker trim."""

    def poll(self, timeout_s: float = 1.0, max_records: int = 500) -> list[StreamMessage]:
        with self._backend._lock:
            if not self._closed and not self._fenced:
                self._rebalance()
                for tp, pos in self._positions.items():
                    self._positions[tp] = max(pos, self._backend.log_start(tp))
        return super().poll(timeout_s, max_records)

    def commit(self, offsets: dict[TopicPartition, int]) -> None:
        super().commit(offsets)
        self._backend.trim()

    def beginning_offsets(self) -> dict[TopicPartition, int]:
        with self._backend._lock:
            self._rebalance()
            return {tp: self._backend.log_start(tp) for tp in self._positions}
