"""One contract for every StreamBackend: the in-memory backend must behave like Kafka.

Each test runs against InMemoryBackend and against KafkaBackend on the session's real
broker (the ``kafka`` parameter, marked ``kafka``).
"""

from __future__ import annotations

import time

import pytest

from online_sao.schemas import DeadLetter, Interaction, Reward, WeightsNotice, decode
from streams.base import StreamBackend, TopicPartition
from streams.memory import partition_for_key
from streams.records import decode_or_dead_letter, publish
from streams.tail import records_since
from tests.fixtures.kafka import TEST_PARTITIONS, drain


def _topics(backend: StreamBackend):
    return backend.cfg.topics


def _interaction(iid: str, version: int = 1) -> Interaction:
    return Interaction(interaction_id=iid, model="m", prompt_ids=[1, 2, 3], response_ids=[4, 5, 6],
                       action_mask=[True, False, True], logprobs=[-0.5, -1.25], versions=[version, version],
                       turn_ends=[2], user_id="u", session_id="s", prompt_text="hi", response_text="yo")


def test_every_record_kind_round_trips(backend):
    t = _topics(backend)
    sent = {
        t.interactions: _interaction("i-1"),
        t.rewards: Reward(interaction_id="i-1", value=0.75, source="judge",
                          turn_rewards=[{"turn": 0, "value": 0.5}]),
        t.weights: WeightsNotice(version=3, location="file:///w/3", checksum="ab" * 32, step=7,
                                 metrics={"loss": 0.25}),
        t.dead_letters: DeadLetter(raw=b"\x00\xffnot json", source_topic=t.rewards, partition=1, offset=9,
                                   reason="not a JSON record"),
    }
    producer = backend.producer()
    for topic, record in sent.items():
        publish(producer, topic, record)
    producer.flush(10)
    consumer = backend.consumer(list(sent))
    got = {m.topic: decode(m.value) for m in drain(consumer, len(sent))}
    consumer.close()
    producer.close()
    assert got == sent


def test_keys_place_records_like_kafkas_default_partitioner(backend):
    t = _topics(backend)
    keys = [f"interaction-{i}".encode() for i in range(12)]
    producer = backend.producer()
    for key in keys:
        producer.send(t.interactions, b"i", key=key)
        producer.send(t.rewards, b"r", key=key)
    producer.flush(10)
    consumer = backend.consumer([t.interactions, t.rewards])
    messages = drain(consumer, 2 * len(keys))
    consumer.close()
    producer.close()
    placed = {(m.topic, m.key): m.partition for m in messages}
    assert len(placed) == 2 * len(keys)
    for key in keys:
        expected = partition_for_key(key, TEST_PARTITIONS)
        assert placed[(t.interactions, key)] == expected
        assert placed[(t.rewards, key)] == expected  # co-partitioned
    assert len({placed[(t.interactions, k)] for k in keys}) > 1


def test_offsets_count_up_per_partition_in_send_order(backend):
    t = _topics(backend)
    producer = backend.producer()
    for i in range(5):
        producer.send(t.interactions, str(i).encode(), key=b"same-key")
    producer.flush(10)
    consumer = backend.consumer([t.interactions])
    messages = drain(consumer, 5)
    consumer.close()
    producer.close()
    assert [m.value for m in messages] == [b"0", b"1", b"2", b"3", b"4"]
    assert [m.offset for m in messages] == [0, 1, 2, 3, 4]
    assert len({m.partition for m in messages}) == 1
    assert all(m.timestamp_ms > 0 for m in messages)


def test_consumer_without_group_gets_every_partition_and_can_seek(backend):
    t = _topics(backend)
    producer = backend.producer()
    producer.send(t.interactions, b"old", key=b"k")
    producer.flush(10)
    consumer = backend.consumer([t.interactions, t.rewards], start="latest")
    assert consumer.assignment() == ({TopicPartition(t.interactions, p) for p in range(TEST_PARTITIONS)}
                                     | {TopicPartition(t.rewards, p) for p in range(TEST_PARTITIONS)})
    producer.send(t.interactions, b"new", key=b"k")
    producer.flush(10)
    first = drain(consumer, 1)
    assert [m.value for m in first] == [b"new"]
    consumer.seek(first[0].tp, 0)
    assert [m.value for m in drain(consumer, 2)] == [b"old", b"new"]
    with pytest.raises(ValueError):
        consumer.commit({first[0].tp: 1})
    with pytest.raises(ValueError):
        consumer.seek(TopicPartition(t.weights, 0), 0)
    consumer.close()
    producer.close()


def test_consumer_group_resumes_from_committed_offsets(backend):
    t = _topics(backend)
    producer = backend.producer()
    for i in range(6):
        producer.send(t.rewards, str(i).encode(), key=f"k{i}".encode())
    producer.flush(10)

    first = backend.consumer([t.rewards], group_id="g-resume")
    read = drain(first, 6)
    assert sorted(m.value for m in read) == [str(i).encode() for i in range(6)]
    # Commit only up to and including the first record of each partition.
    firsts = {}
    for m in read:
        firsts.setdefault(m.tp, m)
    first.commit({tp: m.offset + 1 for tp, m in firsts.items()})
    first.close()

    second = backend.consumer([t.rewards], group_id="g-resume")
    again = drain(second, 6 - len(firsts))
    assert sorted(m.value for m in again) == sorted(m.value for m in read if m not in firsts.values())
    assert second.poll(timeout_s=0.5) == []
    second.close()
    producer.close()


def test_position_is_where_the_next_read_starts(backend):
    """Where it was put, else the group's committed offset, else where ``start`` puts a new consumer
    (the learner's feed counts a partition's unread records from it)."""
    t = _topics(backend)
    producer = backend.producer()
    for i in range(4):
        producer.send(t.rewards, str(i).encode(), key=b"one partition")
    producer.flush(10)
    first = backend.consumer([t.rewards], group_id="g-position")
    tp = drain(first, 4)[0].tp
    assert first.position(tp) == 4
    first.seek(tp, 1)
    assert first.position(tp) == 1
    first.commit({tp: 4})
    first.close()
    second = backend.consumer([t.rewards], group_id="g-position", start="earliest")
    deadline = time.monotonic() + 60
    while not second.assignment() and time.monotonic() < deadline:
        assert second.poll(timeout_s=0.5) == []  # nothing after the committed offset
    assert second.position(tp) == 4
    assert {second.position(other) for other in second.assignment() - {tp}} <= {0}  # empty, never committed
    second.close()
    for start, expected in (("earliest", 0), ("latest", 4)):
        reader = backend.consumer([t.rewards], start=start)
        assert reader.position(tp) == expected
        with pytest.raises(ValueError):
            reader.position(TopicPartition(t.weights, 0))
        reader.close()
    producer.close()


def test_a_group_gives_partition_p_of_both_topics_to_one_member(backend):
    """The join needs an interaction and its rewards (co-partitioned by id) in one member; the in-memory
    backend dealt all partitions round-robin and split them."""
    t = _topics(backend)
    topics = [t.interactions, t.rewards]
    members = [backend.consumer(topics, group_id="g-copartition") for _ in range(2)]
    deadline = time.monotonic() + 60
    shares: list[set[TopicPartition]] = [set(), set()]
    while time.monotonic() < deadline:
        for member in members:
            member.poll(timeout_s=0.2)
        shares = [member.assignment() for member in members]
        if all(shares) and len(shares[0] | shares[1]) == 2 * TEST_PARTITIONS:
            break
    assert all(shares) and not shares[0] & shares[1] and len(shares[0] | shares[1]) == 2 * TEST_PARTITIONS
    for share in shares:
        by_topic = {topic: {tp.partition for tp in share if tp.topic == topic} for topic in topics}
        assert by_topic[t.interactions] == by_topic[t.rewards]
    for member in members:
        member.close()


def test_new_group_starting_latest_skips_earlier_records(backend):
    t = _topics(backend)
    producer = backend.producer()
    producer.send(t.rewards, b"before", key=b"a")
    producer.flush(10)
    consumer = backend.consumer([t.rewards], group_id="g-latest", start="latest")
    # Kafka assigns partitions when the consumer joins its group, during polls.
    for _ in range(30):
        if consumer.poll(timeout_s=0.5) == [] and consumer.assignment():
            break
    assert consumer.assignment() == {TopicPartition(t.rewards, p) for p in range(TEST_PARTITIONS)}
    producer.send(t.rewards, b"after", key=b"a")
    producer.flush(10)
    assert [m.value for m in drain(consumer, 1)] == [b"after"]
    consumer.close()
    producer.close()


def test_bad_bytes_go_to_the_dead_letter_topic_with_the_reason(backend):
    t = _topics(backend)
    producer = backend.producer()
    publish(producer, t.rewards, Reward(interaction_id="good", value=1.0))
    producer.send(t.rewards, b"{not json", key=b"bad-1")
    producer.send(t.rewards, _interaction("wrong-kind").model_dump_json().encode(), key=b"bad-2")
    producer.flush(10)
    consumer = backend.consumer([t.rewards])
    decoded = [decode_or_dead_letter(m, Reward, producer, t.dead_letters) for m in drain(consumer, 3)]
    producer.flush(10)
    consumer.close()
    assert [r.interaction_id for r in decoded if r is not None] == ["good"]
    assert decoded.count(None) == 2

    letters_consumer = backend.consumer([t.dead_letters])
    letters = {m.key: decode(m.value, DeadLetter) for m in drain(letters_consumer, 2)}
    letters_consumer.close()
    producer.close()
    assert set(letters) == {b"bad-1", b"bad-2"}
    assert letters[b"bad-1"].raw == b"{not json"
    assert letters[b"bad-1"].source_topic == t.rewards
    assert "not a JSON record" in letters[b"bad-1"].reason
    assert "expected a Reward record, got kind 'interaction'" in letters[b"bad-2"].reason


def test_ensure_topics_is_idempotent_and_sizes_topics(backend):
    backend.ensure_topics()
    backend.ensure_topics()
    t = _topics(backend)
    counts = backend.describe_topics()
    assert counts[t.interactions] == counts[t.rewards] == TEST_PARTITIONS
    assert counts[t.weights] == 1
    assert counts[t.dead_letters] == 1
    assert {t.interactions, t.rewards, t.weights, t.dead_letters} <= set(backend.list_topics())


def test_delivery_reports_say_each_record_was_acknowledged(backend):
    t = _topics(backend)
    reports = []
    producer = backend.producer()
    for i in range(3):
        producer.send(t.interactions, b"v", key=str(i).encode(), on_delivery=reports.append)
    producer.flush(10)
    producer.close()
    assert reports == [None, None, None]


def test_records_since_reads_a_time_range_to_its_end(backend):
    t = _topics(backend)
    producer = backend.producer()
    before = [f"before-{i}".encode() for i in range(3)]
    after = [f"after-{i}".encode() for i in range(5)]
    for value in before:
        producer.send(t.rewards, value, key=value)
    producer.flush(10)
    time.sleep(0.05)  # record timestamps are in milliseconds
    since_ms = int(time.time() * 1000)
    time.sleep(0.05)
    for value in after:
        producer.send(t.rewards, value, key=value)
    producer.flush(10)
    producer.close()
    got = [m.value for m in records_since(backend, [t.rewards], since_ms, timeout_s=30)]
    assert set(after) <= set(got) and not set(before) & set(got)
    assert records_since(backend, [t.rewards], int(time.time() * 1000) + 60_000, timeout_s=30) == []
    # before the epoch (a spool entry whose bytes give no creation time reads from 0 - 60 s): every record;
    # the backends refuse a negative time, and serving's logger thread died of it
    assert set(before + after) <= {m.value for m in records_since(backend, [t.rewards], -60_000, timeout_s=30)}
    with pytest.raises(ValueError, match="negative"):
        backend.consumer([t.rewards], group_id=None).offsets_for_time(-1)


def test_highwater_is_each_partitions_end_as_the_last_poll_heard_it(backend):
    t = _topics(backend)
    producer = backend.producer()
    for i in range(5):
        producer.send(t.interactions, b"first", key=f"k{i}".encode())
    producer.flush(10)
    consumer = backend.consumer([t.interactions])
    assert len(drain(consumer, 5)) == 5
    assert consumer.highwater() == consumer.end_offsets()
    assert sum(consumer.highwater().values()) == 5
    assert consumer.beginning_offsets() == {tp: 0 for tp in consumer.assignment()}  # nothing deleted yet
    for i in range(3):
        producer.send(t.interactions, b"second", key=f"k{i}".encode())
    producer.flush(10)
    assert len(drain(consumer, 3)) == 3
    heard = consumer.highwater()
    consumer.close()
    producer.close()
    assert sum(heard.values()) == 8


def test_records_since_reads_a_range_longer_than_its_timeout_while_records_keep_coming(backend):
    """The timeout is on a stall, not on the whole read: a range that takes longer than it to read
    (a replica restarted after a long outage) is read to its end, not failed on every try."""
    t = _topics(backend)
    producer = backend.producer()
    for i in range(6):
        producer.send(t.rewards, f"r{i}".encode(), key=b"one-partition")
    producer.flush(10)
    producer.close()

    class Slow:  # the backend, with one record a poll and 0.1 s a poll: 0.6 s for a range, against 0.3 s
        def consumer(self, *args, **kwargs):
            inner = backend.consumer(*args, **kwargs)
            poll = inner.poll

            def slow_poll(timeout_s=1.0, max_records=500):
                time.sleep(0.1)
                return poll(timeout_s=timeout_s, max_records=1)

            inner.poll = slow_poll
            return inner

    got = records_since(Slow(), [t.rewards], 0, timeout_s=0.3)
    assert sorted(m.value for m in got) == [f"r{i}".encode() for i in range(6)]


def test_a_position_the_broker_cannot_give_is_unavailable_within_the_client_timeout(free_port):
    """kafka-python's position() without a timeout waited as long as the broker stayed away: the learner's
    start hung there, deaf to its stop."""
    from kafka import KafkaConsumer
    from kafka import TopicPartition as KafkaTP

    from streams.base import StreamUnavailable
    from streams.kafka_consumer import KafkaStreamConsumer

    address = f"127.0.0.1:{free_port}"  # nothing listens there
    client = KafkaConsumer(bootstrap_servers=address, group_id="g-position", enable_auto_commit=False,
                           request_timeout_ms=3000, api_version=(2, 5, 0))  # no version probe at construction
    client.assign([KafkaTP("t", 0)])
    consumer = KafkaStreamConsumer(client, "g-position", address, client_timeout_s=1.0)
    started = time.monotonic()
    with pytest.raises(StreamUnavailable, match=r"position of t\[0\] is not known within 1 s"):
        consumer.position(TopicPartition("t", 0))
    assert time.monotonic() - started < 30
    client.close()


OFFSET_LOOKUP_MAX_S = 10.0
"""Bound on an offset look-up with client_timeout_s 1 s against no broker (kafka-python's default 30 s
before; room for a loaded box)."""


@pytest.mark.parametrize("lookup", ["end_offsets", "beginning_offsets", "offsets_for_time"])
def test_an_offset_lookup_the_broker_cannot_answer_is_unavailable_within_the_client_timeout(free_port, lookup):
    """They waited kafka-python's request timeout (30 s) whatever client_timeout_s said: the learner's feed,
    which reads the ends at its start, sat there 30 s a call while the broker was down."""
    from kafka import KafkaConsumer
    from kafka import TopicPartition as KafkaTP

    from streams.base import StreamUnavailable
    from streams.kafka_consumer import KafkaStreamConsumer

    address = f"127.0.0.1:{free_port}"  # nothing listens there
    client = KafkaConsumer(bootstrap_servers=address, enable_auto_commit=False,
                           api_version=(2, 5, 0))  # no version probe at construction; request timeout 30 s
    client.assign([KafkaTP("t", 0)])
    consumer = KafkaStreamConsumer(client, None, address, client_timeout_s=1.0)
    calls = {"end_offsets": consumer.end_offsets, "beginning_offsets": consumer.beginning_offsets,
             "offsets_for_time": lambda: consumer.offsets_for_time(0)}
    started = time.monotonic()
    with pytest.raises(StreamUnavailable, match="not reachable"):
        calls[lookup]()
    assert time.monotonic() - started < OFFSET_LOOKUP_MAX_S
    client.close()


def test_a_commit_of_a_partition_that_does_not_exist_is_refused_at_once(backend):
    """A checkpoint's offsets of a topic made again with fewer partitions: Kafka's UNKNOWN_TOPIC_OR_PARTITION
    was retried for 30 s and raised as an unreachable broker, which the learner's feed waits out for ever;
    the in-memory backend took the commit."""
    t = _topics(backend)
    consumer = backend.consumer([t.rewards], group_id="g-no-such-partition")
    held = _assigned(consumer)
    gone = TopicPartition(t.rewards, TEST_PARTITIONS)
    started = time.monotonic()
    with pytest.raises(ValueError, match=rf"do not exist.*partition={TEST_PARTITIONS}"):
        consumer.commit({**{tp: 0 for tp in held}, gone: 5})
    with pytest.raises(ValueError, match="no-such-topic"):
        consumer.commit({TopicPartition("no-such-topic", 0): 1})
    assert time.monotonic() - started < OFFSET_LOOKUP_MAX_S
    consumer.commit({tp: 0 for tp in held})  # the partitions it has are committed as before
    consumer.close()


def _one_partition_with(backend: StreamBackend, count: int) -> str:
    """The rewards topic with ``count`` records, all on one partition (one key); returns the topic."""
    topic = _topics(backend).rewards
    producer = backend.producer()
    for i in range(count):
        producer.send(topic, str(i).encode(), key=b"one partition")
    producer.flush(10)
    producer.close()
    return topic


def _assigned(consumer, timeout_s: float = 60.0) -> set[TopicPartition]:
    """The consumer's partitions once it has some (a Kafka group member gets them while polling)."""
    deadline = time.monotonic() + timeout_s
    while not consumer.assignment() and time.monotonic() < deadline:
        consumer.poll(timeout_s=0.3)
    return consumer.assignment()


def test_a_paused_partition_returns_no_records_until_resumed(backend):
    """The learner's feed pauses its partitions under backpressure and goes on polling (a member that
    stops polling is dropped from its group)."""
    topic = _one_partition_with(backend, 3)
    consumer = backend.consumer([topic])
    tps = consumer.assignment()
    consumer.pause(tps)
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        assert consumer.poll(timeout_s=0.3) == []
    consumer.resume(tps)
    assert [m.value for m in drain(consumer, 3)] == [b"0", b"1", b"2"]
    with pytest.raises(ValueError):
        consumer.pause({TopicPartition(_topics(backend).weights, 0)})
    consumer.close()


RESET_WAIT_S = 20.0
"""Until a read reset a position past the end (Kafka's position stays the offset sought until then): a
record produced before the reset to "latest" would be skipped."""


@pytest.mark.parametrize("start, expected", [("earliest", [b"0", b"1", b"2", b"3"]), ("latest", [b"3"])])
def test_a_seek_past_the_end_is_reset_by_start_when_read(backend, start, expected):
    """Kafka's auto.offset.reset: a position past the end reads from the oldest record ("earliest") or
    from the end on ("latest"), then the record produced after the reset; the in-memory consumer waited at offset 10 and skipped records 3-9
    silently when they came."""
    topic = _one_partition_with(backend, 3)
    consumer = backend.consumer([topic], start=start)
    tp = TopicPartition(topic, partition_for_key(b"one partition", TEST_PARTITIONS))
    consumer.seek(tp, 10)
    got = drain(consumer, 3, timeout_s=5)
    deadline = time.monotonic() + RESET_WAIT_S
    while consumer.position(tp) > 3 and time.monotonic() < deadline:  # Kafka: still 10 until the read reset it
        got += consumer.poll(timeout_s=0.2)
    assert consumer.position(tp) <= 3, "the position past the end was not reset"  # "3" is produced after it
    producer = backend.producer()
    producer.send(topic, b"3", key=b"one partition")
    producer.flush(10)
    producer.close()
    got += drain(consumer, len(expected) - len(got), timeout_s=20)
    assert [m.value for m in got] == expected
    consumer.close()


@pytest.mark.parametrize("group", [None, "g-closed"])
def test_a_closed_consumer_holds_no_partitions_and_refuses_every_call(backend, group):
    """Kafka answered a closed consumer with its old assignment, IllegalStateError or 'NetworkSelector
    closed!' call by call; the in-memory one raised ValueError ('not in list') from assignment() and
    end_offsets(), and took a commit."""
    topic = _one_partition_with(backend, 1)
    consumer = backend.consumer([topic], group_id=group)
    tp = next(iter(_assigned(consumer)))
    consumer.close()
    assert consumer.assignment() == set()
    calls = [lambda: consumer.poll(timeout_s=0.1), consumer.end_offsets, consumer.beginning_offsets,
             consumer.highwater, lambda: consumer.offsets_for_time(0), lambda: consumer.seek(tp, 0),
             lambda: consumer.position(tp), lambda: consumer.pause({tp})]
    if group is not None:
        calls.append(lambda: consumer.commit({tp: 1}))
    for call in calls:
        with pytest.raises(RuntimeError, match="consumer is closed"):
            call()
    consumer.close()  # again: nothing happens
