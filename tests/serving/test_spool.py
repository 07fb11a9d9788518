"""The on-disk spool: order, acknowledgement watermark, crash recovery, full disk."""

from __future__ import annotations

import errno

import pytest

from serving.spool import Spool, SpoolEntry


@pytest.fixture(autouse=True)
def close_spools(monkeypatch):
    """Every spool a test opens releases its log's file handle at the end."""
    opened = []
    init = Spool.__init__

    def tracked(self, *args, **kwargs):
        init(self, *args, **kwargs)
        opened.append(self)

    monkeypatch.setattr(Spool, "__init__", tracked)
    yield
    for spool in opened:
        spool.close()


def entries(first: int, count: int, topic: str = "t") -> list[SpoolEntry]:
    return [SpoolEntry(seq, topic, f"k{seq}".encode(), f"value-{seq}".encode() * 3)
            for seq in range(first, first + count)]


def test_entries_come_back_in_order_and_acknowledged_ones_never_again(tmp_path):
    spool = Spool(tmp_path, max_bytes=1 << 20)
    assert spool.append(entries(1, 5))
    got = spool.read_pending(10)
    assert [e.seq for e in got] == [1, 2, 3, 4, 5]
    assert got[2].key == b"k3" and got[2].value == b"value-3" * 3
    spool.ack_through(got[1])
    assert [e.seq for e in spool.read_pending(10)] == [3, 4, 5]
    assert spool.pending_records == 3
    reopened = Spool(tmp_path, max_bytes=1 << 20)  # a restart keeps the watermark
    assert [e.seq for e in reopened.read_pending(2)] == [3, 4]
    assert reopened.last_seq == 5


def test_acknowledging_everything_empties_the_files_and_keeps_counting(tmp_path):
    spool = Spool(tmp_path, max_bytes=1 << 20)
    spool.append(entries(1, 3))
    spool.ack_through(spool.read_pending(10)[-1])
    assert spool.pending_records == 0 and spool.pending_bytes == 0
    assert (tmp_path / "spool.log").stat().st_size == 0
    assert Spool(tmp_path, max_bytes=1 << 20).last_seq == 3


def test_a_torn_tail_is_cut_and_kept_aside(tmp_path):
    spool = Spool(tmp_path, max_bytes=1 << 20)
    spool.append(entries(1, 3))
    log = tmp_path / "spool.log"
    data = log.read_bytes()
    log.write_bytes(data[:-7])  # a crash in the middle of the last entry
    reopened = Spool(tmp_path, max_bytes=1 << 20)
    assert [e.seq for e in reopened.read_pending(10)] == [1, 2]
    assert reopened.dropped_corrupt_bytes > 0
    assert list(tmp_path.glob("spool.corrupt-*"))
    reopened.append(entries(3, 1))  # appends continue after the cut
    assert [e.seq for e in Spool(tmp_path, 1 << 20).read_pending(10)] == [1, 2, 3]


def test_a_flipped_byte_fails_the_crc(tmp_path):
    spool = Spool(tmp_path, max_bytes=1 << 20)
    spool.append(entries(1, 3))
    log = tmp_path / "spool.log"
    data = bytearray(log.read_bytes())
    second = data.index(b"\n") + 1
    data[second + 40] ^= 0x01
    log.write_bytes(bytes(data))
    assert [e.seq for e in Spool(tmp_path, 1 << 20).read_pending(10)] == [1]


def test_a_full_spool_keeps_entries_in_memory_in_order_and_says_why(tmp_path):
    one = len(entries(1, 1)[0].encode())
    spool = Spool(tmp_path, max_bytes=3 * one)
    assert spool.append(entries(1, 2))
    assert not spool.append(entries(3, 2))  # would exceed the quota: nothing of it is written
    assert "spool_max_bytes" in spool.error
    assert spool.held_in_memory == 2 and spool.pending_records == 4
    assert [e.seq for e in spool.read_pending(10)] == [1, 2, 3, 4]
    spool.ack_through(spool.read_pending(10)[1])  # frees room on disk
    assert spool.append([])  # the held entries are written first
    assert spool.error is None and spool.held_in_memory == 0
    assert [e.seq for e in Spool(tmp_path, 3 * one).read_pending(10)] == [3, 4]


def test_a_disk_error_during_append_leaves_no_partial_entry(tmp_path, monkeypatch):
    spool = Spool(tmp_path, max_bytes=1 << 20)
    spool.append(entries(1, 1))
    size = (tmp_path / "spool.log").stat().st_size

    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("serving.spool.os.fsync", no_space)
    assert not spool.append(entries(2, 2))
    assert "No space left" in spool.error
    assert (tmp_path / "spool.log").stat().st_size == size
    monkeypatch.undo()
    assert spool.append([])
    assert [e.seq for e in Spool(tmp_path, 1 << 20).read_pending(10)] == [1, 2, 3]


def test_acknowledging_an_in_memory_entry_acknowledges_the_disk_before_it(tmp_path):
    one = len(entries(1, 1)[0].encode())
    spool = Spool(tmp_path, max_bytes=one)
    spool.append(entries(1, 1))
    spool.append(entries(2, 2))
    pending = spool.read_pending(10)
    assert [e.end_offset is None for e in pending] == [False, True, True]
    spool.ack_through(pending[1])
    assert [e.seq for e in spool.read_pending(10)] == [3]
    spool.ack_through(spool.read_pending(10)[0])
    assert spool.pending_records == 0


def test_a_watermark_that_cannot_be_written_means_resending_not_losing(tmp_path, monkeypatch):
    spool = Spool(tmp_path, max_bytes=1 << 20)
    spool.append(entries(1, 4))
    spool.ack_through(spool.read_pending(10)[0])  # watermark 1 written

    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("serving.spool.os.fsync", no_space)
    spool.ack_through(spool.read_pending(10)[0])  # 2 acknowledged, but the watermark stays at 1
    assert "No space left" in spool.watermark_error
    assert [e.seq for e in spool.read_pending(10)] == [3, 4]
    monkeypatch.undo()
    assert [e.seq for e in Spool(tmp_path, 1 << 20).read_pending(10)] == [2, 3, 4]  # 2 is sent again


def test_a_log_never_fully_acknowledged_is_compacted_and_stays_small(tmp_path):
    one = len(entries(1, 1)[0].encode())
    spool = Spool(tmp_path, max_bytes=40 * one)
    seq = 1
    for _ in range(200):  # steady traffic: each round appends two, the broker acknowledges all but the newest
        spool.append(entries(seq, 2))
        seq += 2
        pending = spool.read_pending(100)
        spool.ack_through(pending[-2])
    assert spool.compactions > 0 and spool.error is None
    assert spool.file_bytes <= 40 * one  # 400 entries went through a log that holds 40
    assert [e.seq for e in spool.read_pending(10)] == [seq - 1]
    reopened = Spool(tmp_path, max_bytes=40 * one)  # the compacted log and the watermark agree after a restart
    assert [e.seq for e in reopened.read_pending(10)] == [seq - 1]


def test_entries_read_before_a_compaction_or_reset_still_acknowledge_the_right_prefix(tmp_path):
    one = len(entries(1, 1)[0].encode())
    spool = Spool(tmp_path, max_bytes=8 * one)
    spool.append(entries(1, 6))
    spool.ack_through(spool.read_pending(10)[3])  # 4 acknowledged of 6: compacted (garbage > rest)
    assert spool.compactions == 1
    rest = spool.read_pending(10)
    assert [e.seq for e in rest] == [5, 6]
    spool.append(entries(7, 2))
    spool.ack_through(rest[0])  # an entry read before the append: its offset is still right
    assert [e.seq for e in spool.read_pending(10)] == [6, 7, 8]
    spool.ack_through(spool.read_pending(10)[-1])  # all: the log is emptied
    assert spool.file_bytes == 0 and spool.pending_records == 0
    spool.append(entries(9, 1))
    assert [e.seq for e in Spool(tmp_path, 8 * one).read_pending(10)] == [9]


def test_a_full_quota_is_made_room_for_by_compacting_the_acknowledged_prefix(tmp_path):
    one = len(entries(1, 1)[0].encode())
    spool = Spool(tmp_path, max_bytes=4 * one)
    spool.append(entries(1, 4))
    spool.ack_through(spool.read_pending(10)[0])  # 1 acknowledged: too little to compact on its own
    assert spool.compactions == 0
    assert spool.append(entries(5, 1))  # the quota is reached: the acknowledged entry's room is reused
    assert spool.compactions == 1 and spool.error is None
    assert [e.seq for e in Spool(tmp_path, 4 * one).read_pending(10)] == [2, 3, 4, 5]
