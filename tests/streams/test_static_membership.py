"""Static group membership (``instance_id``): a consumer that died without closing is replaced
at once by one with its id; a consumer that closes leaves its group at once.

A dynamic member's partitions wait for the dead member's session to expire (kafka-python's
default session timeout is 45 s; the restarted learner waited 23-34 s for its partitions,
docs/RELIABILITY.md), so the bounds below fail without static membership.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

from online_sao.config import KafkaConfig
from streams.base import ConsumerFenced, StreamBackend, TopicPartition
from streams.kafka_backend import KafkaBackend
from streams.memory import InMemoryBackend
from tests.fixtures.kafka import TEST_PARTITIONS

HANDOVER_MAX_S = 10.0
"""Longest a consumer may wait for the partitions of a member that died or left (one
rebalance on a loaded 2-core box; a session expiry takes 45 s)."""
ASSIGNMENT_WAIT_S = 60.0
"""How long the consumer in the child process may take to join before the test gives up."""
IN_MEMORY_POLL_S = 5.0
"""How long the in-memory member's poll waits for a record: it ends with the record sent, far sooner."""
FENCE_NOTICE_S = 30.0
"""How long a replaced Kafka member may take to learn it was fenced: its next heartbeat (every 3 s),
with room for a loaded 2-core box; unbounded before (it went on reading its partitions)."""

_MEMBER = """
import sys, time
from online_sao.config import KafkaConfig
from streams.kafka_backend import KafkaBackend
cfg = KafkaConfig.model_validate_json(sys.argv[1])
consumer = KafkaBackend(cfg).consumer([cfg.topics.rewards], group_id=sys.argv[2], instance_id=sys.argv[3])
while not consumer.assignment():
    consumer.poll(timeout_s=0.2)
print("assigned", flush=True)
while True:
    consumer.poll(timeout_s=0.5)
"""


def _wait_assigned(consumer, timeout_s: float) -> float:
    """Seconds until ``consumer`` holds partitions (polling, as the learner does)."""
    started = time.monotonic()
    while not consumer.assignment():
        assert time.monotonic() - started < timeout_s, f"no partitions after {timeout_s:.0f} s"
        consumer.poll(timeout_s=0.2)
    return time.monotonic() - started


def _all_rewards_partitions(cfg: KafkaConfig) -> set[TopicPartition]:
    return {TopicPartition(cfg.topics.rewards, p) for p in range(TEST_PARTITIONS)}


@pytest.mark.kafka
def test_a_static_member_killed_with_sigkill_is_replaced_at_once_by_one_with_its_id(kafka_config):
    group, member = f"g-static-{uuid.uuid4().hex[:8]}", "learner"
    child = subprocess.Popen([sys.executable, "-c", _MEMBER, kafka_config.model_dump_json(), group, member],
                             stdout=subprocess.PIPE, text=True, env={**os.environ})
    try:
        deadline = time.monotonic() + ASSIGNMENT_WAIT_S
        line = child.stdout.readline()  # blocks until the child holds its partitions (or dies)
        assert line.strip() == "assigned" and time.monotonic() < deadline, child.poll()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    restarted = KafkaBackend(kafka_config).consumer([kafka_config.topics.rewards], group_id=group,
                                                    instance_id=member)
    try:
        waited = _wait_assigned(restarted, ASSIGNMENT_WAIT_S)
        assert restarted.assignment() == _all_rewards_partitions(kafka_config)
    finally:
        restarted.close()
    print(f"static member replaced {waited:.1f} s after its predecessor's SIGKILL")
    assert waited < HANDOVER_MAX_S


@pytest.mark.kafka
def test_a_static_member_that_closes_leaves_its_group_at_once(kafka_config):
    backend, group = KafkaBackend(kafka_config), f"g-leave-{uuid.uuid4().hex[:8]}"
    first = backend.consumer([kafka_config.topics.rewards], group_id=group, instance_id="learner")
    _wait_assigned(first, ASSIGNMENT_WAIT_S)
    first.close()
    other = backend.consumer([kafka_config.topics.rewards], group_id=group, instance_id="another")
    try:
        waited = _wait_assigned(other, ASSIGNMENT_WAIT_S)
        assert other.assignment() == _all_rewards_partitions(kafka_config)
    finally:
        other.close()
    print(f"a closed static member's partitions went to another member after {waited:.1f} s")
    assert waited < HANDOVER_MAX_S
    with backend.admin() as admin:  # nothing left behind: the group is empty and can be deleted
        outcome = admin.delete_groups([group])
    assert outcome == {group: "OK"}  # kafka-python names the error otherwise (NonEmptyGroupError)


def test_in_memory_a_consumer_with_the_same_instance_id_takes_the_place_of_the_old_one():
    backend = InMemoryBackend(KafkaConfig(partitions=4))
    backend.ensure_topics()
    rewards = backend.cfg.topics.rewards
    dead = backend.consumer([rewards], group_id="g", instance_id="learner")
    peer = backend.consumer([rewards], group_id="g", instance_id="other")
    held = dead.assignment()
    assert held and held.isdisjoint(peer.assignment())
    restarted = backend.consumer([rewards], group_id="g", instance_id="learner")  # the old one never closed
    assert restarted.assignment() == held  # the same share, without waiting for anything
    assert dead.assignment() == set()
    with pytest.raises(RuntimeError, match="fenced"):
        dead.poll(timeout_s=0)
    with pytest.raises(RuntimeError, match="fenced"):  # it was accepted, over the new member's offsets
        dead.commit({next(iter(held)): 7})
    with pytest.raises(ValueError, match="group"):
        backend.consumer([rewards], instance_id="learner")


def _replaced(backend: StreamBackend) -> tuple:
    """A static member that held partitions, and the newer consumer with its instance id that took them."""
    rewards, group = backend.cfg.topics.rewards, f"g-fenced-{uuid.uuid4().hex[:8]}"
    old = backend.consumer([rewards], group_id=group, instance_id="learner")
    _wait_assigned(old, ASSIGNMENT_WAIT_S)
    new = backend.consumer([rewards], group_id=group, instance_id="learner")
    _wait_assigned(new, ASSIGNMENT_WAIT_S)
    return old, new


def test_a_static_member_replaced_by_a_newer_one_can_neither_poll_nor_commit(backend):
    """The learner's config says a second learner with the same instance id replaces the first: on Kafka
    the first went on polling and reading its old partitions (kafka-python only stops its heartbeat), and
    its commit raised kafka-python's FencedInstanceIdError; the in-memory one raised at once."""
    old, new = _replaced(backend)
    deadline = time.monotonic() + FENCE_NOTICE_S
    with pytest.raises(ConsumerFenced, match="consumer fenced"):
        while time.monotonic() < deadline:
            old.poll(timeout_s=0.3)
            new.poll(timeout_s=0.3)  # the new member polls on, as a learner does
    assert isinstance(ConsumerFenced("x"), RuntimeError)  # what the in-memory backend always raised
    assert old.assignment() == set()
    tp = next(iter(new.assignment()))
    with pytest.raises(ConsumerFenced, match="consumer fenced"):
        old.commit({tp: 1})
    with pytest.raises(ConsumerFenced):
        old.poll(timeout_s=0.1)  # for good
    new.commit({tp: 1})
    new.close()
    old.close()


def test_closing_a_replaced_static_member_leaves_the_newer_one_in_its_group(backend):
    """Closing removed the static member by instance id alone, so the old learner's close took its
    replacement out of the group: the replacement's next commit was refused (GroupMembershipLost)."""
    old, new = _replaced(backend)
    held = new.assignment()
    old.close()
    tp = next(iter(held))
    new.commit({tp: 1})
    assert new.poll(timeout_s=0.5) == [] and new.assignment() == held
    new.close()


def test_in_memory_a_static_member_replaced_while_it_waits_in_poll_is_fenced_by_that_poll():
    """Kafka's consumer raises ConsumerFenced from the poll during which it was replaced (it checks
    after polling); the in-memory one returned [] and raised only from the next poll."""
    backend = InMemoryBackend(KafkaConfig(partitions=TEST_PARTITIONS))
    backend.ensure_topics()
    rewards = backend.cfg.topics.rewards
    old = backend.consumer([rewards], group_id="g", instance_id="learner")
    outcome: list[object] = []

    def waiting_poll() -> None:
        try:
            outcome.append(old.poll(timeout_s=IN_MEMORY_POLL_S))
        except ConsumerFenced as exc:
            outcome.append(exc)

    waiting = threading.Thread(target=waiting_poll)
    waiting.start()
    deadline = time.monotonic() + IN_MEMORY_POLL_S
    while not old._polling:  # replaced inside that poll, not before it
        assert time.monotonic() < deadline, "the poll never started"
        time.sleep(0.01)
    new = backend.consumer([rewards], group_id="g", instance_id="learner")
    backend.producer().send(rewards, b"new work", key=b"k")  # wakes the waiting poll
    waiting.join(2 * IN_MEMORY_POLL_S)
    assert len(outcome) == 1 and isinstance(outcome[0], ConsumerFenced), outcome
    assert [m.value for m in new.poll(timeout_s=0)] == [b"new work"]  # the new member's to read
