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


class GroupMembershipLost(RuntimeError):
    """The consumer group dropped this member, so it refused a commit: the member did not poll for
    longer than the group's poll interval (Kafka's ``max.poll.interval.ms``), or the group was
    rebalancing. Not an outage: committing again fails until the consumer rejoins, which its next
    :meth:`Consumer.poll` does; rejoining puts each partition it gets back at the group's committed
    offset (see :meth:`Consumer.commit`). The message says the cause."""


class ConsumerFenced(RuntimeError):
    """A newer consumer joined the group with this static member's instance id and took its place
    (Kafka's FencedInstanceIdError): this one can no longer read or commit, for good. Not an outage
    and not retried: two live consumers of one group must not share an instance id."""


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
    def close(self) -> None:
        """Send what is queued, waiting a bounded time; records still unsent then are dropped (and
        said in the log), never raised about: closing during an outage must not fail its caller."""

    def abandon(self) -> None:
        """Close without waiting for what is queued, which is dropped (said in the log): for a caller
        that keeps those records elsewhere (serving's spool) and must stop now. By default
        :meth:`close`, for a producer that holds nothing unsent."""
        self.close()


class Consumer(ABC):
    """Reads topics; offsets are committed explicitly (never automatically).

    A member of a consumer group stays in it only while it polls: one that does not call
    :meth:`poll` for longer than the group's poll interval (Kafka's ``max.poll.interval.ms``, 300 s
    by default) is dropped, its partitions go to the other members, and its next commit raises
    :class:`GroupMembershipLost`. A reader that must stop reading for a while (backpressure) pauses
    its partitions (:meth:`pause`) and goes on polling.

    Once closed, a consumer holds no partitions (:meth:`assignment` is empty) and every other
    call raises RuntimeError; closing it again does nothing."""

    @abstractmethod
    def poll(self, timeout_s: float = 1.0, max_records: int = 500) -> list[StreamMessage]:
        """The records after each assigned, not paused, partition's position (up to
        ``max_records``), waiting up to ``timeout_s`` for one. A group member also keeps its
        membership here, and rejoins its group here after being dropped. Raises
        :class:`ConsumerFenced` once a newer consumer took this static member's place (see
        :meth:`StreamBackend.consumer`)."""

    @abstractmethod
    def commit(self, offsets: dict[TopicPartition, int]) -> None:
        """Commit the next offset to read for each partition (consumer groups only).

        Raises :class:`GroupMembershipLost` when the group dropped this member (see the class):
        nothing was committed. The next :meth:`poll` rejoins, and on rejoining every partition the
        member gets is put at the group's committed offset, which may be behind what it had read:
        a reader that keeps its own positions seeks back to them after that poll, then commits
        again. Raises :class:`ConsumerFenced` once a newer consumer took this static member's place
        (the offsets are the new member's now), and ValueError, committing nothing, for a partition
        its topic does not have (a checkpoint's offsets of a topic made again with fewer partitions:
        Kafka refuses them, and kafka-python retried that until it timed out, as if the broker were
        down)."""

    @abstractmethod
    def seek(self, tp: TopicPartition, offset: int) -> None:
        """Read assigned ``tp`` from ``offset`` on. An offset outside the partition's records (past
        its end, or below its oldest kept one) is reset when the consumer next reads it, as
        Kafka's ``auto.offset.reset`` does: to the oldest kept record with ``start="earliest"``,
        to the end with ``"latest"`` (until then Kafka's :meth:`position` gives the offset sought,
        the in-memory backend's the offset the read will start at)."""

    @abstractmethod
    def pause(self, tps: set[TopicPartition]) -> None:
        """Stop returning records of the assigned partitions ``tps`` from :meth:`poll` (their
        positions stay; ValueError for one not assigned) until :meth:`resume`: polling on keeps a
        group member in its group. A partition taken away by a rebalance (and one got again after
        a rejoin) comes back resumed, so a reader holding back pauses again before each poll."""

    @abstractmethod
    def resume(self, tps: set[TopicPartition]) -> None:
        """Return records of the assigned partitions ``tps`` from :meth:`poll` again."""

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
    def close(self) -> None:
        """Leave the group (a static member too) and let go of the connections."""


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
        must not share an id (the newer one replaces the older, whose :meth:`Consumer.poll` and
        :meth:`Consumer.commit` then raise :class:`ConsumerFenced`). Closing it leaves the group
        (closing the replaced one leaves the newer one in it)."""

    @abstractmethod
    def ensure_topics(self) -> None:
        """Create the service's topics (names, partitions, retention, compaction from config)."""

    @abstractmethod
    def list_topics(self) -> list[str]: ...
