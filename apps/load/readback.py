"""The load's Kafka check: every interaction a client saw acknowledged must be on the interactions
topic, once, with the policy versions its answer reported (``online-sao load``, :mod:`apps.load.run`)."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from apps.load.stats import RequestRecord
from streams.base import StreamBackend, TopicPartition

READBACK_TIMEOUT_S = 120.0
"""How long the check reads the interactions topic for acknowledged ids still missing."""
READBACK_QUIET_S = 3.0
"""Once every acknowledged id was read, the check keeps reading until the topic stayed
quiet this long (late duplicates)."""
STAMP_SLACK_S = 600.0
"""How long before the load began a record may be stamped and still be read back, when where the topic
ended could not be read before the load: records carry their producer's time (the serving replicas'
clocks), which may run behind this host's. Earlier records read only count as logged but not
acknowledged, which fails no run; a run's own records stamped before the start read went missing."""
READBACK_POLL_S = 0.5
"""Longest wait of one poll of the read back."""
LISTED_IDS = 20
"""Missing / duplicated ids written to the results by name (the counts are always complete)."""


@dataclass(frozen=True)
class LoggedCheck:
    """What the interactions topic holds of the acknowledged interactions."""

    acked: int
    found: int
    missing: list[str]
    duplicates: dict[str, int]
    """Acknowledged ids logged more than once: id -> copies."""
    version_mismatches: list[str]
    """Acknowledged ids whose logged versions differ from those the answer reported."""
    unacked_logged: int
    """Interactions on the topic that no client saw acknowledged (e.g. a stream cut by an error)."""
    records_read: int
    unreadable: int = 0
    """Records on the topic that are no interaction this code can read (another schema version,
    garbage): skipped and counted, as serving's readers dead-letter them."""

    @property
    def ok(self) -> bool:
        return not self.missing and not self.version_mismatches

    def to_json(self) -> dict[str, Any]:
        return {"acked": self.acked, "found": self.found, "missing": len(self.missing),
                "missing_ids": self.missing[:LISTED_IDS], "duplicates": len(self.duplicates),
                "duplicate_ids": dict(list(self.duplicates.items())[:LISTED_IDS]),
                "version_mismatches": len(self.version_mismatches),
                "version_mismatch_ids": self.version_mismatches[:LISTED_IDS],
                "unacked_logged": self.unacked_logged, "records_read": self.records_read,
                "unreadable": self.unreadable}


def acked_interactions(records: list[RequestRecord]) -> dict[str, tuple[int, ...]]:
    """Acknowledged interaction id -> the policy versions its answer reported."""
    return {r.interaction_id: r.policy_versions for r in records
            if r.kind != "feedback" and r.ok and r.interaction_id}


def topic_ends(backend: StreamBackend, topic: str) -> dict[TopicPartition, int]:
    """Where each partition of ``topic`` ends now: a load against a running deployment reads back from
    there (:func:`check_logged`), past the deployment's earlier traffic."""
    return _offsets(backend, topic, since_s=None)


def stamped_since(backend: StreamBackend, topic: str, since_s: float) -> dict[TopicPartition, int]:
    """Each partition's first record stamped at or after ``since_s`` (its end when there is none)."""
    return _offsets(backend, topic, since_s)


def _offsets(backend: StreamBackend, topic: str, since_s: float | None) -> dict[TopicPartition, int]:
    consumer = backend.consumer([topic], group_id=None, start="latest")
    try:
        ends = consumer.end_offsets()
        if since_s is None:
            return ends
        return {tp: ends[tp] if offset is None else offset
                for tp, offset in consumer.offsets_for_time(int(since_s * 1000)).items()}
    finally:
        consumer.close()


def check_logged(backend: StreamBackend, topic: str, acked: dict[str, tuple[int, ...]],
                 timeout_s: float = READBACK_TIMEOUT_S, quiet_s: float = READBACK_QUIET_S,
                 since: dict[TopicPartition, int] | None = None) -> LoggedCheck:
    """Read ``topic`` from the start, or from the offsets ``since`` (:func:`topic_ends` before the load;
    a partition it does not name from its start), until every id of ``acked`` was seen and the topic
    stayed quiet ``quiet_s``, or ``timeout_s`` passed; compare with ``acked``. Read from the start, a
    deployment's topic counted all its earlier traffic as logged but not acknowledged, and one holding
    more than ``timeout_s`` of reading ran the clock out before the run's records at its end: all
    reported missing."""
    from online_sao.schemas import Interaction, RecordError, decode

    copies: Counter[str] = Counter()
    logged_versions: dict[str, tuple[int, ...]] = {}
    unreadable = 0
    consumer = backend.consumer([topic], group_id=None, start="earliest")
    for tp, offset in (since or {}).items():
        if tp in consumer.assignment():
            consumer.seek(tp, offset)
    deadline = time.monotonic() + timeout_s
    last_read = time.monotonic()
    try:
        while time.monotonic() < deadline:
            if not (acked.keys() - copies.keys()) and time.monotonic() - last_read >= quiet_s:
                break
            messages = consumer.poll(timeout_s=READBACK_POLL_S)
            if messages:
                last_read = time.monotonic()
            for message in messages:
                try:
                    record = decode(message.value, Interaction)
                except RecordError:  # it crashed the read back, after the whole run, with no results written
                    unreadable += 1
                    continue
                copies[record.interaction_id] += 1
                logged_versions[record.interaction_id] = tuple(sorted(set(record.versions)))
    finally:
        consumer.close()
    found = [i for i in acked if i in copies]
    return LoggedCheck(
        acked=len(acked), found=len(found), missing=sorted(acked.keys() - copies.keys()),
        duplicates={i: copies[i] for i in sorted(found) if copies[i] > 1},
        version_mismatches=sorted(i for i in found if logged_versions[i] != tuple(sorted(acked[i]))),
        unacked_logged=len(copies.keys() - acked.keys()), records_read=sum(copies.values()), unreadable=unreadable)
