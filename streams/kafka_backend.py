"""The stream seam on Apache Kafka, through kafka-python.

Topics (names from ``KafkaConfig.topics``), created by :meth:`KafkaBackend.ensure_topics`:

* interactions, rewards: ``KafkaConfig.partitions`` partitions each, ``retention.ms``
  from config. Both are keyed by interaction id and the producer's default
  partitioner (murmur2 of the key modulo the partition count, the same as the Java
  client's) places equal keys on equal partition numbers when the counts are
  equal, so an interaction and its rewards are co-partitioned and one consumer of
  partition p of both topics sees both.
* weights: one partition, ``cleanup.policy=compact`` (the newest notice per key is kept).
* dead letters: one partition, ``retention.ms`` from config.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import kafka.errors as kerr
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer
from kafka.admin import MemberToRemove
from kafka.structs import OffsetAndMetadata
from kafka.structs import TopicPartition as KafkaTP

from online_sao.config import KafkaConfig
from streams.base import (Consumer, ConsumerFenced, DeliveryReport, GroupMembershipLost, Producer, StartFrom,
                          StreamBackend, TopicNotFound, StreamMessage, StreamUnavailable, TopicPartition,
                          TopicsMisconfigured)

log = logging.getLogger(__name__)

PRODUCER_LINGER_MS = 5
"""Small batching window: a record waits at most 5 ms for others before it is sent."""
MAX_IN_FLIGHT = 5
"""kafka-python keeps ordering under retries for an idempotent producer only up to 5."""
TOPIC_CREATE_TIMEOUT_MS = 30_000
MAX_POLL_INTERVAL_MS = 300_000
"""A group member that does not poll for this long is dropped from its group (kafka-python's and Kafka's
default, named here because the learner depends on it: its feed polls with its partitions paused under
backpressure, and rejoins after a step or checkpoint longer than this; tests shorten it)."""
FORCE_CLOSE_JOIN_S = 5.0
"""How long a producer's close waits for its network thread to stop once told to drop what it holds (it
stops within one network poll; bounded so a close never hangs)."""


MEMBERSHIP_ERRORS = (kerr.CommitFailedError, kerr.RebalanceInProgressError, kerr.UnknownMemberIdError,
                     kerr.IllegalGenerationError)
"""kafka-python errors of a commit the group refused because this member is not in it (now): it rejoins
at its next poll (kafka-python turns the last two into CommitFailedError; all four are named to be sure)."""

GONE_ALREADY = (kerr.UnknownMemberIdError, kerr.FencedInstanceIdError)
"""Answers to removing a static member that is not in its group (any more), or whose instance id a newer
consumer holds now: nothing to remove."""

UNAVAILABLE_ERRORS = (kerr.KafkaTimeoutError, kerr.KafkaConnectionError, kerr.NodeNotReadyError,
                      kerr.RequestTimedOutError, kerr.BrokerNotAvailableError, kerr.MetadataEmptyBrokerList)
"""kafka-python errors that mean "the cluster cannot be reached now" rather than "this
request is wrong" (kafka-python 3 reports a failed bootstrap as KafkaTimeoutError)."""


def _unavailable(exc: Exception) -> bool:
    return isinstance(exc, UNAVAILABLE_ERRORS)


@contextmanager
def _mapped(action: str, bootstrap: str) -> Iterator[None]:
    try:
        yield
    except kerr.KafkaError as exc:
        if _unavailable(exc):
            raise StreamUnavailable(f"{action}: Kafka at {bootstrap} not reachable: {exc}") from exc
        raise


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


NETWORK_CLIENT = KafkaConsumer.DEFAULT_CONFIG["kafka_client"]
"""The network client kafka-python's consumers and admin clients build by default."""


@contextmanager
def _building(options: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """``options`` for a consumer or admin client, with a ``kafka_client`` hook that keeps the network
    clients it builds, closed if the construction raises.

    A consumer or admin client whose bootstrap fails (no broker reachable) raises from its
    constructor with its client's network thread still running (kafka-python 3.0.12: one thread and
    one selector per failed attempt). Serving's weights follower, which retries every few seconds
    while the broker is down, would gather them for as long as the outage lasts.
    """
    built: list[Any] = []

    def build(**configs: Any) -> Any:
        built.append(NETWORK_CLIENT(**configs))
        return built[-1]

    try:
        yield {**options, "kafka_client": build}
    except BaseException:
        for client in built:
            client.close()
        raise


class KafkaBackend(StreamBackend):
    def __init__(self, cfg: KafkaConfig) -> None:
        self.cfg = cfg

    def client_options(self) -> dict[str, Any]:
        """Connection and security settings shared by producers, consumers and admin clients."""
        c = self.cfg
        options: dict[str, Any] = {
            "bootstrap_servers": c.bootstrap.split(","),
            "security_protocol": c.security_protocol,
            "bootstrap_timeout_ms": int(c.client_timeout_s * 1000),
        }
        if c.sasl_mechanism is not None:
            options["sasl_mechanism"] = c.sasl_mechanism
        if c.sasl_username is not None:
            options["sasl_plain_username"] = c.sasl_username
        if c.sasl_password is not None:
            options["sasl_plain_password"] = c.sasl_password.get_secret_value()
        if c.ssl_cafile is not None:
            options["ssl_cafile"] = str(c.ssl_cafile)
        return options

    def producer(self) -> "KafkaStreamProducer":
        with _mapped("creating a producer", self.cfg.bootstrap):
            p = KafkaProducer(
                **self.client_options(),
                enable_idempotence=True,
                acks="all",
                linger_ms=PRODUCER_LINGER_MS,
                max_in_flight_requests_per_connection=MAX_IN_FLIGHT,
                # retries stay at kafka-python's default (unbounded within delivery_timeout_ms),
                # which idempotence requires; the broker drops duplicates of a retried batch.
                max_block_ms=int(self.cfg.client_timeout_s * 1000),
            )
        return KafkaStreamProducer(p, self.cfg.bootstrap, close_timeout_s=self.cfg.client_timeout_s)

    def consumer(self, topics: list[str], group_id: str | None = None,
                 start: StartFrom = "earliest", instance_id: str | None = None) -> "KafkaStreamConsumer":
        if instance_id is not None and group_id is None:
            raise ValueError("instance_id needs a consumer group (group_id)")
        with _mapped("creating a consumer", self.cfg.bootstrap), \
                _building(self.client_options()) as options:
            c = KafkaConsumer(**options, group_id=group_id, group_instance_id=instance_id,
                              enable_auto_commit=False, auto_offset_reset=start, allow_auto_create_topics=False,
                              max_poll_interval_ms=MAX_POLL_INTERVAL_MS)
            if group_id is not None:
                c.subscribe(topics)
            else:
                tps = []
                for topic in topics:
                    partitions = c.partitions_for_topic(topic)
                    if not partitions:
                        c.close(autocommit=False)
                        raise TopicNotFound(f"topic {topic!r} does not exist at {self.cfg.bootstrap}")
                    tps += [KafkaTP(topic, p) for p in sorted(partitions)]
                c.assign(tps)
                if start == "earliest":
                    c.seek_to_beginning(*tps)
                else:
                    c.seek_to_end(*tps)
                for tp in tps:  # resolve the lazy seek now, so "latest" means "at creation"
                    c.position(tp)
        leave = ((lambda member_id: self.remove_static_member(group_id, instance_id, member_id))
                 if instance_id is not None else None)
        return KafkaStreamConsumer(c, group_id, self.cfg.bootstrap, leave_group=leave,
                                   client_timeout_s=self.cfg.client_timeout_s)

    def remove_static_member(self, group_id: str, instance_id: str, member_id: str | None = None) -> None:
        """Take the static member ``instance_id`` out of ``group_id`` now (a static member does not
        leave on close by itself: the group would keep its partitions until its session expired).

        ``member_id``: the id the group gave the consumer leaving. The broker then removes the member
        only while it is still the one holding ``instance_id``: a consumer replaced by a newer one
        with its instance id took the newer one out of the group when it closed (by instance id alone,
        which None or "", a consumer that never joined, still means)."""
        member = MemberToRemove(member_id=member_id or None, group_instance_id=instance_id, reason="consumer closed")
        with self.admin() as admin:
            outcome = admin.remove_group_members(group_id, [member])
        for error in outcome.values():
            if error not in (kerr.NoError, *GONE_ALREADY):
                raise error(f"removing static member {instance_id!r} from group {group_id!r}")

    @contextmanager
    def admin(self) -> Iterator[KafkaAdminClient]:
        with _mapped("connecting an admin client", self.cfg.bootstrap), \
                _building(self.client_options()) as options:
            client = KafkaAdminClient(**options, request_timeout_ms=int(self.cfg.client_timeout_s * 1000))
        try:
            with _mapped("admin request", self.cfg.bootstrap):
                yield client
        finally:
            client.close()

    def topic_specs(self) -> dict[str, dict[str, Any]]:
        """What ensure_topics creates: name -> partitions, replication and topic configs."""
        c = self.cfg
        rf = c.replication_factor
        # acks=all waits for the in-sync replicas only, and Kafka's default minimum of them is 1: with
        # replicas, a write the leader alone held could be acknowledged (and serving's spool then
        # drops it) and lost with that broker. Two whenever there is a second replica.
        insync = {"min.insync.replicas": str(min(2, rf))}
        retained = {"cleanup.policy": "delete", "retention.ms": str(c.retention_ms), **insync}
        return {
            c.topics.interactions: {"num_partitions": c.partitions, "replication_factor": rf, "configs": retained},
            c.topics.rewards: {"num_partitions": c.partitions, "replication_factor": rf, "configs": retained},
            c.topics.weights: {"num_partitions": 1, "replication_factor": rf,
                               "configs": {"cleanup.policy": "compact", **insync}},
            c.topics.dead_letters: {"num_partitions": 1, "replication_factor": rf, "configs": retained},
        }

    def ensure_topics(self) -> None:
        specs = self.topic_specs()
        with self.admin() as admin:
            result = admin.create_topics(specs, timeout_ms=TOPIC_CREATE_TIMEOUT_MS, raise_errors=False)
            for topic in result["topics"]:
                error = kerr.for_code(topic["error_code"])
                if error is not kerr.NoError and error is not kerr.TopicAlreadyExistsError:
                    raise TopicsMisconfigured(f"creating topic {topic['name']!r} failed: {error.__name__}: "
                                              f"{topic.get('error_message')}")
            admin.wait_for_topics(list(specs), timeout_ms=TOPIC_CREATE_TIMEOUT_MS)
        counts = self.describe_topics()
        t = self.cfg.topics
        if counts[t.interactions] != counts[t.rewards]:
            raise TopicsMisconfigured(f"topics {t.interactions!r} ({counts[t.interactions]} partitions) and "
                                      f"{t.rewards!r} ({counts[t.rewards]}) must have the same partition count "
                                      f"to stay co-partitioned by interaction id")

    def describe_topics(self) -> dict[str, int]:
        """Partition count of every non-internal topic."""
        with self.admin() as admin:
            topics = admin.describe_topics()
        return {t["name"]: len(t["partitions"]) for t in topics if not t.get("is_internal")}

    def list_topics(self) -> list[str]:
        with self.admin() as admin:
            return sorted(name for name in admin.list_topics() if not name.startswith("__"))


class KafkaStreamProducer(Producer):
    def __init__(self, producer: KafkaProducer, bootstrap: str, close_timeout_s: float) -> None:
        self._producer = producer
        self._bootstrap = bootstrap
        self._close_timeout_s = close_timeout_s
        self._failures: list[Exception] = []
        self._unsettled = 0
        """Records queued and neither acknowledged nor failed yet: what a forced close drops."""
        self._failures_lock = threading.Lock()  # callbacks run on kafka-python's I/O thread

    def send(self, topic: str, value: bytes, key: bytes | None = None,
             on_delivery: DeliveryReport | None = None) -> None:
        with _mapped(f"sending to {topic}", self._bootstrap):
            future = self._producer.send(topic, value=value, key=key)
        with self._failures_lock:
            self._unsettled += 1
        future.add_both(self._settled)
        future.add_errback(self._record_failure)
        if on_delivery is not None:
            future.add_callback(lambda _metadata: on_delivery(None))
            future.add_errback(on_delivery)

    def _settled(self, _outcome: object) -> None:
        with self._failures_lock:
            self._unsettled -= 1

    def _record_failure(self, exc: Exception) -> None:
        with self._failures_lock:
            self._failures.append(exc)

    def flush(self, timeout_s: float | None = None) -> None:
        """Raises StreamUnavailable when the cluster did not take every record in time."""
        with _mapped("flushing the producer", self._bootstrap):
            self._producer.flush(timeout=timeout_s)
        with self._failures_lock:
            failures, self._failures = self._failures, []
        if not failures:
            return
        first = failures[0]
        summary = f"{len(failures)} record(s) were not acknowledged; first error: {first}"
        if all(isinstance(f, kerr.KafkaError) and (f.retriable or _unavailable(f)) for f in failures):
            raise StreamUnavailable(summary) from first
        raise RuntimeError(summary) from first

    def close(self) -> None:
        """Sends what is queued, waiting about client_timeout_s; records still unsent then are dropped
        (their delivery reports say so) and counted in the log. Never raises a Kafka error: a service
        stopping during an outage must stop, not fail here.

        kafka-python's close flushes first, with the same timeout, and a flush that times out raises
        before the network thread is told to stop (even with timeout 0): the producer stayed open, its
        thread running, and its KafkaTimeoutError escaped. Its thread is then stopped here."""
        try:
            self._producer.close(timeout=self._close_timeout_s)
            return
        except kerr.KafkaError as exc:
            failure = exc
        with self._failures_lock:
            unsent = self._unsettled
        log.warning("closing the producer (Kafka at %s): %d record(s) not acknowledged within %.0f s are "
                    "dropped (%s)", self._bootstrap, unsent, self._close_timeout_s, failure)
        self._force_close()

    def _force_close(self) -> None:
        """Stop the network thread without sending (it fails the batches it holds, waking their
        futures), then let kafka-python's close finish, which now has nothing to wait for."""
        sender = self._producer._sender  # no public way: close() raises before reaching it
        sender.force_close()
        sender.join(FORCE_CLOSE_JOIN_S)
        try:
            self._producer.close(timeout=0)
        except kerr.KafkaError as exc:  # its thread did not stop in time; nothing more to do
            log.warning("the producer's network thread (Kafka at %s) did not stop within %.0f s: %s",
                        self._bootstrap, FORCE_CLOSE_JOIN_S, exc)


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
        with self._fencing(), _mapped("polling", self._bootstrap):
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
            with self._fencing(), _mapped("committing offsets", self._bootstrap):
                self._consumer.commit({KafkaTP(tp.topic, tp.partition): OffsetAndMetadata(offset, "", -1)
                                       for tp, offset in offsets.items()})
        except MEMBERSHIP_ERRORS as exc:
            raise GroupMembershipLost(
                f"group {self._group_id!r} refused the commit: this consumer is not in it now (it did not poll "
                f"for {MAX_POLL_INTERVAL_MS / 1000:.0f} s, max.poll.interval.ms, or the group is rebalancing); "
                f"its next poll rejoins. {type(exc).__name__}: {exc}") from exc

    def _check_partitions_exist(self, tps: set[TopicPartition]) -> None:
        """ValueError for a partition its topic does not have: Kafka refuses its commit with
        UNKNOWN_TOPIC_OR_PARTITION, which kafka-python retries until its request timeout (30 s) and then
        reports as a timeout, as if the broker were down; the learner's feed waited that out for ever.
        The partitions of a topic the consumer reads come from the metadata it holds, without a request
        (another topic costs one metadata request)."""
        with _mapped("looking up the topics' partitions", self._bootstrap):
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
        with _mapped("looking up the consumer's position", self._bootstrap):
            # asks the group's coordinator for a committed offset, else resets by auto_offset_reset; bounded:
            # without a timeout it waited for a broker gone away for as long as it stayed away
            position = self._consumer.position(assigned, timeout_ms=self._timeout_ms)
        if position is None:
            raise StreamUnavailable(f"the position of {tp.topic}[{tp.partition}] is not known within "
                                    f"{self._client_timeout_s:.0f} s (broker {self._bootstrap})")
        return position

    def offsets_for_time(self, time_ms: int) -> dict[TopicPartition, int | None]:
        self._check_open()
        with _mapped("looking up offsets by time", self._bootstrap):
            found = self._consumer.offsets_for_times({tp: time_ms for tp in self._consumer.assignment()},
                                                     timeout_ms=self._timeout_ms)
        return {TopicPartition(tp.topic, tp.partition): None if at is None else at.offset for tp, at in found.items()}

    def end_offsets(self) -> dict[TopicPartition, int]:
        self._check_open()
        with _mapped("looking up end offsets", self._bootstrap):
            ends = self._consumer.end_offsets(list(self._consumer.assignment()), timeout_ms=self._timeout_ms)
        return {TopicPartition(tp.topic, tp.partition): offset for tp, offset in ends.items()}

    def beginning_offsets(self) -> dict[TopicPartition, int]:
        self._check_open()
        with _mapped("looking up beginning offsets", self._bootstrap):
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

