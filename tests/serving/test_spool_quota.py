"""The spool at its quota: records held in memory, and the compaction that makes room for them."""

from __future__ import annotations

from collections import Counter

from serving.spool import Spool, SpoolEntry
from tests.serving import test_spool
from tests.serving.test_spool import DLQ, entries, failing_once

close_spools = test_spool.close_spools  # the fixture: every spool opened here is closed

ENCODINGS: Counter[int] = Counter()
"""How often each sequence number was encoded (:class:`CountingEntry`)."""


class CountingEntry(SpoolEntry):
    """An entry that counts its encodings: each is JSON and base64 of the whole record, with the
    spool's lock held."""

    def encode(self) -> bytes:
        ENCODINGS[self.seq] += 1
        return super().encode()


def counting(first: int, count: int) -> list[CountingEntry]:
    return [CountingEntry(e.seq, e.topic, e.key, e.value) for e in entries(first, count)]


def size(batch: list[SpoolEntry]) -> int:
    return sum(len(SpoolEntry(e.seq, e.topic, e.key, e.value).encode()) for e in batch)


def test_records_held_in_memory_are_encoded_once_however_often_they_are_retried_or_counted(tmp_path):
    """Every append (the writer's retries too) and every read of pending_bytes (the spool gauge's
    scrape) encoded every held record again, with the spool's lock held: about a second per call at
    10,000 held records of 20 KB."""
    ENCODINGS.clear()
    held = counting(10, 20)
    spool = Spool(tmp_path, max_bytes=size(held[-2:]), dead_letter_topic=DLQ)  # room for two at most
    assert not spool.append(held[:10]) and not spool.append(held[10:])  # beyond the quota: held in memory
    for _ in range(5):  # the writer retries now and then, the metrics are scraped
        assert not spool.append([])
        assert spool.pending_bytes == size(held)
    assert spool.read_pending(30) == held
    spool.ack_through(held[4])  # acknowledged from memory
    assert spool.pending_records == 15 and spool.pending_bytes == size(held[5:])
    spool.ack_through(held[-3])
    assert spool.append([])  # the last two fit: written from the bytes kept since they were held
    assert spool.held_in_memory == 0 and spool.pending_bytes == spool.file_bytes == size(held[-2:])
    assert ENCODINGS == Counter(range(10, 30))  # each record encoded once
    reopened = Spool(tmp_path, max_bytes=size(held[-2:]), dead_letter_topic=DLQ)
    assert [(e.seq, e.value) for e in reopened.read_pending(10)] == [(e.seq, e.value) for e in held[-2:]]


def test_a_full_quota_waits_in_memory_until_the_acknowledged_prefix_is_worth_compacting(tmp_path):
    """An append beyond the quota used to compact whenever anything was acknowledged: the whole
    unacknowledged rest copied and fsynced to free one entry's room, again at the next append."""
    one = len(entries(1, 1)[0].encode())
    spool = Spool(tmp_path, max_bytes=4 * one, dead_letter_topic=DLQ)
    spool.append(entries(1, 4))
    spool.ack_through(spool.read_pending(10)[0])  # 1 acknowledged of 4: copying 3 to free 1 does not pay
    assert not spool.append(entries(5, 1))  # waits in memory, as when nothing is acknowledged
    assert spool.compactions == 0 and spool.held_in_memory == 1 and "spool_max_bytes" in spool.error
    spool.ack_through(spool.read_pending(10)[0])  # 2 of 4: as much to free as to copy, compacted
    assert spool.compactions == 1
    assert spool.append([]) and spool.error is None
    assert [e.seq for e in Spool(tmp_path, 4 * one, dead_letter_topic=DLQ).read_pending(10)] == [3, 4, 5]


def test_an_append_beyond_the_quota_does_the_compaction_its_acknowledgement_failed_to_do(tmp_path, monkeypatch):
    one = len(entries(1, 1)[0].encode())
    spool = Spool(tmp_path, max_bytes=4 * one, dead_letter_topic=DLQ)
    spool.append(entries(1, 4))
    create = failing_once(28, open)  # ENOSPC for the compacted copy
    monkeypatch.setattr("serving.spool.open", lambda path, mode="r", *a, **k:
                        create(path, mode, *a, **k) if mode == "wb" else open(path, mode, *a, **k), raising=False)
    spool.ack_through(spool.read_pending(10)[1])  # 2 of 4 acknowledged: its compaction fails
    assert spool.compactions == 0
    assert spool.append(entries(5, 1))  # the quota is reached: the acknowledged entries' room is reused
    assert spool.compactions == 1 and spool.error is None
    assert [e.seq for e in Spool(tmp_path, 4 * one, dead_letter_topic=DLQ).read_pending(10)] == [3, 4, 5]


def test_draining_a_full_spool_under_traffic_copies_no_more_than_compaction_frees(tmp_path, monkeypatch):
    """The broker back after an outage acknowledges a few records per cycle while requests go on;
    compacting at every append that found the quota reached rewrote the quota many times over."""
    spool = Spool(tmp_path, max_bytes=size(entries(1, 40)), dead_letter_topic=DLQ)
    assert spool.append(entries(1, 40))  # the outage filled it
    copied, freed = [], []
    compact = Spool._compact

    def counting_compact(self):
        before = self.file_bytes
        compact(self)
        copied.append(self.file_bytes)
        freed.append(before - self.file_bytes)

    monkeypatch.setattr(Spool, "_compact", counting_compact)
    seq = 41
    for _ in range(10):  # each cycle the broker acknowledges 4 records, then one request arrives
        spool.ack_through(spool.read_pending(4)[-1])
        spool.append(entries(seq, 1))
        seq += 1
    assert copied and sum(copied) <= sum(freed)
    assert [e.seq for e in spool.read_pending(100)] == list(range(41, seq))  # nothing lost, in order
