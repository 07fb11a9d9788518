"""Rank 0's feed against records an integrator produced straight to Kafka: a reward stamped by a fast
clock under a short reward window, and rewards on another scale than ``reward.min_value``..``max_value``."""

from __future__ import annotations

import threading
import time

import pytest

from online_sao.config import Config, KafkaConfig
from online_sao.schemas import DeadLetter, decode
from streams.memory import InMemoryBackend
from tests.fixtures.kafka import drain
from tests.trainer.records import make_interaction, make_reward
from tests.trainer.test_feed import ScriptedConsumer, _message
from trainer.feed import Feed
from trainer.join import RewardJoiner
from trainer.rank_zero import COUNTERS


@pytest.fixture
def backend() -> InMemoryBackend:
    return InMemoryBackend(KafkaConfig(partitions=2))


def _feed(backend: InMemoryBackend, **reward) -> Feed:
    cfg = Config()
    joiner = RewardJoiner(cfg.reward.model_copy(update=reward))
    feed = Feed(cfg.trainer, backend.cfg.topics, joiner, backend.producer(), {}, {name: 0.0 for name in COUNTERS},
                vocab_size=64, group_size=1, stop=threading.Event())
    feed.start(backend)
    feed.consumer.close()
    return feed


def test_with_a_short_reward_window_on_time_rewards_still_join_after_a_fast_clocks_record(backend):
    """reward.window_s 20 s and one reward stamped an hour ahead (a judge's fast clock): read a minute
    ahead, it moved the join's clock past every open window, and the on-time rewards that followed
    counted late (0 of 5 joined). Read at most half a window (10 s) ahead, they join."""
    feed = _feed(backend, window_s=20.0)
    topics, now = backend.cfg.topics, time.time()
    messages = [_message(topics.interactions, i, make_interaction(f"i{i}", created_at=now - 5), now - 5)
                for i in range(6)]
    messages.append(_message(topics.rewards, 0, make_reward("i0", 1.0), now + 3600))
    messages += [_message(topics.rewards, i, make_reward(f"i{i}", 1.0), now) for i in range(1, 6)]
    feed.consumer = ScriptedConsumer(messages)
    feed.poll()
    counters = feed.joiner.counters
    assert (counters.joined, counters.late_rewards, counters.dropped_no_reward) == (6, 0, 0)
    assert feed.counters["records_ahead_of_clock"] == 1
    assert feed.joiner.watermark <= time.time() + 10.0
    feed.close()


def _dead_letters(backend: InMemoryBackend, feed: Feed, count: int) -> list[DeadLetter]:
    feed.flush_dead_letters()
    consumer = backend.consumer([backend.cfg.topics.dead_letters], group_id="reader", start="earliest")
    try:
        return [decode(msg.value, DeadLetter) for msg in drain(consumer, count, timeout_s=5.0)]
    finally:
        consumer.close()


def test_a_reward_outside_the_configured_range_is_dead_lettered_not_trained(backend):
    """A judge on a 0-100 scale producing straight to the rewards topic (serving's feedback endpoint
    would refuse its rewards with 422): a reward of 95 with the range -10..10 trained, and the critic's
    value loss reached 249981. It is dead-lettered now, with the value and the range; so is a reward
    whose value is in range but one of its turns' is not. A reward at the bounds trains."""
    feed = _feed(backend)
    topics, now = backend.cfg.topics, time.time()
    interactions = [_message(topics.interactions, i, make_interaction(f"i{i}", created_at=now, turn_ends=[0, 2]),
                             now) for i in range(4)]
    rewards = [make_reward("i0", 95.0), make_reward("i1", 1.0, turns={1: -50.0}), make_reward("i2", 10.0),
               make_reward("i3", -10.0, turns={0: 10.0})]
    feed.consumer = ScriptedConsumer(interactions + [_message(topics.rewards, i, r, now + 1)
                                                     for i, r in enumerate(rewards)])
    feed.poll()
    assert feed.counters["dead_letters"] == 2
    assert feed.joiner.counters.rewards == 2  # the two in range reached the join, the others did not
    letters = _dead_letters(backend, feed, 2)
    assert [letter.reason for letter in letters] == [
        "reward value 95 is outside the accepted range [-10, 10] (reward.min_value, reward.max_value)",
        "reward turn_rewards turn 1 -50 is outside the accepted range [-10, 10] "
        "(reward.min_value, reward.max_value)"]
    assert [(letter.source_topic, letter.offset) for letter in letters] == [(topics.rewards, 0), (topics.rewards, 1)]
    assert [decode(letter.raw).interaction_id for letter in letters] == ["i0", "i1"]
    feed.close()
