"""Typed records on the byte-level stream seam: encode + key on the way in, decode or
dead-letter on the way out.

Keys (see docs/RECORDS.md): interactions and rewards by interaction id (so they are
co-partitioned), weights notices by model name (the compacted topic keeps the newest
notice per model; champion notices under the name plus ``#champion``), dead letters by the key of the record that failed.
"""

from __future__ import annotations

import hashlib
from typing import TypeVar

from online_sao.config import TopicsConfig
from online_sao.schemas import (DeadLetter, Interaction, Record, RecordError, Reward, WeightsNotice, decode,
                                encode)
from streams.base import Producer, StreamMessage

R = TypeVar("R", bound=Record)

MAX_DEAD_LETTER_RAW_BYTES = 600_000
"""Raw bytes kept in a dead letter: base64 grows them by 4/3, and the dead letter itself
must stay under MAX_RECORD_BYTES (1 MB), so longer payloads are truncated."""
MAX_REASON_CHARS = 2_000
"""Longest reason kept (validation messages of huge records can be long)."""
MAX_DEAD_LETTER_KEY_BYTES = 1_024
"""Longest key a dead letter keeps; a longer one is replaced by its SHA-256 (hex): with the raw
bytes cut above, the dead letter then always fits under the broker's 1 MB, whatever the bad
record's key (a 250 kB key made a 1.05 MB dead letter the broker refused, and the learner died on
the same record at every restart)."""


CHAMPION_KEY_SUFFIX = "#champion"
"""Key suffix of champion notices on the compacted weights topic (a key of their own, so
compaction never drops the newest publish or rollback for them)."""
HOLD_KEY_SUFFIX = "#hold"
"""Key suffix of an operator's hold and release notices: compaction keeps the newest of them, so a
replica that starts during a hold still finds it, and one that starts after the release does not."""
_KEY_SUFFIX = {"champion": CHAMPION_KEY_SUFFIX, "hold": HOLD_KEY_SUFFIX, "release": HOLD_KEY_SUFFIX}


def record_key(record: Record) -> bytes | None:
    if isinstance(record, (Interaction, Reward)):
        return record.interaction_id.encode("utf-8")
    if isinstance(record, WeightsNotice):  # compaction keeps the newest serving notice, champion and hold
        return (record.model + _KEY_SUFFIX.get(record.action, "")).encode("utf-8")
    return None


def record_topic(record: Record, topics: TopicsConfig) -> str:
    """The topic ``record`` belongs on."""
    if isinstance(record, Interaction):
        return topics.interactions
    if isinstance(record, Reward):
        return topics.rewards
    if isinstance(record, WeightsNotice):
        return topics.weights
    if isinstance(record, DeadLetter):
        return topics.dead_letters
    raise TypeError(f"no topic for a {type(record).__name__}")


def publish(producer: Producer, topic: str, record: Record, key: bytes | None = None) -> None:
    """Encode ``record`` and queue it, keyed by :func:`record_key` unless ``key`` is given."""
    producer.send(topic, encode(record), key=key if key is not None else record_key(record))


def dead_letter(raw: bytes, reason: str, source_topic: str, partition: int | None = None,
                offset: int | None = None) -> DeadLetter:
    """A DeadLetter of ``raw`` saying why it could not be used, cut to fit a record; a lone surrogate
    in ``reason`` or ``source_topic`` (a non-UTF-8 path Python decoded) is written as its escape, so the
    letter always encodes."""
    reason, source_topic = _utf8_text(reason), _utf8_text(source_topic)
    if len(raw) > MAX_DEAD_LETTER_RAW_BYTES:
        reason = f"{reason} (raw truncated to {MAX_DEAD_LETTER_RAW_BYTES} of {len(raw)} bytes)"
        raw = raw[:MAX_DEAD_LETTER_RAW_BYTES]
    if len(reason) > MAX_REASON_CHARS:
        reason = reason[:MAX_REASON_CHARS - 3] + "..."
    return DeadLetter(raw=raw, source_topic=source_topic, partition=partition, offset=offset, reason=reason)


def _utf8_text(text: str) -> str:
    """``text`` with what UTF-8 cannot hold (lone surrogates) written as backslash escapes."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def dead_letter_for(message: StreamMessage, reason: str) -> DeadLetter:
    raw = message.value if message.value is not None else b""  # a tombstone has no bytes
    return dead_letter(raw, reason, message.topic, message.partition, message.offset)


def decode_or_dead_letter(message: StreamMessage, expected: type[R], producer: Producer,
                          dead_letter_topic: str) -> R | None:
    """The record in ``message``, or None after sending a DeadLetter saying why it is unreadable.

    Bad data never raises here; failures to reach the stream (StreamUnavailable) do.
    """
    try:
        return decode(message.value, expected)  # type: ignore[return-value]
    except RecordError as exc:
        reason = str(exc)
    send_dead_letter(message, reason, producer, dead_letter_topic)
    return None


def send_dead_letter(message: StreamMessage, reason: str, producer: Producer, dead_letter_topic: str) -> None:
    """Queue the DeadLetter of ``message`` saying ``reason``, keyed by :func:`dead_letter_key`: for a record
    the codec refused, or a valid one its consumer cannot use (a reward outside the learner's range)."""
    producer.send(dead_letter_topic, encode(dead_letter_for(message, reason)), key=dead_letter_key(message.key))


def dead_letter_key(key: bytes | None) -> bytes | None:
    """The failed record's key, or its SHA-256 when longer than :data:`MAX_DEAD_LETTER_KEY_BYTES`."""
    if key is None or len(key) <= MAX_DEAD_LETTER_KEY_BYTES:
        return key
    return f"sha256:{hashlib.sha256(key).hexdigest()}".encode()
