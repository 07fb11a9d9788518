"""The on-disk spool: order, acknowledgement watermark, crash recovery, full disk."""

from __future__ import annotations

import errno
import os
import time

import pytest

from online_sao.durable import fsync_dir
from online_sao.schemas import DeadLetter, decode
from serving import spool_recovery
from serving.spool import Spool, SpoolEntry

DLQ = "dead-letters"
ACK_WAIT_S = 10.0
"""Until an acknowledgement with a slow (0.3 s) watermark write is done, on a loaded box."""


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
    spool = Spool(tmp_path, max_bytes=1 << 20, dead_letter_topic=DLQ)
    assert spool.append(entries(1, 5))
    got = spool.read_pending(10)
    assert [e.seq for e in got] == [1, 2, 3, 4, 5]
    assert got[2].key == b"k3" and got[2].value == b"value-3" * 3
    spool.ack_through(got[1])
    assert [e.seq for e in spool.read_pending(10)] == [3, 4, 5]
    assert spool.pending_records == 3
    reopened = Spool(tmp_path, max_bytes=1 << 20, dead_letter_topic=DLQ)  # a restart keeps the watermark
    assert [e.seq for e in reopened.read_pending(2)] == [3, 4]
    assert reopened.last_seq == 5


def test_acknowledging_everything_empties_the_files_and_keeps_counting(tmp_path):
    spool = Spool(tmp_path, max_bytes=1 << 20, dead_letter_topic=DLQ)
    spool.append(entries(1, 3))
    spool.ack_through(spool.read_pending(10)[-1])
    assert spool.pending_records == 0 and spool.pending_bytes == 0
    assert (tmp_path / "spool.log").stat().st_size == 0
    assert Spool(tmp_path, max_bytes=1 << 20, dead_letter_topic=DLQ).last_seq == 3


def test_a_torn_tail_is_cut_and_kept_aside(tmp_path):
    spool = Spool(tmp_path, max_bytes=1 << 20, dead_letter_topic=DLQ)
    spool.append(entries(1, 3))
    log = tmp_path / "spool.log"
    data = log.read_bytes()
    log.write_bytes(data[:-7])  # a crash in the middle of the last entry
    reopened = Spool(tmp_path, max_bytes=1 << 20, dead_letter_topic=DLQ)
    assert [e.seq for e in reopened.read_pending(10)] == [1, 2]
    assert reopened.dropped_corrupt_bytes > 0
    assert list(tmp_path.glob("spool.corrupt-*"))
    reopened.append(entries(3, 1))  # appends continue after the cut
    assert [e.seq for e in Spool(tmp_path, 1 << 20, dead_letter_topic=DLQ).read_pending(10)] == [1, 2, 3]


def test_a_torn_tail_is_cut_on_a_disk_too_full_to_keep_it_aside(tmp_path, monkeypatch):
    # a power loss during an outage that filled the disk: the start must still cut the tail and go on
    spool = Spool(tmp_path, max_bytes=1 << 20, dead_letter_topic=DLQ)
    spool.append(entries(1, 3))
    log = tmp_path / "spool.log"
    log.write_bytes(log.read_bytes()[:-7])
    opener = spool_recovery.private_opener

    def full(path, flags):
        if os.path.basename(path).startswith("spool.corrupt-"):
            os.close(opener(path, flags))  # a partial file left behind, as a write cut short by ENOSPC can
            raise OSError(errno.ENOSPC, "No space left on device")
        return opener(path, flags)

    monkeypatch.setattr(spool_recovery, "private_opener", full)
    reopened = Spool(tmp_path, max_bytes=1 << 20, dead_letter_topic=DLQ)
    assert [e.seq for e in reopened.read_pending(10)] == [1, 2]
    assert not list(tmp_path.glob("spool.corrupt-*"))


def test_a_repair_the_disk_cannot_hold_leaves_the_log_whole_and_no_partial_copy(tmp_path, monkeypatch):
    spool = Spool(tmp_path, max_bytes=1 << 20, dead_letter_topic=DLQ)
    spool.append(entries(1, 3))
    spool.close()
    log = tmp_path / "spool.log"
    data = bytearray(log.read_bytes())
    data[len(entries(1, 1)[0].encode()) - 3] ^= 0xFF  # the first entry damaged: the log must be rewritten
    log.write_bytes(bytes(data))
    real_fsync = os.fsync

    def full(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".repair"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="spool.log.repair"):
        Spool(tmp_path, max_bytes=1 << 20, dead_letter_topic=DLQ)
    assert log.read_bytes() == bytes(data)
    assert not (tmp_path / "spool.log.repair").exists()


@pytest.mark.parametrize("cut", [0, 7], ids=["after-the-last-entry", "inside-the-last-entry"])
def test_zeros_a_power_loss_left_at_the_end_are_cut_not_dead_lettered(tmp_path, cut):
    spool = Spool(tmp_path, max_bytes=1 << 20, dead_letter_topic=DLQ)
    spool.append(entries(1, 3))
    log = tmp_path / "spool.log"
    data = log.read_bytes()
    log.write_bytes(data[:len(data) - cut] + b"\x00" * 4096)  # the file extended, its data never written
    reopened = Spool(tmp_path, max_bytes=1 << 20, dead_letter_topic=DLQ)
    assert [e.seq for e in reopened.read_pending(10)] == ([1, 2, 3] if cut == 0 else [1, 2])
    assert reopened.dead_lettered_entries == 0
    last = len(entries(3, 1)[0].encode())
    assert reopened.dropped_corrupt_bytes == (4096 if cut == 0 else last - cut + 4096)


def test_a_damaged_last_entry_followed_by_zeros_is_still_dead_lettered(tmp_path):
    spool = Spool(tmp_path, max_bytes=1 << 20, dead_letter_topic=DLQ)
    spool.append(entries(1, 2))
    log = tmp_path / "spool.log"
    data = bytearray(log.read_bytes())
    data[-5] ^= 0xFF  # a complete entry with a bad checksum: written, then damaged
    log.write_bytes(bytes(data) + b"\x00" * 512)
    reopened = Spool(tmp_path, max_bytes=1 << 20, dead_letter_topic=DLQ)
    assert reopened.dead_lettered_entries == 1


def test_a_flipped_byte_fails_the_crc(tmp_path):
    spool = Spool(tmp_path, max_bytes=1 << 20, dead_letter_topic=DLQ)
    spool.append(entries(1, 3))
    log = tmp_path / "spool.log"
    data = bytearray(log.read_bytes())
    second = data.index(b"\n") + 1
    data[second + 40] ^= 0x01
    log.write_bytes(bytes(data))
    pending = Spool(tmp_path, 1 << 20, dead_letter_topic=DLQ).read_pending(10)
    assert [(e.seq, e.topic) for e in pending] == [(1, "t"), (3, "t"), (4, DLQ)]  # only the damaged one is out


def test_a_full_spool_keeps_entries_in_memory_in_order_and_says_why(tmp_path):
    one = len(entries(1, 1)[0].encode())
    spool = Spool(tmp_path, max_bytes=3 * one, dead_letter_topic=DLQ)
    assert spool.append(entries(1, 2))
    assert not spool.append(entries(3, 2))  # would exceed the quota: nothing of it is written
    assert "spool_max_bytes" in spool.error
    assert spool.held_in_memory == 2 and spool.pending_records == 4
    assert [e.seq for e in spool.read_pending(10)] == [1, 2, 3, 4]
    spool.ack_through(spool.read_pending(10)[1])  # frees room on disk
    assert spool.append([])  # the held entries are written first
    assert spool.error is None and spool.held_in_memory == 0
    assert [e.seq for e in Spool(tmp_path, 3 * one, dead_letter_topic=DLQ).read_pending(10)] == [3, 4]


def test_a_disk_error_during_append_leaves_no_partial_entry(tmp_path, monkeypatch):
    spool = Spool(tmp_path, max_bytes=1 << 20, dead_letter_topic=DLQ)
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
    assert [e.seq for e in Spool(tmp_path, 1 << 20, dead_letter_topic=DLQ).read_pending(10)] == [1, 2, 3]


def test_acknowledging_an_in_memory_entry_acknowledges_the_disk_before_it(tmp_path):
    one = len(entries(1, 1)[0].encode())
    spool = Spool(tmp_path, max_bytes=one, dead_letter_topic=DLQ)
    spool.append(entries(1, 1))
    spool.append(entries(2, 2))
    pending = spool.read_pending(10)
    assert [e.end_offset is None for e in pending] == [False, True, True]
    spool.ack_through(pending[1])
    assert [e.seq for e in spool.read_pending(10)] == [3]
    spool.ack_through(spool.read_pending(10)[0])
    assert spool.pending_records == 0


def test_an_entry_read_from_memory_and_written_to_disk_before_its_acknowledgement_is_acknowledged(tmp_path):
    """The sender reads entries the full spool held in memory; the writer's retry puts them on disk
    before the broker's acknowledgement comes back (the acknowledgement used to look for them in
    memory only, and its StopIteration stopped the sender)."""
    one = len(entries(1, 1)[0].encode())
    spool = Spool(tmp_path, max_bytes=2 * one, dead_letter_topic=DLQ)
    spool.append(entries(1, 2))
    spool.append(entries(3, 2))  # over the quota: held in memory
    read = spool.read_pending(10)
    spool.ack_through(read[1])  # the disk's two: the whole file is given back
    assert spool.append([])  # the writer's retry: 3 and 4 on disk now
    spool.ack_through(read[2])  # read when 3 was in memory
    assert [e.seq for e in spool.read_pending(10)] == [4]
    spool.ack_through(read[3])
    assert spool.pending_records == 0
    assert Spool(tmp_path, 2 * one, dead_letter_topic=DLQ).read_pending(10) == []


def test_a_watermark_that_cannot_be_written_means_resending_not_losing(tmp_path, monkeypatch):
    spool = Spool(tmp_path, max_bytes=1 << 20, dead_letter_topic=DLQ)
    spool.append(entries(1, 4))
    spool.ack_through(spool.read_pending(10)[0])  # watermark 1 written

    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("serving.spool.os.fsync", no_space)
    spool.ack_through(spool.read_pending(10)[0])  # 2 acknowledged, but the watermark stays at 1
    assert "No space left" in spool.watermark_error
    assert [e.seq for e in spool.read_pending(10)] == [3, 4]
    monkeypatch.undo()
    reopened = Spool(tmp_path, 1 << 20, dead_letter_topic=DLQ)
    assert [e.seq for e in reopened.read_pending(10)] == [2, 3, 4]  # 2 is sent again


def test_a_log_never_fully_acknowledged_is_compacted_and_stays_small(tmp_path):
    one = len(entries(1, 1)[0].encode())
    spool = Spool(tmp_path, max_bytes=40 * one, dead_letter_topic=DLQ)
    seq = 1
    for _ in range(200):  # steady traffic: each round appends two, the broker acknowledges all but the newest
        spool.append(entries(seq, 2))
        seq += 2
        pending = spool.read_pending(100)
        spool.ack_through(pending[-2])
    assert spool.compactions > 0 and spool.error is None
    assert spool.file_bytes <= 40 * one  # 400 entries went through a log that holds 40
    assert [e.seq for e in spool.read_pending(10)] == [seq - 1]
    # the compacted log and the watermark agree after a restart
    reopened = Spool(tmp_path, max_bytes=40 * one, dead_letter_topic=DLQ)
    assert [e.seq for e in reopened.read_pending(10)] == [seq - 1]


def test_entries_read_before_a_compaction_or_reset_still_acknowledge_the_right_prefix(tmp_path):
    one = len(entries(1, 1)[0].encode())
    spool = Spool(tmp_path, max_bytes=8 * one, dead_letter_topic=DLQ)
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
    assert [e.seq for e in Spool(tmp_path, 8 * one, dead_letter_topic=DLQ).read_pending(10)] == [9]


def _entry_starts(data: bytes) -> list[int]:
    """Byte offset of every entry of an undamaged log (entries end with a newline)."""
    return [0] + [i + 1 for i, byte in enumerate(data[:-1]) if byte == ord("\n")]


def _damage(kind: str, entry: bytearray) -> bytearray:
    if kind == "flipped payload byte":
        entry[40] ^= 0x01
    elif kind == "length not hex":
        entry[0:1] = b"z"
    elif kind == "length too large":
        entry[0:8] = b"0000ffff"
    elif kind == "terminator overwritten":
        entry[-1:] = b"x"
    elif kind == "bytes missing":
        del entry[30:35]
    return entry


@pytest.mark.parametrize("kind", ["flipped payload byte", "length not hex", "length too large",
                                  "terminator overwritten", "bytes missing"])
def test_a_damaged_entry_in_the_middle_is_dead_lettered_and_the_rest_replayed_in_order(tmp_path, kind):
    spool = Spool(tmp_path, max_bytes=1 << 20, dead_letter_topic=DLQ)
    spool.append(entries(1, 100))
    spool.close()
    log = tmp_path / "spool.log"
    data = log.read_bytes()
    starts = _entry_starts(data)
    damaged = bytes(_damage(kind, bytearray(data[starts[49]:starts[50]])))  # entry 50 of 100
    log.write_bytes(data[:starts[49]] + damaged + data[starts[50]:])

    reopened = Spool(tmp_path, max_bytes=1 << 20, dead_letter_topic=DLQ)
    pending = reopened.read_pending(1000)
    assert [e.seq for e in pending[:-1]] == [seq for seq in range(1, 101) if seq != 50]
    assert all(e.topic == "t" and e.value == f"value-{e.seq}".encode() * 3 for e in pending[:-1])
    notice = pending[-1]  # the dead letter is sent after everything else, under the next sequence number
    assert (notice.topic, notice.seq, reopened.last_seq) == (DLQ, 101, 101)
    letter = decode(notice.value, DeadLetter)
    assert letter.raw == damaged and letter.offset == starts[49]
    assert str(log) in letter.reason and "unreadable" in letter.reason
    assert reopened.dead_lettered_entries == 1

    again = Spool(tmp_path, max_bytes=1 << 20, dead_letter_topic=DLQ)  # the repair is on disk: nothing new
    assert [(e.seq, e.topic, e.value) for e in again.read_pending(1000)] == [
        (e.seq, e.topic, e.value) for e in pending]
    assert again.dead_lettered_entries == 0
    again.ack_through(again.read_pending(1000)[-1])
    assert Spool(tmp_path, max_bytes=1 << 20, dead_letter_topic=DLQ).pending_records == 0


def test_a_damaged_entry_already_acknowledged_is_dropped_without_a_dead_letter(tmp_path):
    spool = Spool(tmp_path, max_bytes=1 << 20, dead_letter_topic=DLQ)
    spool.append(entries(1, 10))
    spool.ack_through(spool.read_pending(10)[5])  # 1..6 acknowledged; the log keeps them (not compacted)
    spool.close()
    log = tmp_path / "spool.log"
    data = bytearray(log.read_bytes())
    data[_entry_starts(bytes(data))[2] + 40] ^= 0x01  # entry 3: the broker has it already
    log.write_bytes(bytes(data))
    reopened = Spool(tmp_path, max_bytes=1 << 20, dead_letter_topic=DLQ)
    assert [(e.seq, e.topic) for e in reopened.read_pending(100)] == [(seq, "t") for seq in (7, 8, 9, 10)]
    assert reopened.dead_lettered_entries == 0


def test_a_complete_last_entry_with_a_bad_checksum_is_dead_lettered_not_taken_for_a_torn_write(tmp_path):
    spool = Spool(tmp_path, max_bytes=1 << 20, dead_letter_topic=DLQ)
    spool.append(entries(1, 3))
    spool.close()
    log = tmp_path / "spool.log"
    data = bytearray(log.read_bytes())
    data[_entry_starts(bytes(data))[2] + 40] ^= 0x01
    log.write_bytes(bytes(data))
    pending = Spool(tmp_path, max_bytes=1 << 20, dead_letter_topic=DLQ).read_pending(10)
    assert [(e.seq, e.topic) for e in pending] == [(1, "t"), (2, "t"), (3, DLQ)]  # next after the intact ones
    assert "checksum" in decode(pending[-1].value, DeadLetter).reason


def failing_once(error_number: int, real=None):
    """Stands in for an os-level call: raises ``OSError(error_number)`` on its first call, then does what
    ``real`` does; ``calls`` counts every call."""

    def call(*args, **kwargs):
        call.calls += 1
        if call.calls == 1:
            raise OSError(error_number, os.strerror(error_number))
        return real(*args, **kwargs) if real is not None else None

    call.calls = 0
    return call


def test_a_log_that_cannot_be_emptied_stays_valid_and_is_emptied_later(tmp_path, monkeypatch):
    """Emptying the fully acknowledged log (open "wb") fails once, as on a file system remounted
    read-only: acknowledging does not raise (it stopped the sender), the log stays readable."""
    spool = Spool(tmp_path, max_bytes=1 << 20, dead_letter_topic=DLQ)
    spool.append(entries(1, 3))
    one = len(entries(1, 1)[0].encode())
    truncate = failing_once(errno.EROFS, open)
    monkeypatch.setattr("serving.spool.open", lambda path, mode="r", *a, **k:
                        truncate(path, mode, *a, **k) if mode == "wb" else open(path, mode, *a, **k), raising=False)
    spool.ack_through(spool.read_pending(10)[-1])
    assert truncate.calls == 1 and spool.pending_records == 0
    assert (tmp_path / "spool.log").stat().st_size == 3 * one  # still there, all of it acknowledged
    assert spool.read_pending(10) == []
    assert spool.append(entries(4, 1))
    assert [e.seq for e in spool.read_pending(10)] == [4]
    assert [e.seq for e in Spool(tmp_path, 1 << 20, dead_letter_topic=DLQ).read_pending(10)] == [4]
    spool.ack_through(spool.read_pending(10)[0])  # the next reset empties it
    assert truncate.calls == 2 and (tmp_path / "spool.log").stat().st_size == 0


def test_a_read_that_fails_raises_says_why_and_a_read_that_succeeds_clears_it(tmp_path, monkeypatch):
    spool = Spool(tmp_path, max_bytes=1 << 20, dead_letter_topic=DLQ)
    spool.append(entries(1, 2))
    reader = failing_once(errno.EMFILE, open)
    monkeypatch.setattr("serving.spool.open", lambda path, mode="r", *a, **k:
                        reader(path, mode, *a, **k) if mode == "rb" else open(path, mode, *a, **k), raising=False)
    with pytest.raises(OSError):
        spool.read_pending(10)
    assert spool.error.startswith("cannot read the spool") and "Too many open files" in spool.error
    assert [e.seq for e in spool.read_pending(10)] == [1, 2]
    assert spool.error is None


def test_a_compaction_whose_directory_fsync_fails_reads_the_rest_from_the_right_place(tmp_path, monkeypatch):
    """The rename of the compacted log succeeds, the directory's fsync after it fails: the offsets
    follow the new file (they used to point into it as if it were the old one)."""
    one = len(entries(1, 1)[0].encode())
    spool = Spool(tmp_path, max_bytes=8 * one, dead_letter_topic=DLQ)
    spool.append(entries(1, 6))
    sync_dir = failing_once(errno.EIO, fsync_dir)
    monkeypatch.setattr("serving.spool.fsync_dir", sync_dir)
    spool.ack_through(spool.read_pending(10)[3])  # 4 of 6 acknowledged: compacted, then the fsync fails
    assert spool.compactions == 1 and (tmp_path / "spool.log").stat().st_size == 2 * one
    assert [e.seq for e in spool.read_pending(10)] == [5, 6]
    assert spool.append(entries(7, 1))  # not written until the rename is on disk: it fsyncs the directory
    assert sync_dir.calls == 2
    assert [e.seq for e in spool.read_pending(10)] == [5, 6, 7]
    assert [e.seq for e in Spool(tmp_path, 8 * one, dead_letter_topic=DLQ).read_pending(10)] == [5, 6, 7]


def test_a_new_log_whose_directory_fsync_fails_is_taken_back_and_written_once(tmp_path, monkeypatch):
    """The first append creates the log; its data is fsynced, the directory's fsync fails. The append
    is reported failed, so its entries must not stay in the file too (the retry wrote them twice)."""
    sync_dir = failing_once(errno.EMFILE, fsync_dir)
    monkeypatch.setattr("serving.spool.fsync_dir", sync_dir)
    spool = Spool(tmp_path, max_bytes=1 << 20, dead_letter_topic=DLQ)
    assert not spool.append(entries(1, 3))
    assert "Too many open files" in spool.error and spool.held_in_memory == 3
    assert (tmp_path / "spool.log").stat().st_size == 0
    assert spool.append(entries(4, 1))  # the held entries first, then the new one; the directory fsync again
    assert sync_dir.calls == 2 and spool.error is None
    assert [e.seq for e in spool.read_pending(10)] == [1, 2, 3, 4]
    assert [e.seq for e in Spool(tmp_path, 1 << 20, dead_letter_topic=DLQ).read_pending(10)] == [1, 2, 3, 4]


def test_the_read_back_window_is_the_widest_since_the_spool_was_last_empty(tmp_path):
    """A crashed process may have handed its producer as many records as its own serving.log_window:
    a restart with a narrower one still reads back that many."""
    first = Spool(tmp_path, max_bytes=1 << 20, dead_letter_topic=DLQ)
    assert first.readback_window(8) == 8  # an empty spool: only this process's window counts
    first.append(entries(1, 10))
    assert (tmp_path / "spool.window").read_text() == "8\n"  # written at the start, before any send
    narrower = Spool(tmp_path, max_bytes=1 << 20, dead_letter_topic=DLQ)
    assert narrower.readback_window(2) == 8
    assert Spool(tmp_path, max_bytes=1 << 20, dead_letter_topic=DLQ).readback_window(2) == 8  # a second crash
    narrower.ack_through(narrower.read_pending(10)[-1])
    assert Spool(tmp_path, max_bytes=1 << 20, dead_letter_topic=DLQ).readback_window(2) == 2  # nothing pending


def test_a_missing_read_back_window_reads_back_every_pending_entry(tmp_path):
    """No ``spool.window`` beside pending entries (an older version wrote the spool, or the write failed)."""
    Spool(tmp_path, max_bytes=1 << 20, dead_letter_topic=DLQ).append(entries(1, 5))
    assert Spool(tmp_path, max_bytes=1 << 20, dead_letter_topic=DLQ).readback_window(2) == 5


def test_after_a_watermark_the_disk_refused_a_restart_reads_back_every_pending_entry(tmp_path, monkeypatch):
    import serving.spool as spool_module

    spool = Spool(tmp_path, max_bytes=1 << 20, dead_letter_topic=DLQ)
    assert spool.readback_window(2) == 2  # this process hands at most 2 entries to the producer at once
    spool.append(entries(1, 10))
    assert (tmp_path / "spool.window").read_text().split() == ["2"]
    write = spool_module.replace_with_text

    def full(path, text):
        if path.name == "spool.acked":
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(path, text)

    monkeypatch.setattr(spool_module, "replace_with_text", full)
    spool.ack_through(spool.read_pending(10)[7])  # the broker took 8; the watermark stays at 0
    assert spool.watermark_error is not None
    spool.close()  # a crash: the 8 come back as pending, where a window of 2 would check the first 2 only
    monkeypatch.undo()
    reopened = Spool(tmp_path, max_bytes=1 << 20, dead_letter_topic=DLQ)
    assert reopened.pending_records == 10
    assert reopened.readback_window(2) == 10


def test_no_entry_reads_as_pending_only_once_the_acknowledged_log_is_emptied(tmp_path, monkeypatch):
    # a logger's flush returns when no entry is pending: acknowledging everything must not show that
    # before the log is truncated (the watermark's fsync comes between them)
    import threading

    import serving.spool as spool_module

    spool = Spool(tmp_path, max_bytes=1 << 20, dead_letter_topic=DLQ)
    spool.append(entries(1, 3))
    last = spool.read_pending(10)[-1]
    write, writing = spool_module.replace_with_text, threading.Event()

    def slow_watermark(path, text):
        writing.set()
        time.sleep(0.3)  # a slow disk's fsync
        return write(path, text)

    monkeypatch.setattr(spool_module, "replace_with_text", slow_watermark)
    acknowledging = threading.Thread(target=spool.ack_through, args=(last,))
    acknowledging.start()
    assert writing.wait(5)
    deadline = time.monotonic() + ACK_WAIT_S
    while spool.pending_records:
        assert time.monotonic() < deadline, f"{spool.pending_records} records still pending {ACK_WAIT_S:g} s on"
        time.sleep(0.01)
    assert (tmp_path / "spool.log").stat().st_size == 0
    acknowledging.join(ACK_WAIT_S)
    assert not acknowledging.is_alive(), f"ack_through still running {ACK_WAIT_S:g} s on"
