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
  with the same id, whose poll and commit then raise ConsumerFenced (Kafka fences it);
* committing an offset of a partition that does not exist raises ValueError;
* ``start="latest"`` means the end of each partition when the consumer gets it;
* sending to a topic that does not exist raises StreamUnavailable (Kafka, with topic
  auto-creation off, times out waiting for its metadata);
* with ``drop_committed`` records are deleted from the front of a partition (Kafka's log start
  moves on);
* a position outside a partition's records (below its log start, or past its end after a seek) is
  reset when read, by ``start`` (Kafka's ``auto.offset.reset``): the log start for "earliest", the
  end for "latest";
* a poll reads the partitions in turn, starting one further each poll that returned records;
* a paused partition returns no records; with ``max_poll_interval_s`` a group member that did not
  poll for that long is dropped from its group: its commit raises GroupMembershipLost, and its next
  poll rejoins, every partition it gets put at the group's committed offset (kafka-python's reset
  after a lost membership);
* a closed consumer holds no partitions and refuses every other call (RuntimeError).

Thread-safe: components under test may produce and consume from different threads.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field

from online_sao.config import KafkaConfig
from streams.base import (StartFrom, StreamBackend, StreamMessage, StreamUnavailable, TopicNotFound, TopicPartition,
                          TopicsMisconfigured)
from streams.memory_clients import InMemoryConsumer, InMemoryProducer
from streams.memory_log import PartitionLog, partition_for_key

KEEP_UNREAD = 16
"""Records ``drop_committed`` keeps per partition of a topic no consumer group reads (weight notices,
dead letters; a topic before its first group's first member or commit): nobody commits there, so this
count is its retention."""


@dataclass
class _Group:
    members: list["InMemoryConsumer"] = field(default_factory=list)
    committed: dict[TopicPartition, int] = field(default_factory=dict)


class InMemoryBackend(StreamBackend):
    """``cfg`` names the topics and partition counts ensure_topics creates.

    ``drop_committed`` gives the broker a retention for long runs: a record is deleted once every
    consumer group reading its topic has committed past it, and a topic no group reads keeps its
    last :data:`KEEP_UNREAD` records, so the broker's size stays flat while offsets keep counting
    (benchmarks/bench_learner_memory.py). Kafka deletes by time or size whoever has read a record;
    deleting what every reader committed is the retention that never loses a record a reader still
    needs, so a test of a long run measures the reader, not the broker. A group reads a topic while
    it has an open member subscribed to it or committed offsets on it: a learner restarting resumes
    at its committed offsets, and until 2026-12-06 the records past them were cut to the last
    :data:`KEEP_UNREAD` while no member was open. Before a group's first member (or commit) the
    topic counts as unread, so traffic logged before the first reader starts keeps its last
    :data:`KEEP_UNREAD` records only. Off (the default), nothing is ever deleted, as on a Kafka
    topic within its retention.

    ``max_poll_interval_s`` (None: never) drops a group member that did not poll for that long, as
    Kafka's ``max.poll.interval.ms`` does (see the module docstring).
    """

    def __init__(self, cfg: KafkaConfig | None = None, *, drop_committed: bool = False,
                 max_poll_interval_s: float | None = None) -> None:
        self.cfg = cfg or KafkaConfig()
        self.drop_committed = drop_committed
        self.max_poll_interval_s = max_poll_interval_s
        self._logs: dict[str, list[PartitionLog]] = {}
        self._groups: dict[str, _Group] = {}
        self._round_robin = itertools.count()
        self._lock = threading.Condition()

    # -- topics ---------------------------------------------------------------------------

    def create_topic(self, name: str, partitions: int) -> None:
        """Create a topic; an existing one is left as it is (like TopicAlreadyExists)."""
        if partitions < 1:
            raise ValueError("a topic needs at least one partition")
        with self._lock:
            self._logs.setdefault(name, [PartitionLog() for _ in range(partitions)])

    def ensure_topics(self) -> None:
        t = self.cfg.topics
        for name, partitions in ((t.interactions, self.cfg.partitions), (t.rewards, self.cfg.partitions),
                                 (t.weights, 1), (t.dead_letters, 1)):
            self.create_topic(name, partitions)
        counts = self.describe_topics()
        if counts[t.interactions] != counts[t.rewards]:  # one made with another kafka.partitions: as Kafka refuses
            raise TopicsMisconfigured(f"topics {t.interactions!r} ({counts[t.interactions]} partitions) and "
                                      f"{t.rewards!r} ({counts[t.rewards]}) must have the same partition count "
                                      f"to stay co-partitioned by interaction id")

    def list_topics(self) -> list[str]:
        with self._lock:
            return sorted(self._logs)

    def describe_topics(self) -> dict[str, int]:
        with self._lock:
            return {name: len(parts) for name, parts in self._logs.items()}

    def end_offset(self, tp: TopicPartition) -> int:
        with self._lock:
            return self._partition_log(tp).end

    def log_start(self, tp: TopicPartition) -> int:
        """The lowest offset still held (0 unless ``drop_committed`` deleted records)."""
        with self._lock:
            return self._partition_log(tp).start

    def records_held(self) -> int:
        """Records held over every topic: what ``drop_committed`` keeps flat."""
        with self._lock:
            return sum(len(log.records) for parts in self._logs.values() for log in parts)

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
                    members[members.index(old)] = consumer  # in its place: the same id, the same share
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
            log.records.append(StreamMessage(topic=topic, partition=p, offset=log.end, key=key, value=value,
                                             timestamp_ms=int(time.time() * 1000)))
            if self.drop_committed and not self._readers(topic):
                log.delete_below(log.end - KEEP_UNREAD)
            self._lock.notify_all()

    def _readers(self, topic: str) -> list[_Group]:
        """The consumer groups reading ``topic``: an open member subscribed to it, or offsets committed
        on it (a group whose members are all closed resumes there)."""
        return [g for g in self._groups.values()
                if any(topic in m.topics for m in g.members) or any(tp.topic == topic for tp in g.committed)]

    def _delete_committed(self, topic: str) -> None:
        """Delete the records of ``topic`` below the lowest offset its reading groups committed."""
        groups = self._readers(topic)
        for p, log in enumerate(self._logs.get(topic, [])):
            tp = TopicPartition(topic, p)
            if groups and all(tp in g.committed for g in groups):
                log.delete_below(min(g.committed[tp] for g in groups))

    def _partition_log(self, tp: TopicPartition) -> PartitionLog:
        try:
            return self._logs[tp.topic][tp.partition]
        except (KeyError, IndexError):
            raise ValueError(f"{tp} does not exist") from None

    def _exists(self, tp: TopicPartition) -> bool:
        return 0 <= tp.partition < len(self._logs.get(tp.topic, []))

    def _all_partitions(self, topics: list[str]) -> list[TopicPartition]:
        return [TopicPartition(t, p) for t in topics if t in self._logs for p in range(len(self._logs[t]))]

    def _group_share(self, consumer: "InMemoryConsumer") -> set[TopicPartition]:
        """The partitions this member owns: per topic, contiguous ranges over the members subscribed to
        it in :func:`_range_order` (Kafka's default range assignor), so partition p of the interactions
        and of the rewards topic go to one member, as the join's co-partitioning needs. Dealt round-robin
        over all topics' partitions together, they went to different members."""
        members = self._groups[consumer.group_id].members
        for member in list(members):
            if member is not consumer:  # it checked itself just before: a second look could drop it mid-rebalance
                member._lapsed()  # one dropped for not polling leaves the group now
        share: set[TopicPartition] = set()
        for topic in consumer.topics:
            if topic not in self._logs:
                continue
            subscribed = _range_order([m for m in members if topic in m.topics])
            index = subscribed.index(consumer)
            per, extra = divmod(len(self._logs[topic]), len(subscribed))
            start = index * per + min(index, extra)
            share |= {TopicPartition(topic, p) for p in range(start, start + per + (index < extra))}
        return share

    def _leave(self, consumer: "InMemoryConsumer") -> None:
        if consumer.group_id is not None:
            members = self._groups[consumer.group_id].members
            if consumer in members:
                members.remove(consumer)


def _range_order(members: list["InMemoryConsumer"]) -> list["InMemoryConsumer"]:
    """The order kafka-python's RangePartitionAssignor deals partitions in: static members by instance
    id (a restarted one gets the share its id always had), then dynamic ones. Kafka sorts those by member
    id, which the broker makes up at each join; join order stands in for it here."""
    static = sorted((m for m in members if m.instance_id is not None), key=lambda m: m.instance_id)
    return static + [m for m in members if m.instance_id is None]
