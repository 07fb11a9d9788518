"""The in-memory backend decides as Kafka's does where a test could tell them apart: refusing
topics that cannot stay co-partitioned, and dealing a group's partitions as kafka-python's default
assignor deals them."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
from kafka.coordinator.assignors.range import RangePartitionAssignor

from online_sao.config import KafkaConfig
from streams.base import TopicsMisconfigured
from streams.kafka_backend import KafkaBackend
from streams.memory import InMemoryBackend


class _AdminWhoseTopicsExist:
    """KafkaBackend.ensure_topics's admin client where every topic was made before."""

    def create_topics(self, specs, timeout_ms, raise_errors):
        return {"topics": []}

    def wait_for_topics(self, names, timeout_ms):
        pass


def test_in_memory_ensure_topics_refuses_unequal_partition_counts_with_kafkas_message(monkeypatch):
    """Rewards made earlier with another kafka.partitions: Kafka refuses to go on (TopicsMisconfigured,
    docs/RECORDS.md), the in-memory backend went on with the join's co-partitioning broken."""
    cfg = KafkaConfig(partitions=4)
    memory = InMemoryBackend(cfg)
    memory.create_topic(cfg.topics.rewards, 2)
    with pytest.raises(TopicsMisconfigured) as in_memory:
        memory.ensure_topics()
    monkeypatch.setattr(KafkaBackend, "admin", lambda self: contextlib.nullcontext(_AdminWhoseTopicsExist()))
    monkeypatch.setattr(KafkaBackend, "describe_topics", lambda self: memory.describe_topics())
    with pytest.raises(TopicsMisconfigured) as on_kafka:
        KafkaBackend(cfg).ensure_topics()
    assert str(in_memory.value) == str(on_kafka.value)


class _Cluster:
    def __init__(self, backend: InMemoryBackend) -> None:
        self.counts = backend.describe_topics()

    def partitions_for_topic(self, topic: str) -> set[int]:
        return set(range(self.counts[topic]))


def test_in_memory_group_shares_are_kafka_pythons_range_assignment():
    """The in-memory backend dealt in join order; kafka-python's assignor deals static members by
    instance id first, then dynamic ones by member id (made up by the broker; join order here)."""
    backend = InMemoryBackend(KafkaConfig(partitions=5))
    backend.ensure_topics()
    topics = [backend.cfg.topics.interactions, backend.cfg.topics.rewards]
    joining = [("member-1", None), ("member-2", None), ("member-3", "learner-1"), ("member-4", "learner-0")]
    consumers = {member_id: backend.consumer(topics, group_id="g", instance_id=instance_id)
                 for member_id, instance_id in joining}
    members = [SimpleNamespace(member_id=member_id, group_instance_id=instance_id,
                               metadata=RangePartitionAssignor.metadata(topics))
               for member_id, instance_id in joining]
    kafka_python = RangePartitionAssignor.assign(_Cluster(backend), members)
    for member_id, consumer in consumers.items():
        dealt = {(topic, p) for topic, partitions in kafka_python[member_id].assignment for p in partitions}
        assert {(tp.topic, tp.partition) for tp in consumer.assignment()} == dealt, member_id
