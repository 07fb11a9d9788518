"""The spool log holds whole prompts and answers: the server's user alone may read it, whatever the umask."""

from __future__ import annotations

from serving.spool import Spool, SpoolEntry
from tests.fixtures.files import file_mode

DLQ = "dead-letters"


def _entries(first: int, count: int) -> list[SpoolEntry]:
    return [SpoolEntry(seq, "t", f"k{seq}".encode(), b'{"prompt": "my secret question"}') for seq in
            range(first, first + count)]


def test_the_spool_log_is_readable_by_its_owner_alone(tmp_path, umask_022):
    spool = Spool(tmp_path, max_bytes=1 << 20, dead_letter_topic=DLQ)
    try:
        spool.append(_entries(1, 3))
        assert file_mode(spool.log_path) == 0o600
    finally:
        spool.close()


def test_a_compacted_spool_log_stays_readable_by_its_owner_alone(tmp_path, umask_022):
    one = len(_entries(1, 1)[0].encode())
    spool = Spool(tmp_path, max_bytes=8 * one, dead_letter_topic=DLQ)
    try:
        spool.append(_entries(1, 6))
        spool.ack_through(spool.read_pending(10)[3])  # 4 acknowledged of 6: the rest is copied to a new file
        assert spool.compactions == 1 and file_mode(spool.log_path) == 0o600
    finally:
        spool.close()


def test_a_log_repaired_after_damage_and_its_damaged_bytes_stay_readable_by_their_owner_alone(tmp_path, umask_022):
    spool = Spool(tmp_path, max_bytes=1 << 20, dead_letter_topic=DLQ)
    spool.append(_entries(1, 3))
    spool.close()
    data = bytearray(spool.log_path.read_bytes())
    data[len(_entries(1, 1)[0].encode()) - 3] ^= 0xFF  # the first entry damaged: the log is rewritten
    spool.log_path.write_bytes(bytes(data))
    reopened = Spool(tmp_path, max_bytes=1 << 20, dead_letter_topic=DLQ)
    try:
        kept_aside = list(tmp_path.glob("spool.corrupt-*"))
        assert reopened.dropped_corrupt_bytes > 0 and kept_aside
        assert [file_mode(p) for p in [reopened.log_path, *kept_aside]] == [0o600] * (1 + len(kept_aside))
    finally:
        reopened.close()
