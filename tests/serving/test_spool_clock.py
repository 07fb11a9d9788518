"""A wall clock stepping back between a record's creation and its send: the step is written down
before the send, and the read back after a crash starts at it, so the copy is found, not sent twice."""

from __future__ import annotations

import threading

import pytest

from online_sao.config import TopicsConfig
from online_sao.schemas import Interaction, decode
from serving.interaction_log import InteractionLogger, LogSettings
from serving.spool_clock import CLOCK_STEP_FILE, ClockStep, ClockSteps
from streams.base import Producer, StreamMessage
from tests.serving.conftest import wait_until

TOPICS = TopicsConfig()
CREATED = 1_000_000.0
"""Every record's creation time; the wall clock reads this until the test steps it."""


class WallClock:
    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_a_step_back_is_written_once_read_after_a_restart_and_forgotten_once_its_records_are_acknowledged(tmp_path):
    wall = WallClock(CREATED)
    steps = ClockSteps(tmp_path, restart_seq=0, wall=wall)
    steps.created(1, CREATED)
    steps.created(2, CREATED)
    steps.before_send()
    assert steps.step is None and not (tmp_path / CLOCK_STEP_FILE).exists()
    wall.now = CREATED - 300.0
    steps.before_send()
    wall.now += 0.5
    steps.before_send()  # still before the latest creation, but after the step's reading: no second write
    assert steps.noticed == 1 and steps.step == ClockStep(floor_s=CREATED - 300.0, through_seq=2)

    restarted = ClockSteps(tmp_path, restart_seq=2, wall=wall)
    assert restarted.step == ClockStep(floor_s=CREATED - 300.0, through_seq=2)
    assert restarted.read_back_floor(1) == CREATED - 300.0
    assert restarted.read_back_floor(3) is None  # the oldest pending record was created after the step
    restarted.acknowledged_through(1)
    assert (tmp_path / CLOCK_STEP_FILE).exists()
    restarted.acknowledged_through(2)
    assert restarted.step is None and not (tmp_path / CLOCK_STEP_FILE).exists()


def test_a_second_step_keeps_the_earlier_reading_and_covers_the_records_since(tmp_path):
    wall = WallClock(CREATED)
    steps = ClockSteps(tmp_path, restart_seq=0, wall=wall)
    steps.created(1, CREATED)
    wall.now = CREATED - 100.0
    steps.before_send()
    steps.created(2, CREATED - 99.0)
    wall.now = CREATED - 400.0
    steps.before_send()
    assert steps.noticed == 2 and steps.step == ClockStep(floor_s=CREATED - 400.0, through_seq=2)


def test_jitter_under_the_tolerance_is_not_a_step(tmp_path):
    wall = WallClock(CREATED - 0.5)
    steps = ClockSteps(tmp_path, restart_seq=0, wall=wall)
    steps.created(1, CREATED)
    steps.before_send()
    assert steps.step is None and steps.noticed == 0


def test_a_damaged_step_file_reads_the_earlier_process_records_back_from_the_start(tmp_path):
    (tmp_path / CLOCK_STEP_FILE).write_text("{not json")
    steps = ClockSteps(tmp_path, restart_seq=7)
    assert steps.step == ClockStep(floor_s=0.0, through_seq=7)


class StampingBroker(Producer):
    """A topic that stamps each copy with the wall clock of its send (the producer's CreateTime).
    ``reports``: False for a process that dies before any delivery report reaches it."""

    def __init__(self, wall: WallClock, log: list[StreamMessage] | None = None, reports: bool = True):
        self.wall, self.log, self.reports = wall, [] if log is None else log, reports
        self.lock = threading.Lock()

    def send(self, topic, value, key=None, on_delivery=None):
        with self.lock:
            self.log.append(StreamMessage(topic, 0, len(self.log), key, value, int(self.wall() * 1000)))
        if self.reports and on_delivery is not None:
            on_delivery(None)

    def flush(self, timeout_s=None):
        pass

    def close(self):
        pass

    def tail(self, topics, since_s):
        """Kafka's read by time: from the first record stamped at or after ``since_s`` to the end."""
        with self.lock:
            first = next((m.offset for m in self.log if m.timestamp_ms >= since_s * 1000), len(self.log))
            return [m for m in self.log[first:] if m.topic in topics]


@pytest.mark.parametrize("mode", ["write_ahead", "memory"])
def test_records_sent_after_the_clock_stepped_back_are_found_after_a_crash_and_not_sent_again(tmp_path, mode):
    wall = WallClock(CREATED)
    settings = LogSettings(durability=mode, window=4, stall_s=60.0, retry_s=0.05)
    silent = StampingBroker(wall, reports=False)
    crashed = InteractionLogger(silent, TOPICS, tmp_path / "spool", settings, wall=wall)
    wall.now = CREATED - 300.0  # NTP corrects a clock that ran five minutes fast, before the sends
    crashed.start()
    records = [Interaction(interaction_id=f"id-{i}", model="m", prompt_ids=[1], response_ids=[2], action_mask=[True],
                           logprobs=[-0.5], versions=[0], created_at=CREATED) for i in range(6)]
    receipts = [crashed.submit(r) for r in records]
    assert all(r.wait(5) for r in receipts)
    if mode == "memory":  # acknowledged at once in memory; spooled on the way out, as a stalled broker makes it
        assert wait_until(lambda: len(silent.log) == 4)
        crashed.close(timeout_s=0.2)
    assert wait_until(lambda: len(silent.log) == 4)  # the window: four on the topic, stamped 300 s early
    # the process dies: the spool holds all six above its watermark

    up = StampingBroker(wall, log=silent.log)
    restarted = InteractionLogger(up, TOPICS, tmp_path / "spool", settings, readback=up.tail, wall=wall)
    restarted.start()
    try:
        assert restarted.flush(10.0)
    finally:
        restarted.close(timeout_s=1.0)
    assert [decode(m.value).interaction_id for m in up.log] == [f"id-{i}" for i in range(6)]  # each once
    assert restarted.found_on_topic == 4
    assert not (tmp_path / "spool" / CLOCK_STEP_FILE).exists()  # all acknowledged: the step is forgotten


def test_a_step_is_forgotten_by_a_start_whose_spool_holds_nothing_pending(tmp_path):
    """In memory mode records reach the broker without passing the spool's watermark: a step written
    down then is forgotten by the next start that finds nothing pending."""
    (tmp_path / "spool").mkdir()
    (tmp_path / "spool" / CLOCK_STEP_FILE).write_text(f'{{"floor_s": {CREATED}, "through_seq": 9}}')
    assert ClockSteps(tmp_path / "spool", restart_seq=0).step == ClockStep(floor_s=CREATED, through_seq=9)
    logger = InteractionLogger(StampingBroker(WallClock(CREATED)), TOPICS, tmp_path / "spool",
                               LogSettings(durability="memory"))
    logger.close(timeout_s=1.0)
    assert not (tmp_path / "spool" / CLOCK_STEP_FILE).exists()


def test_one_step_noticed_while_an_earlier_process_records_are_sent_is_written_once(tmp_path, monkeypatch):
    """The clock was set back an hour while serving was down; the restarted process sends the three
    records the earlier one spooled, created a second apart. One step: one write covering all three
    (each record used to count as a step of its own, with a warning and an fsynced write each)."""
    writes = []
    write = ClockSteps._write
    monkeypatch.setattr(ClockSteps, "_write", lambda self, step: (writes.append(step), write(self, step)))
    wall = WallClock(CREATED - 3600.0)
    steps = ClockSteps(tmp_path, restart_seq=3, wall=wall)
    for seq in (1, 2, 3):  # as the sender hands them: their creation times, then the send
        steps.created(seq, CREATED + seq)
        steps.before_send()
    assert steps.noticed == 1
    assert writes == [ClockStep(floor_s=CREATED - 3600.0, through_seq=3)]
    assert steps.read_back_floor(3) == CREATED - 3600.0


def test_a_step_from_an_earlier_process_still_notices_a_step_below_its_reading(tmp_path):
    (tmp_path / CLOCK_STEP_FILE).write_text('{"floor_s": %r, "through_seq": 3}' % (CREATED - 300.0))
    wall = WallClock(CREATED - 600.0)  # set back further while serving was down
    steps = ClockSteps(tmp_path, restart_seq=3, wall=wall)
    steps.created(1, CREATED)
    steps.before_send()
    assert steps.noticed == 1 and steps.step == ClockStep(floor_s=CREATED - 600.0, through_seq=3)
