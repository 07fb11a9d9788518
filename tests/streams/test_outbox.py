"""The outbox: a record the broker refused is sent again at the next flush, and flush raises until
every record is acknowledged (the feed's dead letters before its offsets: tests/trainer/test_feed.py)."""

from __future__ import annotations

import pytest

from streams.base import Producer, StreamUnavailable
from streams.outbox import Outbox


class FlakyBroker(Producer):
    """Refuses the first ``refuse`` records it is given (a delivery timeout), takes the rest; like
    kafka-python, its flush raises once for the refused ones and then forgets them."""

    def __init__(self, refuse: int) -> None:
        self.refuse, self.stored, self.reports, self.failures = refuse, [], [], 0

    def send(self, topic, value, key=None, on_delivery=None):
        self.reports.append((topic, value, on_delivery))

    def flush(self, timeout_s=None):
        reports, self.reports = self.reports, []
        failed = 0
        for topic, value, on_delivery in reports:
            if self.refuse > 0:
                self.refuse -= 1
                failed += 1
                if on_delivery is not None:
                    on_delivery(StreamUnavailable("delivery timed out"))
            else:
                self.stored.append((topic, value))
                if on_delivery is not None:
                    on_delivery(None)
        if failed:
            raise StreamUnavailable(f"{failed} record(s) were not acknowledged")

    def close(self):
        pass


def test_a_refused_record_is_sent_again_until_the_broker_has_it():
    broker = FlakyBroker(refuse=3)
    outbox = Outbox(broker)
    outbox.send("dead", b"a")
    outbox.send("dead", b"b")
    with pytest.raises(StreamUnavailable, match="2 record"):
        outbox.flush()  # both refused: sent again
    with pytest.raises(StreamUnavailable, match="1 record"):
        outbox.flush()  # a refused once more, b stored
    outbox.flush()
    assert broker.stored == [("dead", b"b"), ("dead", b"a")] and outbox.unacknowledged == 0


def test_a_failure_of_someone_elses_record_does_not_hold_the_outbox():
    broker = FlakyBroker(refuse=1)
    broker.send("weights", b"notice", on_delivery=lambda error: None)  # another sender's record, refused
    outbox = Outbox(broker)
    outbox.send("dead", b"a")
    outbox.flush()  # the outbox's own record was taken: nothing of its own is missing
    assert broker.stored == [("dead", b"a")]


def test_per_record_reports_are_the_outboxs_own():
    with pytest.raises(ValueError, match="through flush"):
        Outbox(FlakyBroker(0)).send("dead", b"a", on_delivery=lambda error: None)


class AwayBroker(FlakyBroker):
    """Its producer cannot take a record while ``away`` (kafka-python's send raises after max_block_ms
    without metadata or with a full buffer)."""

    def __init__(self) -> None:
        super().__init__(refuse=0)
        self.away = True

    def send(self, topic, value, key=None, on_delivery=None):
        if self.away:
            raise StreamUnavailable("sending: Kafka not reachable")
        super().send(topic, value, key, on_delivery)


def test_a_record_the_producer_could_not_take_goes_out_at_the_flush_after_the_broker_is_back():
    """The send's error escaped (the learner's poll with it), and the record kept in the outbox was never
    sent again: every later flush failed, the broker back or not."""
    broker = AwayBroker()
    outbox = Outbox(broker)
    outbox.send("dead", b"a")  # kept, not raised
    with pytest.raises(StreamUnavailable, match="1 record"):
        outbox.flush()  # still away: sent again, refused again
    broker.away = False
    with pytest.raises(StreamUnavailable, match="1 record"):
        outbox.flush()  # handed over now; acknowledged at the producer's next flush
    outbox.flush()
    assert broker.stored == [("dead", b"a")] and outbox.unacknowledged == 0
