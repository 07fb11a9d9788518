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

The producer and the consumer are in :mod:`streams.kafka_producer` and :mod:`streams.kafka_consumer`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import kafka.errors as kerr
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer
from kafka.admin import ConfigResource, ConfigResourceType, MemberToRemove
from kafka.structs import TopicPartition as KafkaTP

from online_sao.config import KafkaConfig
from streams.base import StartFrom, StreamBackend, TopicNotFound, TopicsMisconfigured
from streams.kafka_consumer import KafkaStreamConsumer
from streams.kafka_errors import as_stream_errors
from streams.kafka_producer import KafkaStreamProducer

log = logging.getLogger(__name__)

PRODUCER_LINGER_MS = 5
"""Small batching window: a record waits at most 5 ms for others before it is sent."""
MAX_IN_FLIGHT = 5
"""kafka-python keeps ordering under retries for an idempotent producer only up to 5."""
TOPIC_CREATE_TIMEOUT_MS = 30_000
MIN_INSYNC = "min.insync.replicas"
"""The topic setting that makes ``acks=all`` wait for a second replica (:meth:`KafkaBackend.topic_specs`)."""
MAX_POLL_INTERVAL_MS = 300_000
"""A group member that does not poll for this long is dropped from its group (kafka-python's and Kafka's
default, named here because the learner depends on it: its feed polls with its partitions paused under
backpressure, and rejoins after a step or checkpoint longer than this; tests shorten it)."""
WEIGHTS_SEGMENT_MS = 3600 * 1000
"""The weights topic rolls a segment every hour. Compaction never touches the open segment, and at Kafka's
default (7 days) a serving start replayed every notice of up to a week (at a publish a second, about
600,000); now the open segment holds at most an hour of notices, and the rolled ones are compacted to the
newest per key once the log cleaner gets to them (Kafka's default: when half the log is uncompacted)."""

GONE_ALREADY = (kerr.UnknownMemberIdError, kerr.FencedInstanceIdError)
"""Answers to removing a static member that is not in its group (any more), or whose instance id a newer
consumer holds now: nothing to remove."""

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

    def producer(self) -> KafkaStreamProducer:
        with as_stream_errors("creating a producer", self.cfg.bootstrap):
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
                 start: StartFrom = "earliest", instance_id: str | None = None) -> KafkaStreamConsumer:
        if instance_id is not None and group_id is None:
            raise ValueError("instance_id needs a consumer group (group_id)")
        with as_stream_errors("creating a consumer", self.cfg.bootstrap), \
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
        with as_stream_errors("connecting an admin client", self.cfg.bootstrap), \
                _building(self.client_options()) as options:
            client = KafkaAdminClient(**options, request_timeout_ms=int(self.cfg.client_timeout_s * 1000))
        try:
            with as_stream_errors("admin request", self.cfg.bootstrap):
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
        insync = {MIN_INSYNC: str(min(2, rf))}
        retained = {"cleanup.policy": "delete", "retention.ms": str(c.retention_ms), **insync}
        return {
            c.topics.interactions: {"num_partitions": c.partitions, "replication_factor": rf, "configs": retained},
            c.topics.rewards: {"num_partitions": c.partitions, "replication_factor": rf, "configs": retained},
            c.topics.weights: {"num_partitions": 1, "replication_factor": rf,
                               "configs": {"cleanup.policy": "compact", "segment.ms": str(WEIGHTS_SEGMENT_MS),
                                           **insync}},
            c.topics.dead_letters: {"num_partitions": 1, "replication_factor": rf, "configs": retained},
        }

    def ensure_topics(self) -> list[str]:
        """Create the missing topics; an existing one keeps its partition count (Kafka never changes
        it by itself). Returns the warnings, each logged, for topics whose count is not the
        configured one (:func:`partition_count_warnings`)."""
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
        warnings = partition_count_warnings(specs, counts, (t.interactions, t.rewards))
        try:
            warnings += replication_warnings(specs, self.replication(list(specs)))
        except kerr.KafkaError as exc:  # a cluster that refuses to describe its topics' configs: advisory only
            warnings.append(f"the topics' replication was not checked ({type(exc).__name__}: {exc})")
        for warning in warnings:
            log.warning("%s", warning)
        return warnings

    def delete_topics(self, names: list[str]) -> dict[str, str]:
        """Delete ``names`` (a topic already gone counts as deleted). Returns, for each topic the
        cluster refused to delete, why (the Kafka error's name and message)."""
        with self.admin() as admin:
            result = admin.delete_topics(names, timeout_ms=TOPIC_CREATE_TIMEOUT_MS, raise_errors=False)
        refused = {}
        for topic in result["topics"]:
            error = kerr.for_code(topic["error_code"])
            if error not in (kerr.NoError, kerr.UnknownTopicOrPartitionError):
                refused[topic["name"]] = f"{error.__name__}: {topic.get('error_message') or ''}".rstrip(": ")
        return refused

    def delete_group(self, group_id: str) -> str | None:
        """Delete the consumer group ``group_id`` and its committed offsets (a group already gone counts
        as deleted); why the cluster refused otherwise (a group with live members is not deleted)."""
        with self.admin() as admin:
            outcome = admin.delete_groups([group_id])  # group id -> "OK" or the error's name
        answer = outcome.get(group_id, "OK")
        return None if answer in ("OK", kerr.GroupIdNotFoundError.__name__) else answer

    def describe_topics(self) -> dict[str, int]:
        """Partition count of every non-internal topic."""
        with self.admin() as admin:
            topics = admin.describe_topics()
        return {t["name"]: len(t["partitions"]) for t in topics if not t.get("is_internal")}

    def replication(self, names: list[str]) -> dict[str, tuple[int, int | None]]:
        """Per topic of ``names`` that exists: the fewest replicas any of its partitions has, and its
        ``min.insync.replicas`` (None when the cluster did not say)."""
        with self.admin() as admin:
            topics = {t["name"]: t for t in admin.describe_topics(names) if t["error_code"] == 0}
            configs = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, name, {MIN_INSYNC: None})
                                              for name in topics], config_filter="all") if topics else {}
        by_topic = configs.get("topic", {})
        insync = {name: by_topic.get(name, {}).get(MIN_INSYNC, {}).get("value") for name in topics}
        return {name: (min(len(p["replica_nodes"]) for p in t["partitions"]),
                       int(insync[name]) if insync[name] is not None else None)
                for name, t in topics.items() if t["partitions"]}

    def list_topics(self) -> list[str]:
        with self.admin() as admin:
            return sorted(name for name in admin.list_topics() if not name.startswith("__"))


def partition_count_warnings(specs: dict[str, dict[str, Any]], counts: dict[str, int],
                             co_partitioned: tuple[str, str]) -> list[str]:
    """One line per topic of ``specs`` whose partition count in ``counts`` is not the one it would be
    created with: a changed ``kafka.partitions`` does not change the count of topics that exist, and
    ``kafka up`` said "topics ready" over them. ``co_partitioned`` (interactions, rewards) are sized by
    ``kafka.partitions``; the other topics have one partition, which their readers' order relies on."""
    warnings = []
    for topic, spec in specs.items():
        wanted, held = spec["num_partitions"], counts.get(topic)
        if held is None or held == wanted:
            continue
        if topic not in co_partitioned:
            warnings.append(f"topic {topic!r} has {held} partitions, not 1: records of different keys lose their "
                            f"order across them (weights notices: a hold, a champion, a publish); recreate it "
                            f"with one partition")
            continue
        pair = " and ".join(repr(t) for t in co_partitioned)
        if held > wanted:
            warnings.append(f"topic {topic!r} has {held} partitions, more than kafka.partitions = {wanted}: Kafka "
                            f"cannot lower a count and the clients use the topic's {held}; set kafka.partitions "
                            f"to {held}")
            continue
        warnings.append(f"topic {topic!r} keeps its {held} partitions, not kafka.partitions = {wanted}: an "
                        f"existing topic's count is not changed. Set kafka.partitions back to {held}, or raise "
                        f"{pair} together (kafka-topics.sh --alter --partitions {wanted}) knowing that a key "
                        f"then maps to another partition: records written before stay on the old one, so an "
                        f"interaction and its later reward can sit apart, and erasure by key must look in "
                        f"every partition")
    return warnings


def replication_warnings(specs: dict[str, dict[str, Any]], held: dict[str, tuple[int, int | None]]) -> list[str]:
    """One line per topic of ``specs`` that exists (``held``: fewest replicas of a partition, its
    ``min.insync.replicas``) with fewer replicas, or a lower minimum, than it would be created with:
    Kafka changes neither on an existing topic, and ``kafka up`` said "topics ready" over topics made
    with one replica before ``kafka.replication_factor`` was raised, whose broker's loss loses them."""
    warnings = []
    for topic, spec in specs.items():
        if topic not in held:
            continue
        replicas, insync = held[topic]
        wanted_replicas, wanted_insync = spec["replication_factor"], int(spec["configs"][MIN_INSYNC])
        if replicas < wanted_replicas:
            warnings.append(f"topic {topic!r} has {replicas} replica(s) of some partition, not "
                            f"kafka.replication_factor = {wanted_replicas}: an existing topic's replication is not "
                            f"changed; add replicas with kafka-reassign-partitions.sh (docs/DEPLOY.md)")
        if insync is not None and insync < wanted_insync:
            warnings.append(f"topic {topic!r} has min.insync.replicas = {insync}, not {wanted_insync}: a write only "
                            f"the leader holds is acknowledged and lost with that broker; kafka-configs.sh "
                            f"--bootstrap-server HOST:PORT --alter "
                            f"--entity-type topics --entity-name {topic} --add-config {MIN_INSYNC}={wanted_insync}")
    return warnings
