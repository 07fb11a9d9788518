"""The stream seam: producers and consumers of keyed byte records on topics.

Two backends implement it: :mod:`streams.kafka_backend` (Apache Kafka through
kafka-python) and :mod:`streams.memory` (in-process, for unit tests of one
component). Records are bytes here; typing and validation happen in
:mod:`online_sao.schemas`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Literal


@dataclass(frozen=True, order=True)
class TopicPartition:
    topic: str
    partition: int


@dataclass(frozen=True)
class StreamMessage:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    timestamp_ms: int

    @property
    def tp(self) -> TopicPartition:
        return TopicPartition(self.topic, self.partition)


class StreamUnavailable(RuntimeError):
    """The backend cannot be reached now (the caller may spool and retry)."""


class TopicNotFound(StreamUnavailable):
    """A topic does not exist (yet): topics are created by ``kafka up`` or another
    service's ``ensure_topics``, so a long-running reader waits and retries."""


class TopicsMisconfigured(RuntimeError):
    """The topics cannot be created or used as configured (a replication factor above the cluster's
    broker count, interactions and rewards topics of unequal partition counts): a setting to change,
    not an outage to wait out, so nothing retries it."""


DeliveryReport = Callable[[BaseException | None], None]
"""Called once per record, from any thread: None when the broker acknowledged it, else the
error after which the producer will not retry it."""


class Producer(ABC):
    """Asynchronous, idempotent, ordered per key."""

    @abstractmethod
    def send(self, topic: str, value: bytes, key: bytes | None = None,
             on_delivery: DeliveryReport | None = None) -> None:
        """Queue one record; raises StreamUnavailable when it cannot be queued.

        ``on_delivery`` (optional) reports this record's outcome, so a caller can tell
        which records still need sending after an outage (serving's interaction log)."""

    @abstractmethod
    def flush(self, timeout_s: float | None = None) -> None:
        """Block until every queued record is acknowledged; StreamUnavailable on timeout."""

    @abstractmethod
    def close(self) -> None: ...


class Consumer(ABC):
    """Reads topics; offsets are committed explicitly (never automatically)."""

    @abstractmethod
    def poll(self, timeout_s: float = 1.0, max_records: int = 500) -> list[StreamMessage]: ...

    @abstractmethod
    def commit(self, offsets: dict[TopicPartition, int]) -> None:
        """Commit the next offset to read for each partition (consumer groups only)."""

    @abstractmethod
    def seek(self, tp: TopicPartition, offset: int) -> None: ...

    @abstractmethod
    def assignment(self) -> set[TopicPartition]: ...

    @abstractmethod
    def position(self, tp: TopicPartition) -> int:
        """The offset of the next record this consumer reads from assigned ``tp``: where it was put,
        else its group's committed offset, else where ``start`` puts a new consumer (a partition's
        records deleted since read from its oldest kept one)."""

    @abstractmethod
    def offsets_for_time(self, time_ms: int) -> dict[TopicPartition, int | None]:
        """For each assigned partition, the offset of its first record stamped at or after
        ``time_ms`` (None: no such record yet)."""

    @abstractmethod
    def end_offsets(self) -> dict[TopicPartition, int]:
        """For each assigned partition, the offset its next record will get."""

    @abstractmethod
    def beginning_offsets(self) -> dict[TopicPartition, int]:
        """For each assigned partition, the offset of its oldest record kept (retention deletes
        the ones before it); the end offset when it keeps none."""

    @abstractmethod
    def highwater(self) -> dict[TopicPartition, int | None]:
        """For each assigned partition, the offset its next record will get as the consumer last
        heard it from the broker (None: not heard yet). It asks the broker nothing, so it cannot
        block while the broker is away: a lag computed from it is as fresh as the last poll."""

    @abstractmethod
    def close(self) -> None: ...


StartFrom = Literal["earliest", "latest"]


class StreamBackend(ABC):
    """Makes producers and consumers and manages topics."""

    @abstractmethod
    def producer(self) -> Producer: ...

    @abstractmethod
    def consumer(self, topics: list[str], group_id: str | None = None,
                 start: StartFrom = "earliest", instance_id: str | None = None) -> Consumer:
        """Without a group the consumer is assigned every partition of the topics.

        ``instance_id`` (groups only) makes it a static member of its group: a consumer started
        with the id of one that died without closing takes its place and partitions at once,
        instead of after the dead member's session expired; two live consumers of one group
        must not share an id (the newer one replaces the older). Closing it leaves the group."""

    @abstractmethod
    def ensure_topics(self) -> None:
        """Create the service's topics (names, partitions, retention, compaction from config)."""

    @abstractmethod
    def list_topics(self) -> list[str]: ...
