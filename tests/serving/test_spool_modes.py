"""The spool log holds whole prompts and answers: the server's user alone may read it, whatever the umask."""

from __future__ import annotations

import os
import stat

import pytest

from serving.spool import Spool, SpoolEntry

DLQ = "dead-letters"


@pytest.fixture
def umask_022():
    """The usual umask, under which a file created without a mode was world-readable (0644)."""
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _entries(first: int, count: int) -> list[SpoolEntry]:
    return [SpoolEntry(seq, "t", f"k{seq}".encode(), b'{"prompt": "my secret question"}') for seq in
            range(first, first + count)]


def test_the_spool_log_is_readable_by_its_owner_alone(tmp_path, umask_022):
    spool = Spool(tmp_path, max_bytes=1 << 20, dead_letter_topic=DLQ)
    try:
        spool.append(_entries(1, 3))
        assert _mode(spool.log_path) == 0o600
    finally:
        spool.close()


def test_a_compacted_spool_log_stays_readable_by_its_owner_alone(tmp_path, umask_022):
    one = len(_entries(1, 1)[0].encode())
    spool = Spool(tmp_path, max_bytes=8 * one, dead_letter_topic=DLQ)
    try:
        spool.append(_entries(1, 6))
        spool.ack_through(spool.read_pending(10)[3])  # 4 acknowledged of 6: the rest is copied to a new file
        assert spool.compactions == 1 and _mode(spool.log_path) == 0o600
    finally:
        spool.close()
