"""A spool fsync in progress (the writer's group commit holds the spool's lock through it) must not
stall ``InteractionLogger.submit()``, which runs on the event loop."""

from __future__ import annotations

import threading

from serving.spool import Spool
from serving.spool_sender import SpoolSender
from tests.serving.fakes import FakeProducer
from tests.serving import test_interaction_log
from tests.serving.test_interaction_log import BlockingFsync, interaction

make_logger = test_interaction_log.make_logger  # the fixture: loggers closed at the end

SENDER_THREAD = "interaction-log-sender"


def test_submit_does_not_wait_for_a_spool_fsync_the_sender_waits_for(make_logger, monkeypatch):
    """The write_ahead sender, finding nothing to ship, asked the spool how many records were pending
    while it held the log's lock; the spool's lock is held through the writer's fsync, so submit(),
    which needs the log's lock, waited for that fsync (a whole slow disk's fsync on the event loop)."""
    fsync = BlockingFsync()
    monkeypatch.setattr("serving.spool.os.fsync", fsync)
    replayed, asking = threading.Event(), threading.Event()
    replay, pending_records = SpoolSender.replay, Spool.pending_records

    def replay_then_a_write_begins(self):
        progressed = replay(self)
        if not replayed.is_set():  # the writer takes the spool's lock for its fsync before the sender waits
            replayed.set()
            assert fsync.entered.wait(5)
        return progressed

    def watched_pending_records(self):
        if threading.current_thread().name == SENDER_THREAD and fsync.entered.is_set():
            asking.set()  # it waits for the spool's lock (the fsync) now
        return pending_records.fget(self)

    monkeypatch.setattr(SpoolSender, "replay", replay_then_a_write_begins)
    monkeypatch.setattr(Spool, "pending_records", property(watched_pending_records))
    logger = make_logger(FakeProducer(), durability="write_ahead", stall_s=60)
    assert replayed.wait(5)
    first = logger.submit(interaction(1))  # the writer appends it: its fsync does not return
    assert asking.wait(5)
    submitted = threading.Event()
    threading.Thread(target=lambda: (logger.submit(interaction(2)), submitted.set()), daemon=True).start()
    try:
        assert submitted.wait(5), "submit() waited for the spool's fsync"
    finally:
        fsync.release.set()
    assert logger.flush(5) and first.durable
