"""The stream seam's consumer on kafka-python (built by :meth:`streams.kafka_backend.KafkaBackend.consumer`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import kafka.errors as kerr
from kafka import KafkaConsumer
from kafka.structs import OffsetAndMetadata
from kafka.structs import TopicPartition as KafkaTP

from streams.base import (Consumer, ConsumerFenced, GroupMembershipLost, StreamMessage, StreamUnavailable,
                          TopicPartition)
from streams.kafka_errors import MEMBERSHIP_ERRORS, as_stream_errors

log = logging.getLogger(__name__)


def _fenced_by_a_newer_member(consumer: KafkaConsumer) -> bool:
    """Whether a newer consumer with this static member's instance id took its place in the group.

    kafka-python 3.0 says it nowhere public: its heartbeat thread, answered FENCED_INSTANCE_ID, only stops
    heartbeating (the Java client fails the next poll), and the member goes on fetching its old partitions
    (group_metadata() still says stable). Fenced is the one state in which the coordinator is stable, needs
    no rejoin and does not heartbeat: a rejoin stops the heartbeat with a rejoin pending, and losing or
    leaving the group leaves the stable state. Private state, then; tests/streams/test_static_membership.py
    checks it on a real broker, so a kafka-python release that changes it fails there."""
    coordinator = consumer._coordinator
    if coordinator.group_instance_id is None:
        return False
    with coordinator._lock:
        return coordinator.stable() and not coordinator.need_rejoin() and not coordinator._heartbeat_enabled


class KafkaStreamConsumer(Consumer):
    def __init__(self, consumer: KafkaConsumer, group_id: str | None, bootstrap: str,
                 leave_group: Callable[[str], None] | None = None, client_timeout_s: float = 30.0) -> None:
        """``leave_group``: how a static member leaves its group on close (given the member id the group
        gave it); ``client_timeout_s``: how long a call that asks the broker (:meth:`position`, the offset
        look-ups) may wait for it."""
        self._client_timeout_s = client_timeout_s
        self._leave_group = leave_group
        self._consumer = consumer
        self._group_id = group_id
        self._bootstrap = bootstrap
        self._closed = False
        self._fenced = False
        """A newer consumer took this static member's place (seen once, for good)."""

    @property
    def _timeout_ms(self) -> int:
        return int(self._client_timeout_s * 1000)

    def _check_open(self) -> None:
        """As the in-memory backend: kafka-python answered a closed consumer with IllegalStateError,
        RuntimeError('NetworkSelector closed!') or its old assignment, call by call."""
        if self._closed:
            raise RuntimeError("consumer is closed")

    def _is_fenced(self) -> bool:
        self._fenced = self._fenced or _fenced_by_a_newer_member(self._consumer)
        return self._fenced

    def _fenced_error(self) -> ConsumerFenced:
        instance_id = self._consumer.group_metadata().group_instance_id
        return ConsumerFenced(f"consumer fenced: another consumer joined group {self._group_id!r} with instance id "
                              f"{instance_id!r}")

    def _check_not_fenced(self) -> None:
        """As the in-memory backend: kafka-python's fenced member went on polling its old partitions, and
        its commit raised FencedInstanceIdError."""
        if self._is_fenced():
            raise self._fenced_error()

    @contextmanager
    def _fencing(self) -> Iterator[None]:
        """FencedInstanceIdError from kafka-python (a commit, or a rejoin of the fenced member) as ConsumerFenced."""
        try:
            yield
        except kerr.FencedInstanceIdError as exc:
            self._fenced = True
            raise self._fenced_error() from exc

    def _assigned(self, tps: set[TopicPartition]) -> list[KafkaTP]:
        self._check_open()
        wanted = [KafkaTP(tp.topic, tp.partition) for tp in tps]
        assigned = set() if self._is_fenced() else self._consumer.assignment()
        missing = sorted(tp for tp in tps if KafkaTP(tp.topic, tp.partition) not in assigned)
        if missing:
            raise ValueError(f"not assigned to this consumer: {missing}")
        return wanted

    def poll(self, timeout_s: float = 1.0, max_records: int = 500) -> list[StreamMessage]:
        self._check_open()
        self._check_not_fenced()
        with self._fencing(), as_stream_errors("polling", self._bootstrap):
            batches = self._consumer.poll(timeout_ms=int(timeout_s * 1000), max_records=max_records)
        self._check_not_fenced()  # fenced while it polled: what it fetched is the new member's to read
        return [StreamMessage(topic=r.topic, partition=r.partition, offset=r.offset, key=r.key,
                              value=r.value, timestamp_ms=r.timestamp)
                for records in batches.values() for r in records]

    def commit(self, offsets: dict[TopicPartition, int]) -> None:
        if self._group_id is None:
            raise ValueError("commit needs a consumer group (this consumer has no group_id)")
        self._check_open()
        self._check_not_fenced()
        self._check_partitions_exist(set(offsets))
        try:
            with self._fencing(), as_stream_errors("committing offsets", self._bootstrap):
                self._consumer.commit({KafkaTP(tp.topic, tp.partition): OffsetAndMetadata(offset, "", -1)
                                       for tp, offset in offsets.items()})
        except MEMBERSHIP_ERRORS as exc:
            raise GroupMembershipLost(
                f"group {self._group_id!r} refused the commit: this consumer is not in it now (the group is "
                f"rebalancing, its coordinator moved to another broker, or it did not poll for "
                f"{self._consumer.config['max_poll_interval_ms'] / 1000:.0f} s, max.poll.interval.ms); "
                f"its next poll rejoins. {type(exc).__name__}: {exc}") from exc

    def _check_partitions_exist(self, tps: set[TopicPartition]) -> None:
        """ValueError for a partition its topic does not have: Kafka refuses its commit with
        UNKNOWN_TOPIC_OR_PARTITION, which kafka-python retries until its request timeout (30 s) and then
        reports as a timeout, as if the broker were down; the learner's feed waited that out for ever.
        The partitions of a topic the consumer reads come from the metadata it holds, without a request
        (another topic costs one metadata request)."""
        with as_stream_errors("looking up the topics' partitions", self._bootstrap):
            partitions = {topic: self._consumer.partitions_for_topic(topic) for topic in {tp.topic for tp in tps}}
        missing = sorted(tp for tp in tps if tp.partition not in partitions[tp.topic])
        if missing:
            raise ValueError(f"cannot commit offsets of partitions that do not exist: {missing}")

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self._check_open()
        self._consumer.seek(KafkaTP(tp.topic, tp.partition), offset)

    def pause(self, tps: set[TopicPartition]) -> None:
        self._consumer.pause(*self._assigned(tps))

    def resume(self, tps: set[TopicPartition]) -> None:
        self._consumer.resume(*self._assigned(tps))

    def assignment(self) -> set[TopicPartition]:
        if self._closed or self._is_fenced():  # a fenced member's partitions are the new member's
            return set()
        return {TopicPartition(tp.topic, tp.partition) for tp in self._consumer.assignment()}

    def position(self, tp: TopicPartition) -> int:
        [assigned] = self._assigned({tp})  # ValueError when not, as the in-memory backend says
        with as_stream_errors("looking up the consumer's position", self._bootstrap):
            # asks the group's coordinator for a committed offset, else resets by auto_offset_reset; bounded:
            # without a timeout it waited for a broker gone away for as long as it stayed away
            position = self._consumer.position(assigned, timeout_ms=self._timeout_ms)
        if position is None:
            raise StreamUnavailable(f"the position of {tp.topic}[{tp.partition}] is not known within "
                                    f"{self._client_timeout_s:.0f} s (broker {self._bootstrap})")
        return position

    def offsets_for_time(self, time_ms: int) -> dict[TopicPartition, int | None]:
        self._check_open()
        with as_stream_errors("looking up offsets by time", self._bootstrap):
            found = self._consumer.offsets_for_times({tp: time_ms for tp in self._consumer.assignment()},
                                                     timeout_ms=self._timeout_ms)
        return {TopicPartition(tp.topic, tp.partition): None if at is None else at.offset for tp, at in found.items()}

    def end_offsets(self) -> dict[TopicPartition, int]:
        self._check_open()
        with as_stream_errors("looking up end offsets", self._bootstrap):
            ends = self._consumer.end_offsets(list(self._consumer.assignment()), timeout_ms=self._timeout_ms)
        return {TopicPartition(tp.topic, tp.partition): offset for tp, offset in ends.items()}

    def beginning_offsets(self) -> dict[TopicPartition, int]:
        self._check_open()
        with as_stream_errors("looking up beginning offsets", self._bootstrap):
            starts = self._consumer.beginning_offsets(list(self._consumer.assignment()), timeout_ms=self._timeout_ms)
        return {TopicPartition(tp.topic, tp.partition): offset for tp, offset in starts.items()}

    def highwater(self) -> dict[TopicPartition, int | None]:
        # kafka-python keeps the high watermark of every fetch response it parses
        self._check_open()
        return {TopicPartition(tp.topic, tp.partition): self._consumer.highwater(tp)
                for tp in self._consumer.assignment()}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        member_id = self._consumer.group_metadata().member_id  # read before the close forgets it ("")
        self._consumer.close(autocommit=False)
        if self._leave_group is not None:
            try:
                self._leave_group(member_id)
            except (kerr.KafkaError, StreamUnavailable) as exc:  # closed anyway; only the hand-over waits
                log.warning("static member of group %s did not leave it (%s): its partitions wait for its "
                            "session to expire, or for a consumer with its instance id", self._group_id, exc)
