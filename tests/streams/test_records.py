"""Typed helpers over the byte seam: keys, and dead letters that never raise on bad data."""

from __future__ import annotations

import os

import pytest

import streams.records
from online_sao.config import KafkaConfig, TopicsConfig
from online_sao.schemas import (MAX_RECORD_BYTES, DeadLetter, Interaction, RecordError, Reward, WeightsNotice, decode,
                                encode)
from streams.base import StreamMessage, TopicPartition
from streams.memory import InMemoryBackend
from streams.records import (MAX_DEAD_LETTER_KEY_BYTES, MAX_DEAD_LETTER_RAW_BYTES, dead_letter, decode_or_dead_letter,
                             publish, record_key, record_topic)

NON_UTF8_PATH = os.fsdecode(b"/data/sp\xffool/interactions.log")
"""A file name with a byte UTF-8 cannot read, as Python holds it: a lone surrogate (surrogateescape)."""
from tests.fixtures.kafka import drain


def _backend() -> tuple[InMemoryBackend, KafkaConfig]:
    cfg = KafkaConfig(partitions=2)
    backend = InMemoryBackend(cfg)
    backend.ensure_topics()
    return backend, cfg


def test_keys_are_interaction_ids_and_model_names():
    assert record_key(Reward(interaction_id="abc", value=1.0)) == b"abc"
    assert record_key(WeightsNotice(version=1, location="x", checksum="a" * 64, model="pol")) == b"pol"
    assert record_key(WeightsNotice(action="rollback", version=1, location="x", checksum="a" * 64,
                                    model="pol")) == b"pol"
    # compaction keeps the newest champion beside the newest serving notice
    assert record_key(WeightsNotice(action="champion", version=1, location="x", checksum="a" * 64,
                                    model="pol")) == b"pol#champion"
    assert record_key(DeadLetter(raw=b"", source_topic="t", reason="r")) is None


def test_each_kind_of_record_has_its_own_topic():
    topics = TopicsConfig(interactions="i", rewards="r", weights="w", dead_letters="d")
    interaction = Interaction(interaction_id="abc", model="m", prompt_ids=[1], response_ids=[2], action_mask=[True],
                              logprobs=[-0.5], versions=[0])
    assert record_topic(interaction, topics) == "i"
    assert record_topic(Reward(interaction_id="abc", value=1.0), topics) == "r"
    assert record_topic(WeightsNotice(version=1, location="x", checksum="a" * 64, model="pol"), topics) == "w"
    assert record_topic(DeadLetter(raw=b"", source_topic="t", reason="r"), topics) == "d"


def test_publish_encodes_and_keys_the_record():
    backend, cfg = _backend()
    producer = backend.producer()
    reward = Reward(interaction_id="abc", value=1.0)
    publish(producer, cfg.topics.rewards, reward)
    [message] = drain(backend.consumer([cfg.topics.rewards]), 1, timeout_s=1)
    assert (message.key, message.value) == (b"abc", encode(reward))


def test_an_oversize_payload_is_dead_lettered_truncated_not_raised():
    backend, cfg = _backend()
    producer = backend.producer()
    raw = b"x" * (MAX_RECORD_BYTES + 10)
    message = StreamMessage(topic=cfg.topics.rewards, partition=1, offset=7, key=b"k", value=raw, timestamp_ms=1)
    assert decode_or_dead_letter(message, Reward, producer, cfg.topics.dead_letters) is None
    [sent] = drain(backend.consumer([cfg.topics.dead_letters]), 1, timeout_s=1)
    letter = decode(sent.value, DeadLetter)
    assert len(sent.value) <= MAX_RECORD_BYTES
    assert letter.raw == raw[:MAX_DEAD_LETTER_RAW_BYTES]
    assert (letter.partition, letter.offset, sent.key) == (1, 7, b"k")
    assert letter.reason.startswith(f"record of {len(raw)} bytes exceeds {MAX_RECORD_BYTES}")
    assert letter.reason.endswith(f"(raw truncated to {MAX_DEAD_LETTER_RAW_BYTES} of {len(raw)} bytes)")


def test_a_dead_letter_fits_a_broker_record_whatever_the_bad_records_key():
    """A 600 kB value under a 250 kB key: the broker took the record, but its dead letter (value in
    base64 plus the whole key, 1.05 MB) was refused, and the learner died on it at every restart."""
    import hashlib

    backend, cfg = _backend()
    key = b"k" * 250_000
    message = StreamMessage(topic=cfg.topics.rewards, partition=0, offset=3, key=key, value=b"\xff" * 600_000,
                            timestamp_ms=1)
    assert decode_or_dead_letter(message, Reward, backend.producer(), cfg.topics.dead_letters) is None
    [sent] = drain(backend.consumer([cfg.topics.dead_letters]), 1, timeout_s=1)
    assert sent.key == b"sha256:" + hashlib.sha256(key).hexdigest().encode()
    assert len(sent.key) <= MAX_DEAD_LETTER_KEY_BYTES
    assert len(sent.value) + len(sent.key) <= MAX_RECORD_BYTES


def test_a_valid_record_is_returned_and_nothing_is_dead_lettered():
    backend, cfg = _backend()
    producer = backend.producer()
    reward = Reward(interaction_id="abc", value=1.0)
    message = StreamMessage(topic=cfg.topics.rewards, partition=0, offset=0, key=b"abc", value=encode(reward),
                            timestamp_ms=1)
    assert decode_or_dead_letter(message, Reward, producer, cfg.topics.dead_letters) == reward
    assert backend.end_offset(TopicPartition(cfg.topics.dead_letters, 0)) == 0


def test_a_dead_letter_naming_a_non_utf8_path_encodes_with_the_byte_escaped():
    """Spool recovery puts the spool log's path in the reason: a lone surrogate built the DeadLetter,
    then its encode raised a PydanticSerializationError, which no caller catching RecordError caught."""
    letter = dead_letter(b"garbage", f"spool entry unreadable in {NON_UTF8_PATH}", NON_UTF8_PATH, offset=0)
    back = decode(encode(letter), DeadLetter)
    assert back.reason == "spool entry unreadable in /data/sp\\udcffool/interactions.log"
    assert back.source_topic == "/data/sp\\udcffool/interactions.log"


def test_a_record_pydantic_cannot_serialize_is_refused_as_a_record_error():
    with pytest.raises(RecordError, match="DeadLetter cannot be encoded"):
        streams.records.encode(DeadLetter(raw=b"", source_topic="t", reason=NON_UTF8_PATH))
