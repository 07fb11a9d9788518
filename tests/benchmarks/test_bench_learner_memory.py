"""The learner memory benchmark: its trimming broker keeps Kafka's offsets while dropping what every
reading group committed, its slope, and a tiny end-to-end run that writes the report and the plot."""

from __future__ import annotations

import re

from benchmarks.bench_learner_memory import main, slope
from benchmarks.trimming_broker import KEEP_UNREAD, TrimmingBackend
from streams.base import TopicPartition

TP = TopicPartition("t", 0)


def backend_with(records: int) -> TrimmingBackend:
    backend = TrimmingBackend()
    backend.create_topic("t", 1)
    producer = backend.producer()
    for i in range(records):
        producer.send("t", str(i).encode())
    return backend


def test_a_commit_drops_the_records_below_it_and_a_new_reader_starts_at_the_right_offset():
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

    anyone = backend.consumer(["t"], group_id=None, start="earliest")  # asks for 0: moved to the log start
    assert [m.offset for m in anyone.poll(timeout_s=0.0)] == [6, 7, 8, 9, 10]
    backend.producer().send("t", b"11")
    assert [m.offset for m in anyone.poll(timeout_s=0.0)] == [11]  # its position is past what it read


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


def test_the_slope_is_the_least_squares_one():
    assert slope([0, 1, 2, 3], [1.0, 2.0, 2.0, 5.0]) == 1.2  # by hand: sum dx*dy = 6, sum dx^2 = 5
    assert slope([4, 4], [1.0, 9.0]) is None


def test_a_tiny_run_reports_its_samples_and_slope_and_plots_rss(tiny_model_dir, tmp_path):
    out = tmp_path / "memory.md"
    assert main(["--steps", "6", "--sample-every", "2", "--fit-from", "2", "--model-dir", str(tiny_model_dir),
                 "--set", "reward.memory_s=10", "--set", "reward.window_s=5", "--out", str(out)]) == 0
    text = out.read_text()
    rows = [line.split("|")[1:-1] for line in text.splitlines() if re.match(r"\| \d+ \|", line)]
    assert [int(row[0]) for row in rows] == [0, 2, 4, 5]  # every second step and before the last one
    assert all(float(row[2]) > float(row[3]) > 0 for row in rows)  # RSS, then malloc in use, in MiB
    assert int(rows[-1][4]) > 0  # the learner's id memory was found and holds the trained ids
    assert re.search(r"\*\*RSS: -?\d+\.\d+ KiB/step\*\*", text)
    assert re.search(r"\*\*malloc in use: -?\d+\.\d+ KiB/step\*\*", text)
    assert "id memory horizon 10 s" in text
    assert (tmp_path / "memory.png").read_bytes().startswith(b"\x89PNG")
    assert "![RSS over steps](memory.png)" in text
