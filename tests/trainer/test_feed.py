"""Rank 0's feed: what it reports of keeping up with the traffic (the join and the learner loop
are tested in test_join*.py and test_learner_*.py)."""

from __future__ import annotations

import dataclasses
import math
import threading
import time

import pytest

from online_sao.config import Config, KafkaConfig, RewardConfig
from streams.base import StreamBackend, TopicPartition
from streams.kafka_backend import KafkaBackend
from streams.memory import InMemoryBackend
from streams.records import publish
from tests.trainer.records import make_interaction, make_reward, parent_ready_beside_its_continuation
from trainer.feed import ENDS_EVERY_S, Feed, KeepingUp
from trainer.join import RewardJoiner
from trainer.rank_zero import COUNTERS
from trainer.rollouts import interaction_to_rollout


@pytest.fixture
def backend() -> InMemoryBackend:
    return InMemoryBackend(KafkaConfig(partitions=2))


def _started_feed(backend: StreamBackend) -> Feed:
    cfg = Config()
    feed = Feed(cfg.trainer, backend.cfg.topics, RewardJoiner(cfg.reward), backend.producer(), {},
                {name: 0.0 for name in COUNTERS}, vocab_size=64, group_size=1, stop=threading.Event())
    feed.start(backend)
    return feed


def test_unread_records_and_the_joins_books_are_counted_per_topic(backend):
    feed = _started_feed(backend)
    topics, producer, now = backend.cfg.topics, backend.producer(), time.time()
    for i in range(3):
        publish(producer, topics.interactions, make_interaction(f"i{i}", created_at=now))
    publish(producer, topics.rewards, make_reward("i0", 1.0))
    feed.poll()
    for i in range(3, 7):
        publish(producer, topics.interactions, make_interaction(f"i{i}", created_at=now))
    publish(producer, topics.rewards, make_reward("i1", 0.5))
    publish(producer, topics.rewards, make_reward("i2", 0.0))
    # read: i0-i2 and i0's reward (i0 ready, i1 and i2 waiting); not read: i3-i6, two rewards
    before = feed.keeping_up([], now)
    assert (before.unread_interactions, before.unread_rewards, before.waiting, before.ready) == (4, 2, 2, 1)
    feed.poll()
    after = feed.keeping_up([], now)
    assert (after.unread_interactions, after.unread_rewards, after.waiting, after.ready) == (0, 0, 4, 3)
    assert math.isnan(after.data_age_mean_s) and math.isnan(after.data_age_max_s)  # nothing trained
    feed.close()


def test_offsets_past_a_partitions_end_read_the_topic_made_again_from_its_start(backend, caplog):
    """The topics were deleted and made again (to change kafka.partitions, say) and the learner kept
    its checkpoint: offsets 50 on partitions that hold 3 records. Every new record was taken for one
    already read and skipped, uncounted."""
    backend.ensure_topics()
    topics, producer, now = backend.cfg.topics, backend.producer(), time.time()
    for i in range(6):
        publish(producer, topics.interactions, make_interaction(f"i{i}", created_at=now))
    stale = {TopicPartition(topic, p): 50 for topic in (topics.interactions, topics.rewards) for p in range(2)}
    cfg = Config()
    feed = Feed(cfg.trainer, topics, RewardJoiner(cfg.reward), producer, dict(stale),
                {name: 0.0 for name in COUNTERS}, vocab_size=64, group_size=1, stop=threading.Event())
    with caplog.at_level("ERROR", logger="trainer.partitions"):
        feed.start(backend)
    assert "past the partition's end" in caplog.text
    feed.poll()
    assert feed.counters["records_read"] == 6 and feed.joiner.num_waiting == 6
    feed.close()


def test_offsets_of_partitions_gone_with_topics_made_again_with_fewer_are_dropped_not_committed(backend, caplog):
    """The topics were made again with 2 partitions where they had 4, and the learner kept its checkpoint:
    its offsets of partitions 2 and 3 stayed in the feed's (no consumer is assigned those), were checkpointed
    again and committed, and the broker refuses a commit naming a partition that does not exist: the
    learner crashed at every checkpoint."""
    backend.ensure_topics()
    topics = backend.cfg.topics
    gone = {TopicPartition(topics.interactions, 3), TopicPartition(topics.rewards, 3),
            TopicPartition("topic-deleted-since", 0)}
    kept = {TopicPartition(topic, p): 0 for topic in (topics.interactions, topics.rewards) for p in range(2)}
    cfg = Config()
    feed = Feed(cfg.trainer, topics, RewardJoiner(cfg.reward), backend.producer(), {**kept, **dict.fromkeys(gone, 7)},
                {name: 0.0 for name in COUNTERS}, vocab_size=64, group_size=1, stop=threading.Event())
    with caplog.at_level("ERROR", logger="trainer.partitions"):
        feed.start(backend)
    feed.commit(dict(feed.offsets))  # refused (ValueError) with the gone partitions in it
    assert feed.offsets == kept
    assert sum("partition that does not exist" in r.getMessage() for r in caplog.records) == len(gone)
    feed.close()


def test_a_partition_the_checkpoint_does_not_name_counts_from_where_its_group_resumes():
    """A new checkpoint directory beside the learner's consumer group: the consumer resumes at the
    group's committed offsets, but the feed counted every record from the partition's start as
    unread, and the join's clock, held at the partition read least far, did not move."""
    backend = InMemoryBackend(KafkaConfig(partitions=1))
    backend.ensure_topics()
    topics, producer, cfg = backend.cfg.topics, backend.producer(), Config()
    for i in range(5):  # read and committed by the learner before
        publish(producer, topics.rewards, make_reward(f"old{i}", 1.0))
    before = backend.consumer([topics.interactions, topics.rewards], group_id=cfg.trainer.consumer_group)
    assert len(before.poll(timeout_s=0.1)) == 5
    before.commit({TopicPartition(topics.rewards, 0): 5, TopicPartition(topics.interactions, 0): 0})
    before.close()
    feed = _started_feed(backend)
    for i in range(3):
        publish(producer, topics.interactions, make_interaction(f"i{i}", created_at=time.time()))
    feed.poll()
    assert feed.unread() == {topics.interactions: 0, topics.rewards: 0}
    assert feed.counters["records_read"] == 3 and feed.joiner.watermark is not None
    feed.close()


def _grpo_joiner() -> RewardJoiner:
    """Two prompts of four answers each: the first group complete, the second's last reward dropped
    and its 30 s group timeout past (record time 40 s)."""
    joiner = RewardJoiner(Config().reward.model_copy(update={"group_timeout_s": 30.0}))
    for prompt in ((5, 6, 7), (9, 9, 9)):
        for k in range(4):
            joiner.add_interaction(make_interaction(f"{prompt[0]}-{k}", prompt=prompt, created_at=float(k)), float(k))
    for iid in ["5-0", "5-1", "5-2", "5-3", "9-0", "9-1", "9-2"]:
        joiner.add_reward(make_reward(iid, 0.5), 5.0)
    joiner.add_interaction(make_interaction("later", prompt=(1, 2, 3), created_at=40.0), 40.0)
    return joiner


def test_an_incomplete_grpo_group_past_its_timeout_is_a_unit_of_a_step():
    """The live learner asked for world_size x group_size ready rollouts: an incomplete group past its
    timeout never made a step alone (the in-process driver stepped on it), and two ranks with a
    complete and an incomplete group (7 rollouts) waited for an eighth that never came."""
    cfg = Config()
    tcfg = cfg.trainer.model_copy(update={"min_rollouts": 1})

    def feed(joiner: RewardJoiner) -> Feed:
        return Feed(tcfg, KafkaConfig().topics, joiner, InMemoryBackend().producer(), {},
                    {name: 0.0 for name in COUNTERS}, vocab_size=64, group_size=4, stop=threading.Event())

    both = _grpo_joiner()
    assert both.ready_units(4) == 2 and both.ready_units(1) == 7
    taken = feed(both).take(world_size=2)
    assert taken is not None and sorted(r.interaction_id for r in taken) == \
        ["5-0", "5-1", "5-2", "5-3", "9-0", "9-1", "9-2"]
    alone = _grpo_joiner()
    alone.pop_ready(max_rollouts=4, token_budget=10**6, group_size=4)  # the complete group trained
    assert feed(alone).take(world_size=2) is None and alone.ready_rollouts(4) == 3  # one unit: kept
    assert sorted(r.interaction_id for r in feed(alone).take(world_size=1)) == ["9-0", "9-1", "9-2"]


def test_a_step_of_two_ranks_takes_a_rollout_for_each_even_past_max_rollouts_per_step():
    """max_rollouts_per_step 1 under two ranks: the step popped one rollout, too few for the ranks, and
    dropped it (too_few_for_ranks) step after step, training nothing."""
    cfg = Config()
    joiner = RewardJoiner(cfg.reward)
    for iid in ("a", "b", "c"):
        joiner.add_interaction(make_interaction(iid, created_at=0.0), 0.0)
        joiner.add_reward(make_reward(iid, 1.0), 1.0)
    counters = {name: 0.0 for name in COUNTERS}
    feed = Feed(cfg.trainer.model_copy(update={"min_rollouts": 1, "max_rollouts_per_step": 1}), KafkaConfig().topics,
                joiner, InMemoryBackend().producer(), {}, counters, vocab_size=64, group_size=1,
                stop=threading.Event())
    taken = feed.take(world_size=2)
    assert taken is not None and [r.interaction_id for r in taken] == ["a", "b"]
    assert counters["too_few_for_ranks"] == 0 and joiner.ready_rollouts() == 1


def _log_and_read_three(feed: Feed, producer, topics, now: float) -> None:
    """Log interactions i0..i2 on the broker and poll until the feed has read them (20 s at most)."""
    for i in range(3):
        publish(producer, topics.interactions, make_interaction(f"i{i}", created_at=now))
    producer.flush(10)
    deadline = time.monotonic() + 20
    while feed.joiner.num_waiting < 3 and time.monotonic() < deadline:
        feed.poll()


@pytest.mark.kafka
def test_records_arriving_while_the_feed_does_not_poll_count_as_unread(kafka_config):
    """Under backpressure the feed reads nothing (it polls with its partitions paused), and its
    consumer stops hearing where the partitions end; the unread count must still grow with the traffic (live, it stayed at 71 while
    the learner fell minutes behind)."""
    backend = KafkaBackend(kafka_config)
    feed = _started_feed(backend)
    topics, producer, now = kafka_config.topics, backend.producer(), time.time()
    try:
        _log_and_read_three(feed, producer, topics, now)
        assert feed.joiner.num_waiting == 3
        for i in range(3, 8):
            publish(producer, topics.interactions, make_interaction(f"i{i}", created_at=now))
        publish(producer, topics.rewards, make_reward("i0", 1.0))
        producer.flush(10)
        deadline = time.monotonic() + 4 * ENDS_EVERY_S + 10
        while feed.unread() != {topics.interactions: 5, topics.rewards: 1} and time.monotonic() < deadline:
            time.sleep(0.1)  # no poll
        assert feed.unread() == {topics.interactions: 5, topics.rewards: 1}
    finally:
        producer.close()
        feed.close()


@pytest.mark.kafka
def test_records_the_broker_deleted_before_they_were_read_are_counted_as_skipped(kafka_config, caplog):
    """Retention that outruns the learner deletes records it never read; its consumer then moves on
    to the earliest record kept. The feed counts the gap (before, nothing did)."""
    from kafka import TopicPartition as KafkaTopicPartition
    from kafka.admin import KafkaAdminClient

    backend = KafkaBackend(kafka_config)
    topics, producer, now = kafka_config.topics, backend.producer(), time.time()
    for i in range(12):
        publish(producer, topics.interactions, make_interaction(f"i{i}", created_at=now))
    producer.flush(10)
    producer.close()
    reader = backend.consumer([topics.interactions])  # no group: every partition
    ends = reader.end_offsets()
    reader.close()
    fullest = max(ends, key=ends.get)
    assert ends[fullest] >= 3
    admin = KafkaAdminClient(bootstrap_servers=kafka_config.bootstrap_servers)
    try:  # as retention would: the partition's first two records are gone
        admin.delete_records({KafkaTopicPartition(fullest.topic, fullest.partition): 2})
    finally:
        admin.close()

    checkpointed = {tp: 0 for tp in ends}  # a learner that had read none of them
    cfg = Config()
    dead_letters = backend.producer()
    feed = Feed(cfg.trainer, topics, RewardJoiner(cfg.reward), dead_letters, checkpointed,
                {name: 0.0 for name in COUNTERS}, vocab_size=64, group_size=1, stop=threading.Event())
    feed.start(backend)
    try:
        with caplog.at_level("WARNING", logger="trainer.feed"):
            deadline = time.monotonic() + 20
            while feed.joiner.num_waiting < 10 and time.monotonic() < deadline:
                feed.poll()
        assert feed.joiner.num_waiting == 10
        assert feed.counters["records_skipped"] == 2
        assert f"{fullest.topic}[{fullest.partition}]: offsets 0-1 were gone" in caplog.text
    finally:
        dead_letters.close()
        feed.close()


def test_data_age_runs_from_servings_answer_to_the_end_of_the_cycle(backend):
    feed = _started_feed(backend)
    answered_at_100 = interaction_to_rollout(make_interaction("a", created_at=100.0), 1.0)
    answered_at_102 = interaction_to_rollout(make_interaction("b", created_at=102.0), 1.0)
    without_time = dataclasses.replace(answered_at_100, interaction_id="c", completed_at=None)
    reading = feed.keeping_up([answered_at_100, answered_at_102, without_time], now=104.0)
    assert (reading.data_age_mean_s, reading.data_age_max_s) == (3.0, 4.0)
    feed.close()


def test_keeping_up_metrics_name_every_reading():
    reading = KeepingUp(unread_interactions=5, unread_rewards=2, waiting=7, ready=3, data_age_mean_s=1.5,
                        data_age_max_s=2.5)
    assert reading.metrics() == {"unread_interactions": 5.0, "unread_rewards": 2.0, "join_waiting": 7.0,
                                 "join_ready": 3.0, "data_age_mean_s": 1.5, "data_age_max_s": 2.5}


def test_a_dead_letter_the_broker_refused_is_sent_again_before_the_offsets_past_it_are_committed(backend):
    """kafka-python forgets a record whose delivery timed out once its flush has raised: the feed's
    retry then flushed nothing and committed past the bad record with no dead letter written."""
    from tests.streams.test_outbox import FlakyBroker

    cfg = Config()
    broker = FlakyBroker(refuse=2)
    feed = Feed(cfg.trainer, backend.cfg.topics, RewardJoiner(cfg.reward), broker, {},
                {name: 0.0 for name in COUNTERS}, vocab_size=64, group_size=1, stop=threading.Event())
    feed.start(backend)
    backend.producer().send(backend.cfg.topics.interactions, b'{"kind": "interaction", "garbage":', key=b"x")
    feed.poll()
    feed.commit(dict(feed.offsets))  # waits out two refusals (BROKER_RETRY_S each)
    assert [topic for topic, _ in broker.stored] == [backend.cfg.topics.dead_letters]
    feed.close()


def test_a_broker_down_at_start_is_waited_for(backend):
    """`learn` waits out an outage once running; at start too (it crashed with a traceback)."""
    from streams.base import StreamUnavailable

    class LateBroker:  # down for the first attempt of each call
        def __init__(self):
            self.failed = set()

        def __getattr__(self, name):
            real = getattr(backend, name)

            def call(*args, **kwargs):
                if name not in self.failed:
                    self.failed.add(name)
                    raise StreamUnavailable(f"{name}: Kafka not reachable")
                return real(*args, **kwargs)

            return call

    cfg = Config()
    feed = Feed(cfg.trainer, backend.cfg.topics, RewardJoiner(cfg.reward), backend.producer(), {},
                {name: 0.0 for name in COUNTERS}, vocab_size=64, group_size=1, stop=threading.Event())
    late = LateBroker()
    feed.start(late)
    assert {"ensure_topics", "consumer"} <= late.failed and feed.consumer is not None
    feed.close()


class ScriptedConsumer:
    """Hands the feed the messages given, once (the broker's timestamps as the test sets them)."""

    def __init__(self, messages):
        self.messages = list(messages)

    def poll(self, timeout_s, max_records=None):
        out, self.messages = self.messages, []
        return out

    def highwater(self):
        return {}  # nothing heard: the records handed over are all there is

    def assignment(self):
        return set()  # no partition the feed should wait for

    def close(self):
        pass


def _message(topic: str, offset: int, record, timestamp_s: float):
    from online_sao.schemas import encode
    from streams.base import StreamMessage

    return StreamMessage(topic=topic, partition=0, offset=offset, key=None, value=encode(record),
                         timestamp_ms=int(timestamp_s * 1000))


def test_a_record_stamped_far_ahead_does_not_move_the_joins_clock_past_this_hosts(backend):
    """One interaction stamped 50 minutes ahead (a fast producer clock) closed the windows of the next
    50 minutes: every later interaction, rewarded 2 s after it, was dropped."""
    feed = _started_feed(backend)
    topics, now = backend.cfg.topics, time.time()
    messages = [_message(topics.interactions, 0, make_interaction("fast", created_at=now + 3000), now + 3000)]
    for i in range(5):
        messages.append(_message(topics.interactions, 1 + 2 * i, make_interaction(f"i{i}", created_at=now), now + i))
        messages.append(_message(topics.rewards, 2 + 2 * i, make_reward(f"i{i}", 1.0), now + i + 2))
    feed.consumer.close()
    feed.consumer = ScriptedConsumer(messages)
    feed.poll()
    assert feed.joiner.counters.joined == 5 and feed.joiner.counters.late_rewards == 0
    assert feed.counters["records_ahead_of_clock"] == 1
    assert feed.joiner.watermark <= time.time() + 60.0


def test_records_read_count_what_was_read_not_where_the_offsets_stand(backend):
    """The dead-letter monitor's denominator was the sum of the next offsets: a partition first read at
    offset 1000 (retention deleted the rest unread) added 1000 records that were never read."""
    feed = _started_feed(backend)
    topics, now = backend.cfg.topics, time.time()
    feed.consumer.close()
    feed.consumer = ScriptedConsumer([_message(topics.interactions, 1000 + i, make_interaction(f"i{i}", created_at=now),
                                               now) for i in range(3)])
    feed.poll()
    assert feed.counters["records_read"] == 3 and sum(feed.offsets.values()) == 1003


def _slow_replica_traffic(topics, now: float) -> list:
    """Ten interactions of a replica with a good clock, one every 10 s, rewarded 2 s after; one
    interaction of a replica whose clock is 600 s slow, served at now + 50 and rewarded by the judge
    (a good clock) 2 s after; and one good-clock record 30 s out of order (within the minute)."""
    messages, offset = [], 0
    for i in range(10):
        messages.append(_message(topics.interactions, offset, make_interaction(f"i{i}", created_at=now + 10 * i),
                                 now + 10 * i))
        messages.append(_message(topics.rewards, offset + 1, make_reward(f"i{i}", 1.0), now + 10 * i + 2))
        offset += 2
        if i == 5:
            messages.append(_message(topics.interactions, offset, make_interaction("slow", created_at=now - 550),
                                     now - 550))
            messages.append(_message(topics.rewards, offset + 1, make_reward("slow", 1.0), now + 52))
            messages.append(_message(topics.interactions, offset + 2, make_interaction("late", created_at=now + 20),
                                     now + 20))
            messages.append(_message(topics.rewards, offset + 3, make_reward("late", 1.0), now + 53))
            offset += 4
    return messages


def test_a_record_stamped_by_a_slow_clock_still_gets_its_reward_window(backend):
    """A serving replica 10 minutes slow: its interaction entered the join 10 minutes in the past,
    its 300 s window closed on arrival, and it was dropped with its reward counted late. Read as a
    minute behind the join's clock, it joins; the record 30 s out of order keeps its time."""
    feed = _started_feed(backend)
    feed.consumer.close()
    feed.consumer = ScriptedConsumer(_slow_replica_traffic(backend.cfg.topics, time.time()))
    feed.poll()
    counters = feed.joiner.counters
    assert (counters.joined, counters.dropped_no_reward, counters.late_rewards) == (12, 0, 0)
    assert feed.counters["records_behind_clock"] == 1


def test_with_a_short_reward_window_a_slow_clocks_record_still_gets_its_reward_window(backend):
    """The same traffic with reward.window_s 20 s: read a minute behind, the slow replica's record
    (and the one 30 s out of order) had a window that closed on arrival; both were dropped and their
    rewards late. Read at most 10 s behind (half the window), both join."""
    cfg = Config()
    joiner = RewardJoiner(cfg.reward.model_copy(update={"window_s": 20.0}))
    feed = Feed(cfg.trainer, backend.cfg.topics, joiner, backend.producer(), {}, {name: 0.0 for name in COUNTERS},
                vocab_size=64, group_size=1, stop=threading.Event())
    feed.start(backend)
    feed.consumer.close()
    # stamped in the past: a record ahead of this host's clock is read at most half a window (10 s) ahead
    feed.consumer = ScriptedConsumer(_slow_replica_traffic(backend.cfg.topics, time.time() - 100))
    feed.poll()
    counters = joiner.counters
    assert (counters.joined, counters.dropped_no_reward, counters.late_rewards) == (12, 0, 0)
    assert feed.counters["records_behind_clock"] == 2  # "slow", and "late" (32 s behind)
    feed.close()


@pytest.mark.kafka
def test_a_slow_replicas_record_gets_its_reward_window_on_the_broker(kafka_config):
    """The same traffic through the real broker, stamped by the producer as the replicas' clocks would."""
    from kafka import KafkaProducer

    backend = KafkaBackend(kafka_config)
    feed = _started_feed(backend)
    producer = KafkaProducer(bootstrap_servers=kafka_config.bootstrap_servers)
    try:
        for msg in _slow_replica_traffic(kafka_config.topics, time.time()):
            producer.send(msg.topic, msg.value, key=b"one-partition", timestamp_ms=msg.timestamp_ms)
        producer.flush(30)
        deadline = time.monotonic() + 30
        while feed.joiner.counters.rewards < 12 and time.monotonic() < deadline:
            feed.poll()
        counters = feed.joiner.counters
        assert (counters.joined, counters.dropped_no_reward, counters.late_rewards) == (12, 0, 0)
        assert feed.counters["records_behind_clock"] == 1
    finally:
        producer.close()
        feed.close()


def _started_on_backlog(backend: StreamBackend, monkeypatch, count: int, reward_after_s: float) -> Feed:
    """A feed started over ``count`` interactions logged one every 30 s, ending now, each rewarded
    ``reward_after_s`` after it; reward windows of 60 s."""
    import streams.memory

    backend.ensure_topics()
    start, clock = time.time() - 30.0 * count, [0.0]
    monkeypatch.setattr(streams.memory.time, "time", lambda: start + clock[0])
    topics, producer = backend.cfg.topics, backend.producer()
    for i in range(count):
        clock[0] = 30.0 * i
        publish(producer, topics.interactions, make_interaction(f"i{i}", created_at=start + clock[0]))
        clock[0] += reward_after_s
        publish(producer, topics.rewards, make_reward(f"i{i}", 1.0))
    monkeypatch.undo()
    cfg = Config()
    feed = Feed(cfg.trainer, topics, RewardJoiner(cfg.reward.model_copy(update={"window_s": 60.0})),
                backend.producer(), {}, {name: 0.0 for name in COUNTERS}, vocab_size=64, group_size=1,
                stop=threading.Event())
    feed.start(backend)
    return feed


def test_catching_up_a_backlog_holds_the_joins_clock_until_every_partition_is_read(backend, monkeypatch):
    """Two hours of traffic, each interaction rewarded 5 s after it, read by a learner that was away:
    a poll hands over every interaction before any reward (the in-memory backend reads partition by
    partition), and a clock moved by them closed the windows of the rewards still unread."""
    feed = _started_on_backlog(backend, monkeypatch, 240, reward_after_s=5.0)
    joiner = feed.joiner
    assert feed.ends.wait_for_first_read(10)
    for _ in range(5):
        feed.poll()
    assert (joiner.counters.joined, joiner.counters.dropped_no_reward, joiner.counters.expired_rewards) == (240, 0, 0)
    feed.close()


class HeardWhenPolled:
    """A consumer that, as kafka-python's, knows a partition's end only once it handed over that
    partition's records (a fetch response is parsed when its records are drained), one partition per poll."""

    def __init__(self, consumer) -> None:
        self.consumer, self.heard = consumer, set()

    def poll(self, timeout_s, max_records=None):
        messages = self.consumer.poll(timeout_s, max_records)
        first = messages[0].tp if messages else None
        kept = [m for m in messages if m.tp == first]
        for m in messages[len(kept):]:  # left for a later poll, as a fetch not drained yet
            self.consumer.seek(m.tp, min(m.offset, self.consumer.position(m.tp)))
        self.heard.update({first} if first else set())
        return kept

    def highwater(self):
        return {tp: end for tp, end in self.consumer.highwater().items() if tp in self.heard}

    def __getattr__(self, name):
        return getattr(self.consumer, name)


class NeverRead:
    """An end watcher whose first read has not come yet (it runs every ENDS_EVERY_S on a thread of its own)."""

    def ends(self):
        return {}

    def begins(self):
        return {}

    def close(self):
        pass


def test_a_partition_not_heard_from_yet_holds_the_joins_clock(backend, monkeypatch):
    """A learner restarted over a backlog polled its interactions partition first, before its end watcher's
    first read and before any fetch of the rewards partition had been parsed: the rewards partition, not
    heard from, did not hold the clock, which the interactions moved 25 minutes on, and their windows
    closed with every reward unread (a live resume dropped 620 rewarded interactions)."""
    feed = _started_on_backlog(InMemoryBackend(KafkaConfig(partitions=1)), monkeypatch, 50, reward_after_s=1.0)
    joiner = feed.joiner
    feed.ends.close()
    feed.ends = NeverRead()
    feed.consumer = HeardWhenPolled(feed.consumer)
    for _ in range(6):
        feed.poll()
    assert (joiner.counters.joined, joiner.counters.dropped_no_reward, joiner.counters.expired_rewards) == (50, 0, 0)
    feed.close()


@pytest.mark.parametrize("hold_over", [False, True], ids=["holding", "hold-over"])
def test_a_partition_never_heard_from_holds_the_clock_only_for_a_while(monkeypatch, caplog, hold_over):
    """A partition offline (its only replica's broker down) is never heard from: holding the clock for it
    for good, no reward window closed, and nothing was defaulted or timed out."""
    backend = InMemoryBackend(KafkaConfig(partitions=1))
    feed = _started_on_backlog(backend, monkeypatch, 10, reward_after_s=1.0)
    feed.joiner.cfg = feed.joiner.cfg.model_copy(update={"on_missing": "default"})
    feed.ends.close()
    feed.ends = NeverRead()
    feed.consumer = HeardWhenPolled(feed.consumer)
    feed.consumer.seek(TopicPartition(backend.cfg.topics.rewards, 0), 10)  # its rewards: never fetched
    if hold_over:
        feed.unheard_until = time.monotonic() - 1.0
    with caplog.at_level("WARNING", logger="trainer.feed"):
        for _ in range(3):
            feed.poll()
    if hold_over:
        assert feed.joiner.counters.defaulted == 7  # windows of 60 s, one every 30 s: all but the newest 3 closed
        assert "not heard from 30 s after joining the group" in caplog.text
    else:
        assert feed.joiner.counters.defaulted == 0 and feed.joiner.watermark is None
    feed.close()


def test_two_ranks_do_not_count_a_parent_its_continuation_trains_as_a_unit():
    """A ready parent and its ready continuation counted as two units: the step of two ranks popped
    the continuation alone (it trains the parent's turn) and dropped it as too few for the ranks."""
    joiner = parent_ready_beside_its_continuation(RewardConfig(window_s=10.0, on_missing="drop"))
    counters = {name: 0.0 for name in COUNTERS}
    feed = Feed(Config().trainer.model_copy(update={"min_rollouts": 1}), KafkaConfig().topics, joiner,
                InMemoryBackend().producer(), {}, counters, vocab_size=1000, group_size=1, stop=threading.Event())
    assert feed.take(world_size=2) is None and counters["too_few_for_ranks"] == 0
    assert [r.interaction_id for r in feed.take(world_size=1)] == ["c2"]


def _feed_on(backend: StreamBackend, **trainer) -> Feed:
    cfg = Config()
    return Feed(cfg.trainer.model_copy(update=trainer), backend.cfg.topics, RewardJoiner(cfg.reward),
                backend.producer(), {}, {name: 0.0 for name in COUNTERS}, vocab_size=64, group_size=1,
                stop=threading.Event())


def test_under_backpressure_the_feed_polls_paused_and_its_consumer_stays_in_the_group():
    """The feed stopped polling while READY_BACKLOG_STEPS steps were ready; its consumer was dropped
    from the group after max.poll.interval.ms, and the next commit crashed the learner."""
    from trainer.feed import READY_BACKLOG_STEPS

    backend = InMemoryBackend(KafkaConfig(partitions=1), max_poll_interval_s=1.0)
    feed = _feed_on(backend, max_rollouts_per_step=1)  # held back from 4 ready rollouts on
    feed.start(backend)
    topics, producer, now = backend.cfg.topics, backend.producer(), time.time()
    for i in range(READY_BACKLOG_STEPS + 1):
        publish(producer, topics.interactions, make_interaction(f"i{i}", created_at=now))
        publish(producer, topics.rewards, make_reward(f"i{i}", 1.0))
    feed.poll()
    assert feed.joiner.ready_rollouts() == 5 and feed.counters["records_read"] == 10
    publish(producer, topics.interactions, make_interaction("later", created_at=now))
    deadline = time.monotonic() + 2.5  # well past the group's poll interval
    while time.monotonic() < deadline:
        feed.poll()
        time.sleep(0.05)
    assert feed.counters["records_read"] == 10  # held back: nothing read
    feed.commit(dict(feed.offsets))  # a member still: taken at once
    feed.joiner.pop_ready(max_rollouts=5, token_budget=10**6)
    feed.poll()  # no longer held back: resumed
    assert feed.counters["records_read"] == 11 and feed.joiner.num_waiting == 1
    feed.close()
    again = backend.consumer([topics.interactions, topics.rewards], group_id=Config().trainer.consumer_group)
    assert {tp.topic: again.position(tp) for tp in again.assignment()} == {topics.interactions: 5, topics.rewards: 5}


def _steps_on_a_thousand_rated_interactions(feed: Feed, backend: InMemoryBackend, world_size: int) -> int:
    feed.start(backend)
    topics, producer, now = backend.cfg.topics, backend.producer(), time.time()
    for i in range(1000):
        publish(producer, topics.interactions, make_interaction(f"i{i}", created_at=now))
        publish(producer, topics.rewards, make_reward(f"i{i}", 1.0))
    steps = 0
    for _ in range(200):  # a learner's loop: poll, then a step if one can start
        feed.poll()
        steps += feed.take(world_size) is not None
    return steps


def test_backpressure_leaves_min_rollouts_above_four_steps_in_reach():
    """min_rollouts 64 above READY_BACKLOG_STEPS x 8: the feed paused its partitions with 32 to 63 ready
    and, with no max_wait_s and a token budget out of reach, no step ever started again; the records
    it needed sat unread."""
    backend = InMemoryBackend(KafkaConfig(partitions=1))
    feed = _feed_on(backend, min_rollouts=64, max_rollouts_per_step=8, max_wait_s=None, token_budget=10**6,
                    poll_timeout_s=0.01)
    steps = _steps_on_a_thousand_rated_interactions(feed, backend, world_size=1)
    assert feed.unread() == {backend.cfg.topics.interactions: 0, backend.cfg.topics.rewards: 0}
    assert feed.joiner.ready_rollouts() < 64 and steps == (1000 - feed.joiner.ready_rollouts()) // 8
    feed.close()


def test_backpressure_leaves_a_unit_for_each_rank_in_reach():
    """Eight ranks, max_rollouts_per_step 1: the feed paused with four ready, and a step of eight ranks,
    which needs a rollout for each, never started."""
    backend = InMemoryBackend(KafkaConfig(partitions=1))
    feed = _feed_on(backend, min_rollouts=1, max_rollouts_per_step=1, max_wait_s=None, poll_timeout_s=0.01)
    steps = _steps_on_a_thousand_rated_interactions(feed, backend, world_size=8)
    assert feed.unread() == {backend.cfg.topics.interactions: 0, backend.cfg.topics.rewards: 0}
    assert steps == 1000 // 8 and feed.joiner.ready_rollouts() == 0
    feed.close()


def test_grpo_without_a_group_timeout_holds_no_more_than_max_pending_of_incomplete_groups():
    """Unique prompts, grpo groups of 4, no group timeout: every member sat in the join's ready buffer,
    unseen by the backpressure (which counts what a step could take), and the buffer grew with every
    record read (each readiness check scanning it all)."""
    backend = InMemoryBackend(KafkaConfig(partitions=1))
    cfg = Config()
    joiner = RewardJoiner(cfg.reward.model_copy(update={"group_timeout_s": None}), max_pending=50)
    feed = Feed(cfg.trainer.model_copy(update={"poll_timeout_s": 0.01}), backend.cfg.topics, joiner,
                backend.producer(), {}, {name: 0.0 for name in COUNTERS}, vocab_size=2048, group_size=4,
                stop=threading.Event())
    feed.start(backend)
    topics, producer = backend.cfg.topics, backend.producer()
    held, trained = [], 0
    for batch in range(100):  # traffic: 10 rated answers to new prompts (token ids to 1006) between two polls
        for i in range(10 * batch, 10 * batch + 10):
            publish(producer, topics.interactions,
                    make_interaction(f"i{i}", prompt=(5, 6, 7 + i), created_at=time.time()))
            publish(producer, topics.rewards, make_reward(f"i{i}", 1.0))
        feed.poll()
        held.append(len(joiner._ready))
        trained += len(feed.take(world_size=1) or [])
    assert joiner.counters.joined == 1000 and trained == 1000 - 50
    # max_pending members of incomplete groups, and the oldest of them handed out as they are
    assert max(held) <= 50 + 10 and joiner.counters.incomplete_groups == 1000 - 50
    feed.close()


def test_a_commit_refused_after_a_long_step_rejoins_and_reads_on_from_the_feeds_own_offsets():
    """A step (or checkpoint) longer than the group's poll interval: the group dropped the consumer and
    refused the commit after it, and the learner crashed. The feed rejoins and commits again; the rejoin
    put the partitions back at the group's committed offsets, and the feed puts them back at its own."""
    backend = InMemoryBackend(KafkaConfig(partitions=1), max_poll_interval_s=1.0)
    feed = _feed_on(backend)
    feed.start(backend)
    topics, producer, now = backend.cfg.topics, backend.producer(), time.time()
    interactions, rewards = TopicPartition(topics.interactions, 0), TopicPartition(topics.rewards, 0)
    for i in range(5):
        publish(producer, topics.interactions, make_interaction(f"i{i}", created_at=now))
    feed.poll()
    assert feed.offsets == {interactions: 5, rewards: 0}
    checkpointed = {interactions: 2, rewards: 0}  # staged before the last records were read
    for i in range(5, 8):  # logged during the step, not read yet
        publish(producer, topics.interactions, make_interaction(f"i{i}", created_at=now))
    time.sleep(2.0)  # the step: no poll
    feed.commit(checkpointed)  # its rejoining poll fetched offsets 2-7; none of them is consumed
    assert feed.consumer.position(interactions) == 5  # the feed's own next offset, not the committed 2
    feed.poll()
    assert feed.counters["records_read"] == 8 and feed.joiner.num_waiting == 8  # i5-i7 once, i2-i4 not again
    feed.close()
    again = backend.consumer([topics.interactions, topics.rewards], group_id=Config().trainer.consumer_group)
    assert again.position(interactions) == 2  # the commit landed


@pytest.mark.kafka
def test_a_commit_refused_after_a_long_step_is_made_again_on_the_broker(kafka_config, monkeypatch):
    """The same on Kafka, its poll interval shortened to 3 s: kafka-python's CommitFailedError crashed
    the learner."""
    monkeypatch.setattr("streams.kafka_backend.MAX_POLL_INTERVAL_MS", 3000)
    backend = KafkaBackend(kafka_config)
    feed = _feed_on(backend)
    feed.start(backend)
    topics, producer, now = kafka_config.topics, backend.producer(), time.time()
    try:
        _log_and_read_three(feed, producer, topics, now)
        checkpointed = dict(feed.offsets)
        for i in range(3, 5):  # logged during the step, not read yet
            publish(producer, topics.interactions, make_interaction(f"i{i}", created_at=now))
        producer.flush(10)
        time.sleep(9.0)  # past the poll interval, and the heartbeat thread's next look (3 s)
        feed.commit(checkpointed)  # its rejoining poll fetches from the start (nothing committed): not consumed
        assert {tp: feed.consumer.position(tp) for tp in feed.consumer.assignment()} == feed.offsets
        deadline = time.monotonic() + 20
        while feed.counters["records_read"] < 5 and time.monotonic() < deadline:
            feed.poll()
        feed.poll()
        assert feed.counters["records_read"] == 5 and feed.joiner.num_waiting == 5
    finally:
        producer.close()
        feed.close()


def _two_rank_feed(backend: InMemoryBackend, group_size: int = 1) -> Feed:
    """A started feed of a model of 64 token ids whose steps start on one ready unit."""
    cfg = Config()
    feed = Feed(cfg.trainer.model_copy(update={"min_rollouts": 1, "poll_timeout_s": 0.01}), backend.cfg.topics,
                RewardJoiner(cfg.reward), backend.producer(), {}, {name: 0.0 for name in COUNTERS}, vocab_size=64,
                group_size=group_size, stop=threading.Event())
    feed.start(backend)
    return feed


def _log_rated(feed: Feed, backend: InMemoryBackend, interactions: list) -> None:
    topics, producer = backend.cfg.topics, backend.producer()
    for interaction in interactions:
        publish(producer, topics.interactions, interaction)
        publish(producer, topics.rewards, make_reward(interaction.interaction_id, 1.0))
    feed.poll()


def test_two_ranks_lose_no_usable_rollout_taken_beside_ones_that_train_nothing():
    """Two ranks, a usable rollout ready beside one with a token id outside the vocabulary and one
    without an action token: the step took all three, left two out, had one unit for two ranks and
    dropped it (too_few_for_ranks); the join had recorded it as trained, so it never trained."""
    backend = InMemoryBackend(KafkaConfig(partitions=1))
    feed = _two_rank_feed(backend)
    now = time.time()
    _log_rated(feed, backend, [make_interaction("good", created_at=now),
                               make_interaction("outside", response=(8, 9, 64), created_at=now),
                               make_interaction("no-action", response=(8,), mask=(False,), created_at=now)])
    assert feed.take(world_size=2) is None
    assert (feed.counters["invalid_rollouts"], feed.counters["empty_rollouts"]) == (1, 1)
    assert feed.counters["too_few_for_ranks"] == 0 and feed.joiner.ready_rollouts() == 1
    _log_rated(feed, backend, [make_interaction("later", created_at=now)])
    taken = feed.take(world_size=2)
    assert taken is not None and sorted(r.interaction_id for r in taken) == ["good", "later"]
    feed.close()


def test_a_refused_interaction_is_finished_so_its_copy_is_a_duplicate_and_its_reward_late():
    """An interaction that can train nothing, sent twice (at least once) and rated: refused before the
    join, the copy was refused and counted again and its reward held as early, for an interaction that
    never comes, until it expired (taking a place among max_pending held rewards meanwhile)."""
    backend = InMemoryBackend(KafkaConfig(partitions=1))
    feed = _two_rank_feed(backend)
    outside = make_interaction("outside", response=(8, 9, 64), created_at=time.time())
    producer, topics = backend.producer(), backend.cfg.topics
    publish(producer, topics.interactions, outside)
    publish(producer, topics.interactions, outside)
    publish(producer, topics.rewards, make_reward("outside", 1.0))
    feed.poll()
    joined = feed.joiner.counters
    assert feed.counters["invalid_rollouts"] == 1 and joined.duplicate_interactions == 1
    assert (joined.early_rewards, feed.joiner.num_held_rewards, joined.late_rewards) == (0, 0, 1)
    feed.close()


def test_two_ranks_lose_no_grpo_group_taken_beside_one_that_trains_nothing():
    """grpo groups of two, two ranks: a group whose answers both have a token id outside the vocabulary
    beside a usable group. The step took both groups, left the first out whole, and dropped the
    usable group with it."""
    backend = InMemoryBackend(KafkaConfig(partitions=1))
    feed = _two_rank_feed(backend, group_size=2)
    now = time.time()
    _log_rated(feed, backend, [make_interaction(f"a{k}", prompt=(1, 2), response=(8, 99), created_at=now)
                               for k in range(2)] +
               [make_interaction(f"b{k}", prompt=(3, 4), created_at=now) for k in range(2)])
    assert feed.take(world_size=2) is None and feed.counters["invalid_rollouts"] == 2
    assert feed.counters["too_few_for_ranks"] == 0 and feed.joiner.ready_units(2) == 1
    _log_rated(feed, backend, [make_interaction(f"c{k}", prompt=(5, 6), created_at=now) for k in range(2)])
    taken = feed.take(world_size=2)
    assert taken is not None and sorted(r.interaction_id for r in taken) == ["b0", "b1", "c0", "c1"]
    feed.close()


def test_a_lone_ready_rollout_on_two_ranks_waits_and_says_so_once(caplog):
    """A lone rewarded answer under torchrun waited for a second one (every rank needs a unit) with no
    word of why, while trainer.max_wait_s said a step would start."""
    backend = InMemoryBackend(KafkaConfig(partitions=1))
    feed = _two_rank_feed(backend)
    now = time.time()
    _log_rated(feed, backend, [make_interaction("lone", created_at=now)])

    with caplog.at_level("INFO", logger="trainer.feed"):
        assert feed.take(world_size=2) is None
        assert feed.take(world_size=2) is None
    waits = [r.getMessage() for r in caplog.records if "waiting for more traffic" in r.getMessage()]
    assert waits == ["a step is due but 1 unit(s) of rollouts are ready for 2 ranks (each rank needs one): "
                     "waiting for more traffic"]

    _log_rated(feed, backend, [make_interaction("second", created_at=now)])
    taken = feed.take(world_size=2)
    assert taken is not None and sorted(r.interaction_id for r in taken) == ["lone", "second"]
    feed.close()
