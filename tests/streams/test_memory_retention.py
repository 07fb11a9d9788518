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


def test_a_group_with_no_open_member_keeps_the_records_past_its_committed_offset():
    """The learner checkpoints at 5 and restarts while serving logs 40 more: the group had no open
    member, the topic counted as unread, and each record sent cut the partition to its last
    KEEP_UNREAD, so the restarted learner lost offsets 5-28."""
    backend = backend_with(5)
    learner = backend.consumer(["t"], group_id="learner")
    assert [m.offset for m in learner.poll(timeout_s=0.0)] == [0, 1, 2, 3, 4]
    learner.commit({TP: 5})
    learner.close()
    producer = backend.producer()
    for i in range(5, 45):
        producer.send("t", str(i).encode())
    again = backend.consumer(["t"], group_id="learner")
    read = []
    while batch := again.poll(timeout_s=0.0):
        read += [m.offset for m in batch]
    assert read == list(range(5, 45))


def test_another_groups_commit_does_not_delete_past_a_closed_groups_committed_offset():
    backend = backend_with(12)
    closed = backend.consumer(["t"], group_id="closed")
    closed.commit({TP: 3})
    closed.close()
    backend.consumer(["t"], group_id="open").commit({TP: 10})
    assert backend.log_start(TP) == 3 and backend.records_held() == 9


def test_a_group_that_never_committed_does_not_hold_records_once_closed():
    """What counts as reading a topic: an open member, or committed offsets. Traffic logged before the
    first reader (or after a reader that never committed) keeps its last KEEP_UNREAD records."""
    backend = backend_with(2)
    backend.consumer(["t"], group_id="g").close()
    producer = backend.producer()
    for i in range(2, KEEP_UNREAD + 7):
        producer.send("t", str(i).encode())
    assert backend.log_start(TP) == 7 and backend.records_held() == KEEP_UNREAD
