"""The in-memory broker's retention (``drop_committed``): records go once every reading group
committed past them, offsets keep Kafka's numbering, and a reader below the log start moves up."""

from __future__ import annotations

from streams.base import TopicPartition
from streams.memory import KEEP_UNREAD, InMemoryBackend

TP = TopicPartition("t", 0)


def backend_with(records: int, drop_committed: bool = True) -> InMemoryBackend:
    backend = InMemoryBackend(drop_committed=drop_committed)
    backend.create_topic("t", 1)
    producer = backend.producer()
    for i in range(records):
        producer.send("t", str(i).encode())
    return backend


def test_a_commit_deletes_the_records_below_it_and_a_new_reader_starts_at_the_right_offset():
    backend = backend_with(10)
    first = backend.consumer(["t"], group_id="g")
    assert [m.offset for m in first.poll(timeout_s=0.0)] == list(range(10))
    first.commit({TP: 6})
    assert backend.records_held() == 4
    assert backend.log_start(TP) == 6
    first.close()

    again = backend.consumer(["t"], group_id="g")  # restarts at the group's committed offset
    assert [(m.offset, m.value) for m in again.poll(timeout_s=0.0)] == [(6, b"6"), (7, b"7"), (8, b"8"), (9, b"9")]
    assert again.beginning_offsets() == {TP: 6} and again.end_offsets() == {TP: 10}

    backend.producer().send("t", b"10")  # offsets go on from the end, never reused
    assert [(m.offset, m.value) for m in again.poll(timeout_s=0.0)] == [(10, b"10")]

    anyone = backend.consumer(["t"], group_id=None, start="earliest")  # starts at the log start, not 0
    assert [m.offset for m in anyone.poll(timeout_s=0.0)] == [6, 7, 8, 9, 10]
    backend.producer().send("t", b"11")
    assert [m.offset for m in anyone.poll(timeout_s=0.0)] == [11]  # its position is past what it read


def test_a_position_below_the_log_start_moves_up_to_it():
    backend = backend_with(10)
    reader = backend.consumer(["t"], group_id=None, start="earliest")
    backend.consumer(["t"], group_id="g").commit({TP: 7})
    reader.seek(TP, 2)  # deleted since: Kafka's auto.offset.reset=earliest
    assert [m.offset for m in reader.poll(timeout_s=0.0)] == [7, 8, 9]
    assert reader.offsets_for_time(0) == {TP: 7}


def test_records_stay_until_every_group_reading_the_topic_committed_past_them():
    backend = backend_with(10)
    fast, slow = backend.consumer(["t"], group_id="fast"), backend.consumer(["t"], group_id="slow")
    fast.commit({TP: 8})
    assert backend.records_held() == 10  # the slow group has committed nothing yet
    slow.commit({TP: 3})
    assert backend.log_start(TP) == 3 and backend.records_held() == 7
    assert [m.offset for m in slow.poll(timeout_s=0.0)] == list(range(3, 10))


def test_a_topic_no_group_reads_keeps_its_newest_records():
    backend = backend_with(KEEP_UNREAD + 5)
    reader = backend.consumer(["t"], group_id=None, start="earliest")
    assert [m.offset for m in reader.poll(timeout_s=0.0)] == list(range(5, KEEP_UNREAD + 5))


def test_without_drop_committed_nothing_is_deleted():
    backend = backend_with(KEEP_UNREAD + 5, drop_committed=False)
    group = backend.consumer(["t"], group_id="g")
    group.commit({TP: KEEP_UNREAD})
    assert backend.records_held() == KEEP_UNREAD + 5 and backend.log_start(TP) == 0
    assert group.beginning_offsets() == {TP: 0}
    reader = backend.consumer(["t"], group_id=None, start="earliest")
    assert [m.offset for m in reader.poll(timeout_s=0.0)] == list(range(KEEP_UNREAD + 5))
