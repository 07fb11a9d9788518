"""Logged rollouts for value pre-training: from a JSON-lines file and from retained topics."""

from __future__ import annotations

import threading
import time

import pytest

import streams.memory
from online_sao.config import load_config
from online_sao.schemas import encode
from streams.kafka_backend import KafkaBackend
from streams.memory import InMemoryBackend
from streams.records import publish
from tests.trainer.records import make_interaction, make_reward
from trainer.history import rollouts_from_file, rollouts_from_topics


def _config(tmp_path, **overrides):
    return load_config(environ={}, overrides={"paths.data_dir": str(tmp_path), **overrides})


def _on_file_and_topics(tmp_path, cfg, records):
    """``records`` in a pre-training file and on an in-memory broker's topics: (the file, the backend)."""
    path = tmp_path / "history.jsonl"
    path.write_bytes(b"\n".join(encode(r) for r in records) + b"\n")
    backend = InMemoryBackend(cfg.kafka)
    backend.ensure_topics()
    producer = backend.producer()
    for record in records:
        publish(producer, cfg.kafka.topics.interactions if record.kind == "interaction" else cfg.kafka.topics.rewards,
                record)
    return path, backend


def test_file_history_joins_and_keeps_only_the_starting_version(tmp_path):
    records = [make_interaction("a", version=0), make_reward("a", 1.0), make_interaction("b", version=3),
               make_reward("b", 2.0), make_interaction("c", version=0)]
    path = tmp_path / "history.jsonl"
    path.write_bytes(b"\n".join(encode(r) for r in records) + b"\n{broken\n")
    rollouts = rollouts_from_file(path, _config(tmp_path, **{"reward.on_missing": "default",
                                                           "reward.default_value": -1.0}), version=0)
    assert sorted((r.interaction_id, r.total_reward) for r in rollouts) == [("a", 1.0), ("c", -1.0)]


def test_topic_history_reads_everything_retained_without_committing(tmp_path):
    cfg = _config(tmp_path, **{"kafka.partitions": 2})
    backend = InMemoryBackend(cfg.kafka)
    backend.ensure_topics()
    producer = backend.producer()
    topics = cfg.kafka.topics
    for i in range(5):
        publish(producer, topics.interactions, make_interaction(f"i{i}", created_at=time.time()))
        publish(producer, topics.rewards, make_reward(f"i{i}", float(i)))
    producer.send(topics.rewards, b"garbage", key=b"i0")
    rollouts = rollouts_from_topics(backend, cfg, version=0)
    assert sorted((r.interaction_id, r.total_reward) for r in rollouts) == [(f"i{i}", float(i)) for i in range(5)]
    dead = backend.consumer([topics.dead_letters]).poll(timeout_s=0.05)  # bad records are only skipped here
    assert dead == []


def test_history_leaves_out_rewards_outside_the_configured_range_as_the_feed_does(tmp_path):
    """The feed dead-letters a reward outside reward.min_value..max_value (a judge on a 0-100 scale);
    value pre-training read the same reward from the topics or a file and fitted the critic to it."""
    cfg = _config(tmp_path, **{"reward.min_value": 0.0, "reward.max_value": 1.0})
    records = [make_interaction("in", version=0, created_at=1.0), make_reward("in", 0.5),
               make_interaction("over", version=0, created_at=1.0), make_reward("over", 95.0),
               make_interaction("turn", version=0, created_at=1.0), make_reward("turn", 0.5, turns={0: -3.0})]
    path, backend = _on_file_and_topics(tmp_path, cfg, records)

    from_file = rollouts_from_file(path, cfg, version=0)
    from_topics = rollouts_from_topics(backend, cfg, version=0)

    assert [(r.interaction_id, r.total_reward) for r in from_file] == [("in", 0.5)]
    assert [(r.interaction_id, r.total_reward) for r in from_topics] == [("in", 0.5)]


class ServingLogsOn(InMemoryBackend):
    """Serving keeps logging once the history read has asked where the topics end: an answer and its
    rating every 20 ms, under ids ``live<k>``, until :attr:`stop` is set."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._traffic, daemon=True)

    def consumer(self, *args, **kwargs):
        consumer = super().consumer(*args, **kwargs)
        ends = consumer.end_offsets

        def end_offsets():
            found = ends()
            if not self.thread.is_alive():
                self.thread.start()
            return found

        consumer.end_offsets = end_offsets
        return consumer

    def _traffic(self):
        producer, topics, k = self.producer(), self.cfg.topics, 0
        while not self.stop.is_set():
            publish(producer, topics.interactions, make_interaction(f"live{k}", created_at=time.time()))
            publish(producer, topics.rewards, make_reward(f"live{k}", 1.0))
            k += 1
            time.sleep(0.02)


HISTORY_READ_TIMEOUT_S = 20.0
"""Far above the read of ten records (well under a second); the read that waited for the topics to
fall quiet never ended while serving logged."""


def test_topic_history_ends_where_the_topics_ended_while_serving_logs_on(tmp_path):
    """The read ended only after three empty 1 s polls in a row: with serving logging (a record at least
    every few seconds) ``learn --pretrain-critic`` never got to its first step."""
    cfg = _config(tmp_path, **{"kafka.partitions": 2})
    backend = ServingLogsOn(cfg.kafka)
    backend.ensure_topics()
    producer, topics = backend.producer(), cfg.kafka.topics
    for i in range(10):
        publish(producer, topics.interactions, make_interaction(f"h{i}", created_at=time.time()))
        publish(producer, topics.rewards, make_reward(f"h{i}", 1.0))
    result: list = []
    reader = threading.Thread(target=lambda: result.append(rollouts_from_topics(backend, cfg, version=0)),
                              daemon=True)
    reader.start()
    reader.join(timeout=HISTORY_READ_TIMEOUT_S)
    finished = not reader.is_alive()
    backend.stop.set()
    reader.join(timeout=10.0)
    assert finished, "the history read went on while serving logged"
    # what was logged after the read began is the learner's own to train on, not the history's
    assert sorted(r.interaction_id for r in result[0]) == sorted(f"h{i}" for i in range(10))


@pytest.mark.kafka
def test_topic_history_ends_while_serving_logs_on_on_the_broker(tmp_path, kafka_config):
    """The same on the broker, serving's answers there sampled by a later version (left out whether the
    read takes them or not: what counts here is that it ends)."""
    cfg = _config(tmp_path).model_copy(update={"kafka": kafka_config})
    backend, topics = KafkaBackend(kafka_config), kafka_config.topics
    producer = backend.producer()
    for i in range(10):
        publish(producer, topics.interactions, make_interaction(f"h{i}", created_at=time.time()))
        publish(producer, topics.rewards, make_reward(f"h{i}", 1.0))
    producer.flush()
    stop = threading.Event()

    def traffic():
        k = 0
        while not stop.is_set():
            publish(producer, topics.interactions, make_interaction(f"live{k}", version=1, created_at=time.time()))
            publish(producer, topics.rewards, make_reward(f"live{k}", 1.0))
            producer.flush()
            k += 1
            time.sleep(0.05)

    serving = threading.Thread(target=traffic, daemon=True)
    serving.start()
    result: list = []
    reader = threading.Thread(target=lambda: result.append(rollouts_from_topics(backend, cfg, version=0)),
                              daemon=True)
    reader.start()
    reader.join(timeout=HISTORY_READ_TIMEOUT_S)
    finished = not reader.is_alive()
    stop.set()
    serving.join(timeout=10.0)
    reader.join(timeout=10.0)
    producer.close()
    assert finished, "the history read went on while serving logged"
    assert sorted(r.interaction_id for r in result[0]) == sorted(f"h{i}" for i in range(10))


VOCAB = 64
"""A small model's vocabulary."""


def test_history_leaves_out_rollouts_past_the_models_vocabulary(tmp_path, caplog):
    """One logged answer with a token id past the vocabulary (a history logged under another model):
    the feed leaves it out, the history handed it to the critic's fit, whose embedding crashed, and the
    learner crashed again at every restart."""
    records = []
    for i in range(4):
        response = (8, 9, VOCAB + 100) if i == 0 else (8, 9, 10)
        records += [make_interaction(f"i{i}", response=response, created_at=float(i)), make_reward(f"i{i}", 1.0)]
    cfg = _config(tmp_path, **{"kafka.partitions": 2})
    path, backend = _on_file_and_topics(tmp_path, cfg, records)
    with caplog.at_level("WARNING", logger="trainer.history"):
        from_file = rollouts_from_file(path, cfg, version=0, vocab_size=VOCAB)
        from_topics = rollouts_from_topics(backend, cfg, version=0, vocab_size=VOCAB)
    for rollouts in (from_file, from_topics):
        assert sorted(r.interaction_id for r in rollouts) == ["i1", "i2", "i3"]
    assert caplog.text.count("1 rollouts of version 0 left out") == 2


def test_file_history_measures_the_reward_window_in_record_time_not_lines(tmp_path):
    """A 60 s window: ``a``'s reward comes 30 s after it but 100 lines later (joined);
    ``b``'s comes on the next line but 120 s later (late: ``b`` is dropped)."""
    a = make_interaction("a").model_copy(update={"completed_at": 1000.0})
    fillers = [make_interaction(f"f{i}").model_copy(update={"completed_at": 1001.0 + i}) for i in range(100)]
    reward_a = make_reward("a", 1.0).model_copy(update={"created_at": 1030.0})
    b = make_interaction("b").model_copy(update={"completed_at": 2000.0})
    reward_b = make_reward("b", 2.0).model_copy(update={"created_at": 2120.0})
    path = tmp_path / "history.jsonl"
    path.write_bytes(b"\n".join(encode(r) for r in [a, *fillers, reward_a, b, reward_b]) + b"\n")
    cfg = _config(tmp_path, **{"reward.window_s": 60.0, "reward.on_missing": "drop"})
    rollouts = rollouts_from_file(path, cfg, version=0)
    assert [(r.interaction_id, r.total_reward) for r in rollouts] == [("a", 1.0)]


BACKLOG = 120
"""Interactions in the backlog tests: one every 30 s, each rewarded 5 s after it (an hour of
traffic against a 60 s window)."""


def _backlog_config(tmp_path, **overrides):
    return _config(tmp_path, **{"reward.window_s": 60.0, "reward.on_missing": "drop", **overrides})


def test_topic_history_longer_than_the_window_joins_every_reward(tmp_path, monkeypatch):
    """The in-memory consumer hands over every interaction before any reward; a join clock moved by
    the interactions closed every window but the last minute's, and 117 of 120 rollouts were
    dropped (their rewards counted late; the same on the broker, next test)."""
    cfg = _backlog_config(tmp_path, **{"kafka.partitions": 2})
    backend = InMemoryBackend(cfg.kafka)
    backend.ensure_topics()
    producer, topics = backend.producer(), cfg.kafka.topics
    start, now = time.time() - 7200, [0.0]
    monkeypatch.setattr(streams.memory.time, "time", lambda: start + now[0])
    for i in range(BACKLOG):
        now[0] = 30.0 * i
        publish(producer, topics.interactions, make_interaction(f"i{i}", created_at=start + now[0]))
        now[0] += 5.0
        publish(producer, topics.rewards, make_reward(f"i{i}", 1.0))
    monkeypatch.undo()
    rollouts = rollouts_from_topics(backend, cfg, version=0)
    assert sorted(r.interaction_id for r in rollouts) == sorted(f"i{i}" for i in range(BACKLOG))
    assert {r.total_reward for r in rollouts} == {1.0}


@pytest.mark.kafka
def test_topic_history_longer_than_the_window_joins_every_reward_on_the_broker(tmp_path, kafka_config):
    """The same backlog on the real broker, stamped by the producer an hour in the past."""
    from kafka import KafkaProducer

    cfg = _backlog_config(tmp_path).model_copy(update={"kafka": kafka_config})
    topics, start = kafka_config.topics, time.time() - 7200
    producer = KafkaProducer(bootstrap_servers=kafka_config.bootstrap_servers)
    try:
        for i in range(BACKLOG):
            at = start + 30.0 * i
            key = f"i{i}".encode()
            producer.send(topics.interactions, encode(make_interaction(f"i{i}", created_at=at)), key=key,
                          timestamp_ms=int(at * 1000))
            producer.send(topics.rewards, encode(make_reward(f"i{i}", 1.0)), key=key,
                          timestamp_ms=int((at + 5.0) * 1000))
        producer.flush(30)
    finally:
        producer.close()
    rollouts = rollouts_from_topics(KafkaBackend(kafka_config), cfg, version=0)
    assert sorted(r.interaction_id for r in rollouts) == sorted(f"i{i}" for i in range(BACKLOG))
    assert {r.total_reward for r in rollouts} == {1.0}
