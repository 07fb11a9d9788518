"""The in-memory backend's producer and consumer (:mod:`streams.memory` holds the backend: topics,
groups and their shares, whose behaviour its docstring lists)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from streams.base import (Consumer, ConsumerFenced, DeliveryReport, GroupMembershipLost, Producer, StartFrom,
                          StreamMessage, TopicPartition)
from streams.memory_log import PartitionLog

if TYPE_CHECKING:
    from streams.memory import InMemoryBackend


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
        self._paused: set[TopicPartition] = set()
        self._closed = False
        self._fenced = False
        """Replaced by a newer consumer with the same instance id."""
        self._dropped = False
        """Dropped from its group for not polling within the backend's ``max_poll_interval_s``."""
        self._last_poll = time.monotonic()
        self._polling = False
        """In :meth:`poll` (waiting for records counts as polling, as in kafka-python)."""
        self._first_read = 0
        """Which readable partition a poll reads first: it moves on each poll, so a partition that always
        holds ``max_records`` waiting does not starve the others (Kafka's fetcher rotates as well)."""

    def _take(self, tps: list[TopicPartition] | set[TopicPartition]) -> None:
        """Own exactly ``tps``: keep positions (and pauses) of kept ones, initialise new ones."""
        committed = self._backend._groups[self.group_id].committed if self.group_id else {}
        positions = {}
        for tp in sorted(tps):
            if tp in self._positions:
                positions[tp] = self._positions[tp]
            elif tp in committed:
                positions[tp] = committed[tp]
            else:
                log = self._backend._partition_log(tp)
                positions[tp] = log.start if self._start == "earliest" else log.end
        self._positions = positions
        self._paused &= set(positions)

    def _lapsed(self) -> bool:
        """Whether the group dropped this member (it leaves the group the first time this is seen)."""
        interval = self._backend.max_poll_interval_s
        if (not self._dropped and self.group_id is not None and interval is not None and not self._closed
                and not self._polling and time.monotonic() - self._last_poll > interval):
            self._dropped = True
            self._backend._leave(self)
        return self._dropped

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("consumer is closed")

    def _check_not_fenced(self) -> None:
        if self._fenced:
            raise ConsumerFenced(f"consumer fenced: another consumer joined group {self.group_id!r} with instance id "
                                 f"{self.instance_id!r}")

    def _rebalance(self) -> None:
        self._check_open()
        if self._fenced:
            self._positions = {}
        elif self.group_id is not None and not self._lapsed():  # dropped: holds its old share until it rejoins
            share = self._backend._group_share(self)
            if share != set(self._positions):
                self._take(share)

    def _rejoin(self) -> None:
        """Back into the group after being dropped: every partition got starts at the group's committed
        offset (kafka-python forgets the positions of a lost membership), none paused. A static member
        whose instance id a newer consumer took meanwhile is fenced instead, as Kafka does."""
        members = self._backend._groups[self.group_id].members
        if self.instance_id is not None and any(m.instance_id == self.instance_id for m in members):
            self._fenced = True
            return
        self._dropped, self._positions, self._paused = False, {}, set()
        members.append(self)

    def _readable(self, tp: TopicPartition, log: PartitionLog) -> int:
        """Where a read of ``tp`` starts: its position, reset by ``start`` when outside the records."""
        pos = self._positions[tp]
        if log.start <= pos <= log.end:
            return pos
        return log.start if self._start == "earliest" else log.end

    def poll(self, timeout_s: float = 1.0, max_records: int = 500) -> list[StreamMessage]:
        self._check_open()
        deadline = time.monotonic() + timeout_s
        lock = self._backend._lock
        with lock:
            if self._lapsed():
                self._rejoin()
            self._check_not_fenced()
            self._polling = True
            try:
                return self._read(deadline, max_records)
            finally:
                self._polling, self._last_poll = False, time.monotonic()

    def _read(self, deadline: float, max_records: int) -> list[StreamMessage]:
        """Up to ``max_records`` records of the partitions not paused, waiting until ``deadline`` for one
        (the caller holds the backend's lock)."""
        while True:
            if self._closed:  # by another thread while this one waited
                return []
            self._rebalance()
            self._check_not_fenced()  # replaced while it waited: Kafka's poll raises after it returns too
            out: list[StreamMessage] = []
            readable = [tp for tp in self._positions if tp not in self._paused]
            if readable:
                first = self._first_read % len(readable)
                readable = readable[first:] + readable[:first]
            for tp in readable:
                log = self._backend._partition_log(tp)
                pos = self._readable(tp, log)
                batch = log.read(pos, max_records - len(out))
                out += batch
                self._positions[tp] = pos + len(batch)
                if len(out) >= max_records:
                    break
            remaining = deadline - time.monotonic()
            if out:
                self._first_read += 1
                return out
            if remaining <= 0:
                return out
            self._backend._lock.wait(remaining)

    def commit(self, offsets: dict[TopicPartition, int]) -> None:
        if self.group_id is None:
            raise ValueError("commit needs a consumer group (this consumer has no group_id)")
        self._check_open()
        self._check_not_fenced()  # Kafka refuses it too (FencedInstanceIdError): the new member owns the offsets now
        with self._backend._lock:
            missing = sorted(tp for tp in offsets if not self._backend._exists(tp))
            if missing:  # as Kafka refuses them (UNKNOWN_TOPIC_OR_PARTITION)
                raise ValueError(f"cannot commit offsets of partitions that do not exist: {missing}")
            if self._lapsed():
                raise GroupMembershipLost(f"group {self.group_id!r} refused the commit: this consumer did not poll "
                                          f"for {self._backend.max_poll_interval_s} s and was dropped from it; "
                                          f"its next poll rejoins")
            self._backend._groups[self.group_id].committed.update(offsets)
            if self._backend.drop_committed:
                for topic in {tp.topic for tp in offsets}:
                    self._backend._delete_committed(topic)

    def seek(self, tp: TopicPartition, offset: int) -> None:
        if offset < 0:
            raise ValueError("offset must be >= 0")
        with self._backend._lock:
            self._rebalance()
            self._assigned({tp})
            self._positions[tp] = offset

    def _assigned(self, tps: set[TopicPartition]) -> set[TopicPartition]:
        missing = sorted(set(tps) - set(self._positions))
        if missing:
            raise ValueError(f"not assigned to this consumer: {', '.join(map(str, missing))}")
        return set(tps)

    def pause(self, tps: set[TopicPartition]) -> None:
        with self._backend._lock:
            self._rebalance()
            self._paused |= self._assigned(tps)

    def resume(self, tps: set[TopicPartition]) -> None:
        with self._backend._lock:
            self._rebalance()
            self._paused -= self._assigned(tps)

    def assignment(self) -> set[TopicPartition]:
        with self._backend._lock:
            if self._closed:
                return set()
            self._rebalance()
            return set(self._positions)

    def position(self, tp: TopicPartition) -> int:
        with self._backend._lock:
            self._rebalance()
            self._assigned({tp})
            return self._readable(tp, self._backend._partition_log(tp))  # as poll reads it

    def offsets_for_time(self, time_ms: int) -> dict[TopicPartition, int | None]:
        if time_ms < 0:  # as kafka-python does
            raise ValueError(f"offsets_for_time: the target time cannot be negative ({time_ms})")
        with self._backend._lock:
            self._rebalance()
            logs = {tp: self._backend._partition_log(tp) for tp in self._positions}
            return {tp: next((m.offset for m in log.records if m.timestamp_ms >= time_ms), None)
                    for tp, log in logs.items()}

    def end_offsets(self) -> dict[TopicPartition, int]:
        with self._backend._lock:
            self._rebalance()
            return {tp: self._backend._partition_log(tp).end for tp in self._positions}

    def beginning_offsets(self) -> dict[TopicPartition, int]:
        with self._backend._lock:
            self._rebalance()
            return {tp: self._backend._partition_log(tp).start for tp in self._positions}

    def highwater(self) -> dict[TopicPartition, int | None]:
        return dict(self.end_offsets())  # nothing to fetch here: the log's end is known at once

    def close(self) -> None:
        with self._backend._lock:
            self._closed = True
            self._backend._leave(self)
            self._backend._lock.notify_all()
