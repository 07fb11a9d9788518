"""A consumer group keeps a member only while it polls (Kafka's ``max.poll.interval.ms``): both backends.

The learner's feed stops reading under backpressure and during a step or a checkpoint. A member that
polls with its partitions paused stays; one that does not poll is dropped, and its commit is refused
with :class:`~streams.base.GroupMembershipLost` (kafka-python's CommitFailedError went through raw,
and the learner's commit, which retries only an unreachable broker, crashed on it). Its next poll
rejoins at the group's committed offsets.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest

from online_sao.config import KafkaConfig
from streams.base import GroupMembershipLost, StreamBackend, TopicPartition
from streams.kafka_backend import KafkaBackend
from streams.memory import InMemoryBackend, partition_for_key
from tests.fixtures.kafka import TEST_PARTITIONS, drain

KEY = b"one partition"


@dataclass
class ShortInterval:
    backend: StreamBackend
    interval_s: float
    """The group's poll interval here (Kafka's default is 300 s)."""
    outlast_s: float
    """Long enough without a poll for the group to drop the member (kafka-python's heartbeat thread
    notices within a heartbeat interval, 3 s, after the poll interval)."""


@pytest.fixture(params=["memory", pytest.param("kafka", marks=pytest.mark.kafka)])
def short(request, monkeypatch) -> ShortInterval:
    if request.param == "memory":
        backend = InMemoryBackend(KafkaConfig(partitions=TEST_PARTITIONS), max_poll_interval_s=1.0)
        backend.ensure_topics()
        return ShortInterval(backend, 1.0, 2.0)
    monkeypatch.setattr("streams.kafka_backend.MAX_POLL_INTERVAL_MS", 3000)
    return ShortInterval(KafkaBackend(request.getfixturevalue("kafka_config")), 3.0, 9.0)


def _on_one_partition(backend: StreamBackend, count: int) -> TopicPartition:
    topic = backend.cfg.topics.rewards
    producer = backend.producer()
    for i in range(count):
        producer.send(topic, str(i).encode(), key=KEY)
    producer.flush(10)
    producer.close()
    return TopicPartition(topic, partition_for_key(KEY, TEST_PARTITIONS))


def test_a_member_polling_with_its_partitions_paused_stays_in_its_group(short):
    tp = _on_one_partition(short.backend, 3)
    consumer = short.backend.consumer([tp.topic], group_id="g-paused")
    assert [m.value for m in drain(consumer, 3, timeout_s=60)] == [b"0", b"1", b"2"]
    consumer.pause(consumer.assignment())
    producer = short.backend.producer()
    producer.send(tp.topic, b"3", key=KEY)
    producer.flush(10)
    producer.close()
    deadline = time.monotonic() + short.outlast_s
    while time.monotonic() < deadline:
        assert consumer.poll(timeout_s=0.0) == []  # as the feed polls while held back
        time.sleep(short.interval_s / 10)
    consumer.commit({tp: 3})  # still a member: taken
    consumer.resume(consumer.assignment())
    assert [m.value for m in drain(consumer, 1)] == [b"3"]
    consumer.close()


@pytest.mark.parametrize("instance_id", [None, "static-member"])
def test_a_member_that_stopped_polling_is_refused_its_commit_and_rejoins_at_the_committed_offset(
        short, instance_id):
    tp = _on_one_partition(short.backend, 6)
    consumer = short.backend.consumer([tp.topic], group_id="g-lapsed", instance_id=instance_id)
    assert len(drain(consumer, 6, timeout_s=60)) == 6
    consumer.commit({tp: 2})
    time.sleep(short.outlast_s)  # a long step: no poll
    with pytest.raises(GroupMembershipLost, match="refused the commit"):
        consumer.commit({tp: 6})
    # the next polls rejoin, and the partition starts again at the committed offset 2
    assert [m.value for m in drain(consumer, 4)] == [b"2", b"3", b"4", b"5"]
    consumer.commit({tp: 6})
    consumer.close()
