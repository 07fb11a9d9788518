"""Dead-lettering under fuzzed input: every rejected record becomes a DeadLetter with its reason.

Unit level (hypothesis, a recording producer): random bytes and mutated valid records of every
kind go through :func:`streams.records.decode_or_dead_letter` for every expected kind. It never
raises on bad data; a record it refuses is sent, exactly once, as a valid DeadLetter keyed like
the original, holding the original bytes, its topic, partition and offset and the codec's reason;
a record it accepts is returned and nothing is sent. On the real broker: mutated records sent to
the real interactions and rewards topics are consumed and dead-lettered the way the learner does
it, and read back from the dead-letter topic with their reasons.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from online_sao.schemas import (MAX_RECORD_BYTES, DeadLetter, Interaction, RecordError, Reward, WeightsNotice,
                                decode, encode)
from streams.base import DeliveryReport, Producer, StreamMessage
from streams.kafka_backend import KafkaBackend
from streams.records import (MAX_DEAD_LETTER_RAW_BYTES, MAX_REASON_CHARS, decode_or_dead_letter, publish)
from tests.fixtures.kafka import drain
from tests.online_sao.test_schemas_fuzz import any_record, mutate_record

DEAD_LETTERS = "t.dead-letters"
KINDS = [Interaction, Reward, WeightsNotice]
"""Kinds consumers decode: the learner (interactions, rewards), serving's follower (weights)."""
FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass
class RecordingProducer(Producer):
    sent: list[tuple[str, bytes, bytes | None]] = field(default_factory=list)

    def send(self, topic: str, value: bytes, key: bytes | None = None,
             on_delivery: DeliveryReport | None = None) -> None:
        self.sent.append((topic, value, key))

    def flush(self, timeout_s: float | None = None) -> None:
        pass

    def close(self) -> None:
        pass


def _message(value: bytes, key: bytes | None) -> StreamMessage:
    return StreamMessage(topic="t.source", partition=3, offset=17, key=key, value=value, timestamp_ms=1)


def _timeless(record):
    """The record with its time stamps zeroed (a missing one defaults to the time of decoding)."""
    stamps = {k: 0.0 for k in ("created_at", "completed_at") if k in type(record).model_fields}
    return record.model_copy(update=stamps)


def _check_one(value: bytes, key: bytes | None, kind: type) -> None:
    producer = RecordingProducer()
    message = _message(value, key)
    result = decode_or_dead_letter(message, kind, producer, DEAD_LETTERS)
    try:
        expected = decode(value, kind)
    except RecordError as exc:
        reason = str(exc)
    else:
        assert _timeless(result) == _timeless(expected) and producer.sent == []
        return
    assert result is None
    [(topic, sent, sent_key)] = producer.sent
    assert (topic, sent_key) == (DEAD_LETTERS, key)
    assert len(sent) <= MAX_RECORD_BYTES
    letter = decode(sent, DeadLetter)  # the dead letter itself is a valid record
    assert (letter.source_topic, letter.partition, letter.offset) == ("t.source", 3, 17)
    assert letter.raw == value[:MAX_DEAD_LETTER_RAW_BYTES]
    assert letter.reason == reason or (len(reason) > MAX_REASON_CHARS - 100 and letter.reason.endswith("..."))


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
@FUZZ
@given(value=st.binary(max_size=1_000), key=st.none() | st.binary(max_size=20))
def test_random_bytes_are_dead_lettered_with_the_reason(kind, value, key):
    _check_one(value, key, kind)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
@settings(FUZZ, max_examples=150)
@given(record=any_record, data=st.data(), key=st.none() | st.binary(max_size=20))
def test_mutated_records_are_dead_lettered_with_the_reason(kind, record, data, key):
    _check_one(mutate_record(json.loads(encode(record)), data), key, kind)


def test_an_unprintable_reason_still_makes_a_valid_dead_letter():
    """Reasons quote what was wrong; a lone surrogate or NUL in the input must not break the letter."""
    for value in (b'{"schema_version":"\\ud800"}', b'{"schema_version":1,"kind":"\\ud800\\u0000"}',
                  json.dumps({"schema_version": 1, "kind": "reward", "interaction_id": "\ud800", "value": 1}).encode()):
        for kind in KINDS:
            _check_one(value, b"k", kind)


@pytest.mark.parametrize("kind, value, reason", [
    (Reward, b'{"schema_version":1,"kind":"reward","interaction_id":"i-1","value":true}',
     "invalid record: value: Input should be a valid number"),
    (Reward, b'{"schema_version":1,"kind":"reward","interaction_id":"i-1","value":"0.5"}',
     "invalid record: value: Input should be a valid number"),
    (Reward, b'{"schema_version":1,"kind":"reward","interaction_id":"i-1","value":1,'
             b'"turn_rewards":[{"turn":1.0,"value":1}]}',
     "invalid record: turn_rewards.0.turn: Input should be a valid integer"),
    (Interaction, b'{"schema_version":1,"kind":"interaction","interaction_id":"i-1","model":"m","prompt_ids":[1],'
                  b'"response_ids":[2],"action_mask":["true"],"logprobs":[-0.5],"versions":[0]}',
     "invalid record: action_mask.0: Input should be a valid boolean"),
    (Reward, b'{"schema_version":1,"kind":"interaction","interaction_id":"i-1","value":1}',
     "expected a Reward record, got kind 'interaction'"),
])
def test_wrong_json_types_and_kinds_are_dead_lettered_with_the_reason(kind, value, reason):
    """An integrator's record with a boolean or string for a number (or a float for an integer, or the
    wrong kind) is dead-lettered saying so: it was coerced and trained (true as a reward of 1.0)."""
    producer = RecordingProducer()
    assert decode_or_dead_letter(_message(value, b"i-1"), kind, producer, DEAD_LETTERS) is None
    [(_, sent, _)] = producer.sent
    assert decode(sent, DeadLetter).reason == reason
    _check_one(value, b"i-1", kind)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
def test_a_tombstone_is_dead_lettered_not_raised(kind):
    """Kafka hands a null value (a tombstone, e.g. sent to "erase" a key) over as None; it used to
    raise TypeError out of decode_or_dead_letter and stop the learner."""
    producer = RecordingProducer()
    message = StreamMessage(topic="t.source", partition=0, offset=5, key=b"i-1", value=None, timestamp_ms=1)
    assert decode_or_dead_letter(message, kind, producer, DEAD_LETTERS) is None
    [(_, sent, key)] = producer.sent
    letter = decode(sent, DeadLetter)
    assert (key, letter.raw, letter.reason) == (b"i-1", b"", "record has no value (a tombstone)")
    with pytest.raises(RecordError, match="tombstone"):
        decode(None, kind)


# ----------------------------------------------------------------------------- real broker

INTERACTION = Interaction(interaction_id="i-ok", model="m", prompt_ids=[1, 2], response_ids=[3],
                          action_mask=[True], logprobs=[-0.5], versions=[1], created_at=1.0, completed_at=2.0)
REWARD = Reward(interaction_id="i-ok", value=0.5, created_at=3.0)


def _obj(record) -> dict:
    return json.loads(encode(record))


BAD = {
    "interactions": [
        (b"i-1", b"\xff\xfe not json", "not a JSON record"),
        (b"i-2", encode(REWARD), "expected a Interaction record, got kind 'reward'"),
        (b"i-3", json.dumps({**_obj(INTERACTION), "versions": [2**63]}).encode(), "versions"),
        (b"i-4", encode(INTERACTION)[:-7], "not a JSON record"),
        (None, json.dumps({**_obj(INTERACTION), "action_mask": [True, True]}).encode(), "action_mask has 2 entries"),
        (b"i-8", None, "record has no value (a tombstone)"),
    ],
    "rewards": [
        (b"i-5", json.dumps({**_obj(REWARD), "value": 1e30}).encode(), "value"),
        (b"i-6", json.dumps({**_obj(REWARD), "schema_version": 2}).encode(), "unknown schema_version 2"),
        (b"i-7", json.dumps({**_obj(REWARD), "value": "NaN"}).encode(), "value"),
    ],
}
"""Mutated records per topic: (key, bytes or None for a tombstone, what the dead letter's reason says)."""


@pytest.mark.kafka
def test_mutated_records_on_the_real_topics_come_back_as_dead_letters(kafka_config):
    backend = KafkaBackend(kafka_config)
    topics = kafka_config.topics
    producer = backend.producer()
    try:
        sent = {topics.interactions: BAD["interactions"], topics.rewards: BAD["rewards"]}
        for topic, bad in sent.items():
            for key, value, _ in bad:
                producer.send(topic, value, key=key)
        publish(producer, topics.interactions, INTERACTION)
        publish(producer, topics.rewards, REWARD)
        producer.flush(30.0)
        total = sum(len(bad) for bad in sent.values()) + 2

        # what the learner does with each record it polls (trainer/feed.py)
        consumer = backend.consumer([topics.interactions, topics.rewards])
        try:
            messages = drain(consumer, total, timeout_s=60.0)
        finally:
            consumer.close()
        assert len(messages) == total
        accepted = []
        for message in messages:
            kind = Interaction if message.topic == topics.interactions else Reward
            record = decode_or_dead_letter(message, kind, producer, topics.dead_letters)
            if record is not None:
                accepted.append(record)
        producer.flush(30.0)
    finally:
        producer.close()
    assert sorted(accepted, key=lambda r: r.kind) == [INTERACTION, REWARD]

    reader = backend.consumer([topics.dead_letters])
    try:
        letters = drain(reader, total - 2, timeout_s=60.0)
        time.sleep(0.5)
        letters += reader.poll(timeout_s=1.0)  # nothing else arrives
    finally:
        reader.close()
    by_source = {(m.value, m.key): decode(m.value, DeadLetter) for m in letters}
    assert len(by_source) == total - 2
    originals = {(m.topic, m.value, m.key): m for m in messages}
    found = {(d.source_topic, d.raw, key): d for (_, key), d in by_source.items()}
    for topic, bad in sent.items():
        for key, value, reason in bad:
            letter = found[(topic, value or b"", key)]
            assert reason in letter.reason, letter.reason
            source = originals[(topic, value, key)]
            assert (letter.partition, letter.offset) == (source.partition, source.offset)
