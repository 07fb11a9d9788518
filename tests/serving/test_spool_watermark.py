"""The spool's acknowledgement watermark (``spool.acked``) found unreadable at a start."""

from __future__ import annotations

import logging

import pytest

from serving.spool import Spool
from tests.serving import test_spool
from tests.serving.test_spool import DLQ, entries

close_spools = test_spool.close_spools  # the fixture: every spool opened here is closed


@pytest.mark.parametrize("damaged", [b"", b"\x00\x00\n", b"\xff8\n"], ids=["empty", "zeros", "not-text"])
def test_an_unreadable_watermark_makes_every_entry_pending_and_read_back(tmp_path, caplog, damaged):
    """It used to read as 0 without a word while the narrow ``spool.window`` written beside it was
    trusted: the restart read back 2 of the 8 records the broker held and sent the other 6 again."""
    spool = Spool(tmp_path, max_bytes=1 << 20, dead_letter_topic=DLQ)
    assert spool.readback_window(2) == 2
    spool.append(entries(1, 10))
    spool.ack_through(spool.read_pending(10)[7])  # the broker took 8 (too few bytes to compact)
    spool.close()
    (tmp_path / "spool.acked").write_bytes(damaged)
    with caplog.at_level(logging.WARNING, logger="serving.spool"):
        reopened = Spool(tmp_path, max_bytes=1 << 20, dead_letter_topic=DLQ)
    assert [e.seq for e in reopened.read_pending(20)] == list(range(1, 11))
    assert reopened.readback_window(2) == 10  # every pending record is checked on the topics
    assert (tmp_path / "spool.window").read_text() == "10\n"  # and by the next start, after another crash
    assert "unreadable" in caplog.text and "spool.acked" in caplog.text


def test_a_missing_watermark_beside_a_log_is_no_warning(tmp_path, caplog):
    """No ``spool.acked`` is a spool whose broker never acknowledged anything: nothing was lost."""
    Spool(tmp_path, max_bytes=1 << 20, dead_letter_topic=DLQ).append(entries(1, 3))
    with caplog.at_level(logging.WARNING, logger="serving.spool"):
        assert Spool(tmp_path, max_bytes=1 << 20, dead_letter_topic=DLQ).pending_records == 3
    assert "unreadable" not in caplog.text
