"""The stream seam in process memory, with Kafka's semantics, for unit tests of one component.

Same behaviour as :mod:`streams.kafka_backend` where tests can observe it:

* a keyed record goes to partition ``murmur2(key) % partitions`` (kafka-python's and the
  Java client's default partitioner, so keys land on the same partition numbers as on a
  real broker); unkeyed records go round-robin;
* offsets count from 0 per partition and are never reused;
* a consumer with a ``group_id`` shares the topics' partitions with the other open
  members of its group and starts each partition at the group's committed offset
  (else at ``start``); without a group it is assigned every partition;
* a consumer with an ``instance_id`` (a static member) replaces the member of its group
  with the same id, which can no longer poll (Kafka fences it);
* ``start="latest"`` means the end of each partition when the consumer gets it;
* sending to a topic that does not exist raises StreamUnavailable (Kafka, with topic
  auto-creation off, times out waiting for its metadata).

Thread-safe: components under test may produce and consume from different threads.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field

from kafka.partitioner.default import murmur2

from online_sao.config import KafkaConfig
from streams.base import (Consumer, DeliveryReport, Producer, StartFrom, StreamBackend,
                          StreamMessage, StreamUnavailable, TopicNotFound, TopicPartition)


def partition_for_key(key: bytes, partitions: int) -> int:
    """Kafka's default partition of a key: positive murmur2 modulo the partition count."""
    return (murmur2(key) & 0x7FFFFFFF) % partitions


@dataclass
class _Group:
    members: list["InMemoryConsumer"] = field(default_factory=list)
    committed: dict[TopicPartition, int] = field(default_factory=dict)


class InMemoryBackend(StreamBackend):
    """``cfg`` names the topics and partition counts ensure_topics creates."""

    def __init__(self, cfg: KafkaConfig | None = None) -> None:
        self.cfg = cfg or KafkaConfig()
        self._logs: dict[str, list[list[StreamMessage]]] = {}
        self._groups: dict[str, _Group] = {}
        self._round_robin = itertools.count()
        self._lock = threading.Condition()

    # -- topics ---------------------------------------------------------------------------

    def create_topic(self, name: str, partitions: int) -> None:
        """Create a topic; an existing one is left as it is (like TopicAlreadyExists)."""
        if partitions < 1:
            raise ValueError("a topic needs at least one partition")
        with self._lock:
            self._logs.setdefault(name, [[] for _ in range(partitions)])

    def ensure_topics(self) -> None:
        t = self.cfg.topics
        for name, partitions in ((t.interactions, self.cfg.partitions), (t.rewards, self.cfg.partitions),
                                 (t.weights, 1), (t.dead_letters, 1)):
            self.create_topic(name, partitions)

    def list_topics(self) -> list[str]:
        with self._lock:
            return sorted(self._logs)

    def describe_topics(self) -> dict[str, int]:
        with self._lock:
            return {name: len(parts) for name, parts in self._logs.items()}

    def end_offset(self, tp: TopicPartition) -> int:
        with self._lock:
            return len(self._partition_log(tp))

    # -- clients --------------------------------------------------------------------------

    def producer(self) -> "InMemoryProducer":
        return InMemoryProducer(self)

    def consumer(self, topics: list[str], group_id: str | None = None,
                 start: StartFrom = "earliest", instance_id: str | None = None) -> "InMemoryConsumer":
        if instance_id is not None and group_id is None:
            raise ValueError("instance_id needs a consumer group (group_id)")
        with self._lock:
            for topic in topics:
                if group_id is None and topic not in self._logs:
                    raise TopicNotFound(f"topic {topic!r} does not exist")
            consumer = InMemoryConsumer(self, list(topics), group_id, start, instance_id)
            if group_id is not None:
                members = self._groups.setdefault(group_id, _Group()).members
                for old in [m for m in members if instance_id is not None and m.instance_id == instance_id]:
                    old._fenced = True
                    members[members.index(old)] = consumer  # its place, so every share stays where it was
                if consumer not in members:
                    members.append(consumer)
            else:
                consumer._take(self._all_partitions(topics))
            return consumer

    # -- internals (callers hold self._lock) ---------------------------------------------

    def _append(self, topic: str, value: bytes, key: bytes | None) -> None:
        with self._lock:
            parts = self._logs.get(topic)
            if parts is None:
                raise StreamUnavailable(f"topic {topic!r} does not exist (topics are not auto-created)")
            if key is None:
                p = next(self._round_robin) % len(parts)
            else:
                p = partition_for_key(key, len(parts))
            log = parts[p]
            log.append(StreamMessage(topic=topic, partition=p, offset=len(log), key=key, value=value,
                                     timestamp_ms=int(time.time() * 1000)))
            self._lock.notify_all()

    def _partition_log(self, tp: TopicPartition) -> list[StreamMessage]:
        try:
            return self._logs[tp.topic][tp.partition]
        except (KeyError, IndexError):
            raise ValueError(f"{tp} does not exist") from None

    def _all_partitions(self, topics: list[str]) -> list[TopicPartition]:
        return [TopicPartition(t, p) for t in topics if t in self._logs for p in range(len(self._logs[t]))]

    def _group_share(self, consumer: "InMemoryConsumer") -> set[TopicPartition]:
        """The partitions this member owns: all partitions dealt round-robin over the members."""
        group = self._groups[consumer.group_id]
        members = group.members
        index = members.index(consumer)
        topics = sorted({t for m in members for t in m.topics})
        return {tp for i, tp in enumerate(self._all_partitions(topics))
                if i % len(members) == index and tp.topic in consumer.topics}

    def _leave(self, consumer: "InMemoryConsumer") -> None:
        if consumer.group_id is not None:
            members = self._groups[consumer.group_id].members
            if consumer in members:
                members.remove(consumer)


class InMemoryProducer(Producer):
    def __init__(self, backend: InMemoryBackend) -> None:
        self._backend = backend
        self._closed = False

    def send(self, topic: str, value: bytes, key: bytes | None = None,
             on_delivery: DeliveryReport | None = None) -> None:
        if self._closed:
            raise RuntimeError("producer is closed")
        self._backend._append(topic, value, key)
        if on_delivery is not None:
            on_delivery(None)  # stored on send: acknowledged at once

    def flush(self, timeout_s: float | None = None) -> None:
        """Records are stored on send; nothing is pending."""

    def close(self) -> None:
        self._closed = True


class InMemoryConsumer(Consumer):
    def __init__(self, backend: InMemoryBackend, topics: list[str], group_id: str | None,
                 start: StartFrom, instance_id: str | None = None) -> None:
        self._backend = backend
        self.topics = topics
        self.group_id = group_id
        self.instance_id = instance_id
        self._start = start
        self._positions: dict[TopicPartition, int] = {}
        self._closed = False
        self._fenced = False
        """Replaced by a newer consumer with the same instance id."""

    def _take(self, tps: list[TopicPartition] | set[TopicPartition]) -> None:
        """Own exactly ``tps``: keep positions of kept ones, initialise new ones."""
        committed = self._backend._groups[self.group_id].committed if self.group_id else {}
        positions = {}
        for tp in sorted(tps):
            if tp in self._positions:
                positions[tp] = self._positions[tp]
            elif tp in committed:
                positions[tp] = committed[tp]
            else:
                positions[tp] = 0 if self._start == "earliest" else len(self._backend._partition_log(tp))
        self._positions = positions

    def _rebalance(self) -> None:
        if self._fenced:
            self._positions = {}
        elif self.group_id is not None:
            share = self._backend._group_share(self)
            if share != set(self._positions):
                self._take(share)

    def poll(self, timeout_s: float = 1.0, max_records: int = 500) -> list[StreamMessage]:
        if self._closed:
            raise RuntimeError("consumer is closed")
        if self._fenced:
            raise RuntimeError(f"consumer fenced: another consumer joined with instance id {self.instance_id!r}")
        deadline = time.monotonic() + timeout_s
        lock = self._backend._lock
        with lock:
            while True:
                self._rebalance()
                out: list[StreamMessage] = []
                for tp, pos in self._positions.items():
                    log = self._backend._partition_log(tp)
                    batch = log[pos:pos + max_records - len(out)]
                    out += batch
                    self._positions[tp] = pos + len(batch)
                    if len(out) >= max_records:
                        break
                remaining = deadline - time.monotonic()
                if out or remaining <= 0:
                    return out
                lock.wait(remaining)

    def commit(self, offsets: dict[TopicPartition, int]) -> None:
        if self.group_id is None:
            raise ValueError("commit needs a consumer group (this consumer has no group_id)")
        with self._backend._lock:
            self._backend._groups[self.group_id].committed.update(offsets)

    def seek(self, tp: TopicPartition, offset: int) -> None:
        if offset < 0:
            raise ValueError("offset must be >= 0")
        with self._backend._lock:
            self._rebalance()
            if tp not in self._positions:
                raise ValueError(f"{tp} is not assigned to this consumer")
            self._positions[tp] = offset

    def assignment(self) -> set[TopicPartition]:
        with self._backend._lock:
            self._rebalance()
            return set(self._positions)

    def offsets_for_time(self, time_ms: int) -> dict[TopicPartition, int | None]:
        with self._backend._lock:
            self._rebalance()
            logs = {tp: self._backend._partition_log(tp) for tp in self._positions}
            return {tp: next((m.offset for m in log if m.timestamp_ms >= time_ms), None) for tp, log in logs.items()}

    def end_offsets(self) -> dict[TopicPartition, int]:
        with self._backend._lock:
            self._rebalance()
            return {tp: len(self._backend._partition_log(tp)) for tp in self._positions}

    def beginning_offsets(self) -> dict[TopicPartition, int]:
        with self._backend._lock:
            self._rebalance()
            return {tp: 0 for tp in self._positions}  # nothing is ever deleted here

    def highwater(self) -> dict[TopicPartition, int | None]:
        return dict(self.end_offsets())  # nothing to fetch here: the log's end is known at once

    def close(self) -> None:
        with self._backend._lock:
            self._closed = True
            self._backend._leave(self)
            self._backend._lock.notify_all()
