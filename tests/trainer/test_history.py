"""Logged rollouts for value pre-training: from a JSON-lines file and from retained topics."""

from __future__ import annotations

import time

from online_sao.config import load_config
from online_sao.schemas import encode
from streams.memory import InMemoryBackend
from streams.records import publish
from tests.trainer.records import make_interaction, make_reward
from trainer.history import rollouts_from_file, rollouts_from_topics


def _config(tmp_path, **overrides):
    return load_config(environ={}, overrides={"paths.data_dir": str(tmp_path), **overrides})


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
