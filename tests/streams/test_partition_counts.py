"""Topics that exist with another partition count than configured: ``kafka up`` said "topics ready"
and exited 0 over a raised ``kafka.partitions``, the topics keeping their old count, silently."""

from __future__ import annotations

import io

from online_sao.config import load_config
from streams import broker_cli
from streams import kafka_backend
from streams.kafka_backend import KafkaBackend


def _specs(partitions: int):
    cfg = load_config(environ={}, overrides={"kafka.partitions": partitions})
    return cfg, KafkaBackend(cfg.kafka).topic_specs()


def test_a_raised_partition_count_over_existing_topics_is_named_with_what_raising_it_costs():
    cfg, specs = _specs(4)
    t = cfg.kafka.topics
    pair = (t.interactions, t.rewards)
    counts = {t.interactions: 2, t.rewards: 2, t.weights: 1, t.dead_letters: 1}
    warnings = kafka_backend.partition_count_warnings(specs, counts, pair)
    assert len(warnings) == 2
    assert f"topic {t.interactions!r} keeps its 2 partitions, not kafka.partitions = 4" in warnings[0]
    assert "Set kafka.partitions back to 2" in warnings[0] and "--partitions 4" in warnings[0]
    assert f"{t.interactions!r} and {t.rewards!r} together" in warnings[0] and "erasure by key must look" in warnings[0]
    assert kafka_backend.partition_count_warnings(specs, {**counts, t.interactions: 4, t.rewards: 4}, pair) == []
    lowered = kafka_backend.partition_count_warnings(specs, {**counts, t.interactions: 8, t.rewards: 8}, pair)
    assert len(lowered) == 2 and "Kafka cannot lower a count" in lowered[0]
    assert "set kafka.partitions to 8" in lowered[0]


def test_a_single_partition_topic_with_more_is_told_to_be_recreated_not_blamed_on_kafka_partitions():
    cfg, specs = _specs(2)
    t = cfg.kafka.topics
    counts = {t.interactions: 2, t.rewards: 2, t.weights: 3, t.dead_letters: 1}
    [warning] = kafka_backend.partition_count_warnings(specs, counts, (t.interactions, t.rewards))
    assert warning.startswith(f"topic {t.weights!r} has 3 partitions, not 1") and "recreate it" in warning
    assert "kafka.partitions" not in warning


def test_kafka_up_prints_the_partition_warnings_after_topics_ready(monkeypatch):
    cfg = load_config(environ={}, overrides={"kafka.bootstrap_servers": "broker:9092", "kafka.partitions": 4})

    class Existing(KafkaBackend):
        def ensure_topics(self):
            return ["topic 'sao.interactions' keeps its 2 partitions, not the 4 configured"]

    monkeypatch.setattr(broker_cli, "KafkaBackend", Existing)
    out = io.StringIO()
    assert broker_cli.kafka_up(cfg, out) == 0
    lines = out.getvalue().splitlines()
    assert lines[-2].startswith("topics ready: ")
    assert lines[-1] == "warning: topic 'sao.interactions' keeps its 2 partitions, not the 4 configured"


def test_topics_with_fewer_replicas_or_a_lower_insync_minimum_than_configured_are_named():
    """On a three-broker cluster, topics a first `kafka up` made with one replica stayed at one after
    kafka.replication_factor was raised to 3, and `kafka up` said "topics ready" over them."""
    cfg = load_config(environ={}, overrides={"kafka.replication_factor": 3})
    specs = KafkaBackend(cfg.kafka).topic_specs()
    t = cfg.kafka.topics
    as_configured = {name: (3, 2) for name in specs}
    assert kafka_backend.replication_warnings(specs, as_configured) == []
    assert kafka_backend.replication_warnings(specs, {}) == []  # topics not there yet: nothing to say
    made_with_one = {**as_configured, t.interactions: (1, 1)}
    [replicas, insync] = kafka_backend.replication_warnings(specs, made_with_one)
    assert replicas.startswith(f"topic {t.interactions!r} has 1 replica(s) of some partition, not "
                               f"kafka.replication_factor = 3") and "kafka-reassign-partitions.sh" in replicas
    assert insync.startswith(f"topic {t.interactions!r} has min.insync.replicas = 1, not 2")
    assert f"--entity-name {t.interactions} --add-config min.insync.replicas=2" in insync
    single_node = KafkaBackend(load_config(environ={}).kafka).topic_specs()
    assert kafka_backend.replication_warnings(single_node, {name: (1, 1) for name in single_node}) == []
