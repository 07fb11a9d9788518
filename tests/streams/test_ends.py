"""EndWatcher: where partitions end, read by a thread of its own, on both backends and through an
outage (a tiny fake backend whose consumer stops answering)."""

from __future__ import annotations

import time

from streams.base import StreamUnavailable, TopicPartition
from streams.ends import EndWatcher
from tests.fixtures.kafka import TEST_PARTITIONS

EVERY_S = 0.05


def _until(condition, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(EVERY_S)
    return False


def test_the_ends_follow_what_is_produced_without_the_caller_polling(backend):
    topics = backend.cfg.topics
    watcher = EndWatcher(backend, [topics.interactions, topics.rewards], EVERY_S)
    producer = backend.producer()
    try:
        assert watcher.wait_for_first_read(15.0)
        assert set(watcher.ends()) == ({TopicPartition(topics.interactions, p) for p in range(TEST_PARTITIONS)}
                                       | {TopicPartition(topics.rewards, p) for p in range(TEST_PARTITIONS)})
        assert sum(watcher.ends().values()) == 0
        for i in range(5):
            producer.send(topics.interactions, b"i", key=f"k{i}".encode())
        producer.send(topics.rewards, b"r", key=b"k0")
        producer.flush(10)

        def by_topic():
            return {t: sum(end for tp, end in watcher.ends().items() if tp.topic == t)
                    for t in (topics.interactions, topics.rewards)}

        assert _until(lambda: by_topic() == {topics.interactions: 5, topics.rewards: 1}), by_topic()
    finally:
        producer.close()
        watcher.close()


class _Outage:
    """A backend whose consumer answers ``answers`` end-offset reads, then finds the broker away."""

    def __init__(self, answers: list[dict[TopicPartition, int]]) -> None:
        self.answers = answers
        self.reads = 0
        self.closed = 0

    def consumer(self, topics, group_id=None, start="earliest", instance_id=None):
        return self

    def beginning_offsets(self) -> dict[TopicPartition, int]:
        return {}

    def end_offsets(self) -> dict[TopicPartition, int]:
        self.reads += 1
        if self.answers:
            return self.answers.pop(0)
        raise StreamUnavailable("broker away")

    def close(self) -> None:
        self.closed += 1


def test_while_the_broker_is_away_the_last_ends_stay_and_the_watcher_keeps_asking():
    tp = TopicPartition("t", 0)
    outage = _Outage([{tp: 3}, {tp: 7}])
    watcher = EndWatcher(outage, ["t"], EVERY_S)
    assert _until(lambda: outage.reads >= 5)  # two answers, then three refusals at least
    assert watcher.ends() == {tp: 7}
    watcher.close()
    assert outage.closed == 1  # the thread closed its consumer on its way out


class _Glitch(_Outage):
    """Its first read fails with an error that is no outage (a client bug, an unmapped broker error)."""

    def end_offsets(self) -> dict[TopicPartition, int]:
        self.reads += 1
        if self.reads == 1:
            raise ValueError("unexpected response")
        return {TopicPartition("t", 0): 4}


def test_any_other_failure_is_said_and_the_watcher_asks_again_with_a_new_consumer(caplog):
    """It ended the thread without a word, and the ends stayed as they were for good."""
    glitch = _Glitch([])
    watcher = EndWatcher(glitch, ["t"], EVERY_S)
    assert watcher.wait_for_first_read(15.0)
    assert watcher.ends() == {TopicPartition("t", 0): 4}
    watcher.close()
    assert "unexpected response" in caplog.text and glitch.closed == 2  # the failed one and the last one
