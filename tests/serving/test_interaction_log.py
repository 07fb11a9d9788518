"""The interaction logger: write-ahead acknowledgement, group commit, spooling through outages,
in-order replay, exactly once per process, recovery after a crash, full disk."""

from __future__ import annotations

import errno
import threading
import time

import pytest

from online_sao.config import TopicsConfig
from online_sao.schemas import DeadLetter, Interaction, Reward, decode
from serving.interaction_log import InteractionLogger, LogSettings
from serving.spool import Spool
from streams.base import StreamMessage, StreamUnavailable
from tests.serving.conftest import wait_until
from tests.serving.fakes import FakeProducer

TOPICS = TopicsConfig()
MODES = ["write_ahead", "memory"]


def interaction(i: int) -> Interaction:
    return Interaction(interaction_id=f"id-{i:04d}", model="m", prompt_ids=[1, 2], response_ids=[3],
                       action_mask=[True], logprobs=[-0.5], versions=[0])


def delivered_ids(producer: FakeProducer) -> list[str]:
    return [decode(value).interaction_id for _, _, value in producer.delivered]


@pytest.fixture
def make_logger(tmp_path):
    loggers = []

    def make(producer, readback=None, **kwargs) -> InteractionLogger:
        options = dict(stall_s=0.2, retry_s=0.05, window=4) | kwargs
        logger = InteractionLogger(producer, TOPICS, tmp_path / "spool", LogSettings(**options), readback=readback)
        logger.start()
        loggers.append(logger)
        return logger

    yield make
    for logger in loggers:
        logger.close(timeout_s=1.0)


class BlockingFsync:
    """Stands in for os.fsync of the spool: each call waits until released."""

    def __init__(self):
        self.release = threading.Event()
        self.calls = 0
        self.entered = threading.Event()

    def __call__(self, fd):
        self.calls += 1
        self.entered.set()
        assert self.release.wait(10), "fsync never released"


@pytest.mark.parametrize("mode", MODES)
def test_records_reach_the_broker_in_order_keyed_by_id(make_logger, tmp_path, mode):
    producer = FakeProducer()
    logger = make_logger(producer, durability=mode)
    receipts = [logger.submit(interaction(i)) for i in range(10)]
    receipts.append(logger.submit(Reward(interaction_id="id-0003", value=1.0)))
    assert logger.flush(5.0)
    assert all(r.durable for r in receipts)
    assert delivered_ids(producer) == [f"id-{i:04d}" for i in range(10)] + ["id-0003"]
    assert [t for t, _, _ in producer.delivered] == [TOPICS.interactions] * 10 + [TOPICS.rewards]
    assert producer.delivered[0][1] == b"id-0000"  # keyed by interaction id
    assert logger.spool_records == 0
    log = tmp_path / "spool" / "spool.log"
    if mode == "memory":  # the disk is not touched while the broker keeps up
        assert not log.exists()
    else:  # every record went through the log, which is emptied once all are acknowledged
        assert log.exists() and log.stat().st_size == 0


def test_memory_mode_acknowledges_at_once(tmp_path):
    logger = InteractionLogger(FakeProducer(), TOPICS, tmp_path / "spool",
                               LogSettings(durability="memory"))  # not started
    assert logger.submit(interaction(0)).durable


def test_write_ahead_acknowledges_after_the_fsync_and_ships_from_the_log(make_logger, monkeypatch):
    fsync = BlockingFsync()
    monkeypatch.setattr("serving.spool.os.fsync", fsync)
    producer = FakeProducer()
    logger = make_logger(producer)
    receipt = logger.submit(interaction(0))
    assert fsync.entered.wait(5)
    assert not receipt.wait(0.3)  # written, not yet fsynced: not acknowledged
    assert producer.delivered == []  # the sender ships only what is on disk
    fsync.release.set()
    assert receipt.wait(5)
    assert logger.flush(5.0)
    assert delivered_ids(producer) == ["id-0000"]


def test_concurrent_records_share_one_fsync(make_logger, monkeypatch):
    fsync = BlockingFsync()
    monkeypatch.setattr("serving.spool.os.fsync", fsync)
    logger = make_logger(FakeProducer())
    first = logger.submit(interaction(0))
    assert fsync.entered.wait(5)
    waiting = [logger.submit(interaction(i)) for i in range(1, 21)]  # arrive during the first fsync
    appends_before = logger.mode.fsyncs
    fsync.release.set()
    assert first.wait(5) and all(r.wait(5) for r in waiting)
    assert logger.mode.fsyncs - appends_before == 2  # the first record's append, then one for all twenty
    assert logger.flush(5.0)


class HungProducer(FakeProducer):
    """A producer whose first send never returns (until ``unblock``): the process is as good as dead."""

    def __init__(self):
        super().__init__()
        self.unblock = threading.Event()

    def send(self, *args, **kwargs):
        self.unblock.wait()
        raise RuntimeError("the process was killed")


def test_write_ahead_ships_in_cycles_records_are_durable_without_waiting_for_one(make_logger, monkeypatch):
    interval = 0.4
    reads = []
    original = Spool.read_pending
    monkeypatch.setattr(Spool, "read_pending", lambda self, limit: reads.append(1) or original(self, limit))
    producer = FakeProducer()
    logger = make_logger(producer, ship_interval_s=interval)
    start = time.monotonic()
    for i in range(20):  # one by one, as sequential requests: each waits for its own fsync only
        assert logger.submit(interaction(i)).wait(interval / 2)
    assert logger.flush(5.0)
    elapsed = time.monotonic() - start
    assert delivered_ids(producer) == [f"id-{i:04d}" for i in range(20)]
    assert logger.mode.fsyncs >= 20 / 2  # durable record by record (group commit may pair a few)...
    assert len(reads) <= elapsed / interval + 2  # ...but shipped in cycles: one spool read serves many records


def test_close_does_not_wait_out_the_ship_interval(make_logger):
    producer = FakeProducer()
    logger = make_logger(producer, ship_interval_s=600.0)
    receipts = [logger.submit(interaction(i)) for i in range(3)]
    assert all(r.wait(5) for r in receipts)
    start = time.monotonic()
    report = logger.close(timeout_s=5.0)
    assert time.monotonic() - start < 60  # far below the interval: close wakes the sender
    assert delivered_ids(producer) == ["id-0000", "id-0001", "id-0002"]
    assert report.spooled == 0 and report.held_in_memory == 0


def test_a_crash_loses_nothing_acknowledged_the_next_start_replays_it_in_order(tmp_path, make_logger):
    hung = HungProducer()
    crashed = InteractionLogger(hung, TOPICS, tmp_path / "spool", LogSettings(stall_s=0.2, retry_s=0.05))
    crashed.start()
    try:
        receipts = [crashed.submit(interaction(i)) for i in range(6)]
        assert all(r.wait(5) for r in receipts)  # acknowledged to the clients: on disk
        # the process dies here (no close); the broker never saw a record
        up = FakeProducer()
        restarted = make_logger(up)
        restarted.submit(interaction(6))
        assert restarted.flush(10.0)
        assert delivered_ids(up) == [f"id-{i:04d}" for i in range(7)]  # the spool first, then the new record
    finally:
        hung.unblock.set()


class TakesSilently(FakeProducer):
    """The broker writes every record, but the process dies before any delivery report reaches it."""

    def send(self, topic, value, key=None, on_delivery=None):
        with self.lock:
            self.delivered.append((topic, key, value))


def reading_back(broker: FakeProducer, failures: int = 0):
    """A read back of the fake broker's log (every record stamped now); the first ``failures`` calls
    find the broker unreachable."""
    calls = []

    def tail(topics, since_s):
        calls.append(since_s)
        if len(calls) <= failures:
            raise StreamUnavailable("fake broker: unreachable")
        with broker.lock:
            return [StreamMessage(t, 0, i, k, v, int(time.time() * 1000))
                    for i, (t, k, v) in enumerate(broker.delivered) if t in topics]

    return tail, calls


@pytest.mark.parametrize("mode", MODES)
def test_records_the_broker_took_before_a_crash_are_not_sent_again(tmp_path, make_logger, mode):
    silent = TakesSilently()
    crashed = InteractionLogger(silent, TOPICS, tmp_path / "spool",
                                LogSettings(durability=mode, window=4, stall_s=60.0, retry_s=0.05))
    crashed.start()
    receipts = [crashed.submit(interaction(i)) for i in range(6)]
    assert all(r.wait(5) for r in receipts)
    if mode == "memory":  # acknowledged at once in memory; spooled on the way out, as a stalled broker makes it
        assert wait_until(lambda: len(silent.delivered) == 4)
        crashed.close(timeout_s=0.2)
    assert wait_until(lambda: len(silent.delivered) == 4)  # the window: four on the broker, none reported
    # the process dies: the spool holds all six above its watermark
    up = FakeProducer(delivered=silent.delivered)  # the same broker, reachable again
    tail, calls = reading_back(up, failures=2)
    restarted = make_logger(up, durability=mode, readback=tail)
    restarted.submit(interaction(6))
    assert restarted.flush(10.0)
    assert delivered_ids(up) == [f"id-{i:04d}" for i in range(7)]  # each once on the topic, in order
    assert restarted.found_on_topic == 4 and len(calls) == 3  # nothing was sent while it could not read back
    assert calls[-1] <= min(decode(v).created_at for _, _, v in silent.delivered[:4])


@pytest.mark.parametrize("mode", MODES)
def test_an_outage_spools_and_the_replay_delivers_everything_once_in_order(make_logger, mode):
    producer = FakeProducer()
    logger = make_logger(producer, durability=mode)
    logger.submit(interaction(0))
    assert logger.flush(5.0)
    producer.go_down()
    for i in range(1, 6):
        logger.submit(interaction(i))
    assert wait_until(lambda: logger.spooling and logger.spool_records == 5)
    for i in range(6, 20):  # submitted during the outage: to the spool
        logger.submit(interaction(i))
    assert wait_until(lambda: logger.spool_records == 19)
    assert logger.refusal() is None  # spooling is logging: new work is still accepted
    producer.come_back()
    assert logger.flush(10.0)
    assert delivered_ids(producer) == [f"id-{i:04d}" for i in range(20)]
    assert logger.spool_records == 0 and not logger.spooling
    logger.submit(interaction(20))
    assert logger.flush(5.0)
    assert delivered_ids(producer)[-1] == "id-0020"


@pytest.mark.parametrize("mode", MODES)
def test_records_the_producer_gave_up_on_are_sent_again(make_logger, mode):
    producer = FakeProducer()
    logger = make_logger(producer, durability=mode)
    producer.go_down()
    for i in range(3):
        logger.submit(interaction(i))
    assert wait_until(lambda: logger.spooling)
    assert wait_until(lambda: len(producer.held) == 3)
    assert producer.expire() == 3  # delivery timed out: not written
    assert wait_until(lambda: len(producer.held) == 3)  # re-sent after retry_s
    for i in range(3, 8):
        logger.submit(interaction(i))
    producer.come_back()
    assert logger.flush(10.0)
    assert delivered_ids(producer) == [f"id-{i:04d}" for i in range(8)]


@pytest.mark.parametrize("mode", MODES)
def test_sends_refused_outright_are_spooled_and_replayed(make_logger, mode):
    producer = FakeProducer(refuse_sends=True)
    logger = make_logger(producer, durability=mode)
    for i in range(6):
        logger.submit(interaction(i))
    assert wait_until(lambda: logger.spool_records == 6 and logger.spooling)
    producer.refuse_sends = False
    assert logger.flush(10.0)
    assert delivered_ids(producer) == [f"id-{i:04d}" for i in range(6)]


@pytest.mark.parametrize("mode", MODES)
def test_close_during_an_outage_leaves_the_spool_for_the_next_start(make_logger, tmp_path, mode):
    down = FakeProducer()
    first = InteractionLogger(down, TOPICS, tmp_path / "spool", LogSettings(durability=mode, stall_s=0.2, retry_s=0.05))
    first.start()
    down.go_down()
    for i in range(7):
        first.submit(interaction(i))
    report = first.close(timeout_s=0.5)
    assert (report.spooled, report.held_in_memory) == (7, 0)
    up = FakeProducer()
    second = make_logger(up, durability=mode)
    second.submit(interaction(7))
    assert second.flush(10.0)
    assert delivered_ids(up) == [f"id-{i:04d}" for i in range(8)]  # spool first, then the new record


@pytest.mark.parametrize("mode", MODES)
def test_close_with_the_broker_up_delivers_everything(tmp_path, mode):
    producer = FakeProducer()
    logger = InteractionLogger(producer, TOPICS, tmp_path / "spool", LogSettings(durability=mode))
    logger.start()
    for i in range(50):
        logger.submit(interaction(i))
    report = logger.close(timeout_s=5.0)
    assert (report.acknowledged, report.spooled, report.held_in_memory) == (50, 0, 0)
    assert len(producer.delivered) == 50


@pytest.mark.parametrize("mode", MODES)
def test_a_full_spool_during_an_outage_refuses_new_work_until_the_broker_returns(make_logger, mode):
    producer = FakeProducer()
    record_bytes = 600  # one spooled interaction is about this large
    logger = make_logger(producer, durability=mode, spool_max_bytes=3 * record_bytes)
    producer.go_down()
    for i in range(8):
        logger.submit(interaction(i))
    assert wait_until(lambda: logger.refusal() is not None)
    reason = logger.refusal()
    assert "broker is unreachable" in reason and "spool_max_bytes" in reason
    producer.come_back()
    assert logger.flush(10.0)
    assert logger.refusal() is None
    assert delivered_ids(producer) == [f"id-{i:04d}" for i in range(8)]


def test_write_ahead_on_a_full_disk_acknowledges_once_the_broker_has_the_record(make_logger, monkeypatch):
    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("serving.spool.os.fsync", no_space)
    producer = FakeProducer()
    logger = make_logger(producer)
    receipts = [logger.submit(interaction(i)) for i in range(3)]
    assert all(r.wait(5) for r in receipts)  # not on disk, but acknowledged by the broker: durable
    assert logger.refusal() is None  # the broker takes records: still logging
    assert delivered_ids(producer) == ["id-0000", "id-0001", "id-0002"]
    producer.go_down()
    late = logger.submit(interaction(3))
    assert wait_until(lambda: logger.refusal() is not None)
    assert "broker is unreachable" in logger.refusal() and "No space left" in logger.refusal()
    assert not late.durable
    producer.come_back()
    assert late.wait(5) and logger.flush(10.0)
    assert logger.refusal() is None


def test_a_full_queue_refuses_new_work(tmp_path):
    logger = InteractionLogger(FakeProducer(), TOPICS, tmp_path / "spool", LogSettings(max_queue=3))  # not started
    for i in range(3):
        logger.submit(interaction(i))
    assert "backlog is full" in logger.refusal()


@pytest.mark.parametrize("mode", MODES)
def test_an_unexpected_producer_error_is_reported_not_hidden(make_logger, mode):
    class Broken(FakeProducer):
        def send(self, *args, **kwargs):
            raise RuntimeError("producer is closed")

    logger = make_logger(Broken(), durability=mode)
    logger.submit(interaction(0))
    assert wait_until(lambda: logger.refusal() is not None)
    assert "producer is closed" in logger.refusal()


def test_a_damaged_spool_entry_is_dead_lettered_and_the_records_after_it_still_reach_the_broker(
        tmp_path, make_logger):
    hung = HungProducer()
    crashed = InteractionLogger(hung, TOPICS, tmp_path / "spool", LogSettings(stall_s=0.2, retry_s=0.05))
    crashed.start()
    try:
        assert all(crashed.submit(interaction(i)).wait(5) for i in range(10))
        # the process dies here; then one entry in the middle of its spool is damaged on disk
        log = tmp_path / "spool" / "spool.log"
        lines = log.read_bytes().split(b"\n")
        lines[4] = lines[4][:60] + bytes([lines[4][60] ^ 0x01]) + lines[4][61:]
        log.write_bytes(b"\n".join(lines))
        up = FakeProducer()
        restarted = make_logger(up)
        restarted.submit(interaction(10))
        assert restarted.flush(10.0)
    finally:
        hung.unblock.set()
    topics = [topic for topic, _, _ in up.delivered]
    assert topics == [TOPICS.interactions] * 9 + [TOPICS.dead_letters, TOPICS.interactions]
    assert delivered_ids(FakeProducer(delivered=up.delivered[:9])) == [f"id-{i:04d}" for i in range(10) if i != 4]
    letter = decode(up.delivered[9][2], DeadLetter)
    assert letter.raw == lines[4] + b"\n" and "checksum" in letter.reason
    assert decode(up.delivered[10][2]).interaction_id == "id-0010"


@pytest.mark.parametrize("mode", MODES)
def test_a_spool_that_cannot_be_read_for_a_moment_is_read_again_and_the_logger_goes_on(make_logger, monkeypatch, mode):
    """Two reads of the spool fail (the process briefly out of file descriptors): the sender tries
    again after retry_s (the error used to end its thread, and the logger refused work for good)."""
    producer = FakeProducer(refuse_sends=True)
    logger = make_logger(producer, durability=mode)
    for i in range(3):
        logger.submit(interaction(i))
    assert wait_until(lambda: logger.spool_records == 3 and logger.spooling)
    failures = [2]

    def out_of_descriptors(path, mode="r", *args, **kwargs):
        if mode == "rb" and failures[0]:
            failures[0] -= 1
            raise OSError(errno.EMFILE, "Too many open files", str(path))
        return open(path, mode, *args, **kwargs)

    monkeypatch.setattr("serving.spool.open", out_of_descriptors, raising=False)
    assert wait_until(lambda: failures[0] == 0)
    producer.refuse_sends = False
    logger.submit(interaction(3))
    assert logger.flush(10.0)
    assert logger.refusal() is None
    assert delivered_ids(producer) == ["id-0000", "id-0001", "id-0002", "id-0003"]


@pytest.mark.parametrize("mode", MODES)
def test_records_a_wider_window_handed_out_before_a_crash_are_not_sent_again_after_a_narrower_restart(
        tmp_path, make_logger, mode):
    """The crashed process had serving.log_window 8, the restarted one 2: the read back still checks
    the 8 records the broker may hold (it checked 2, and sent the other 6 a second time)."""
    silent = TakesSilently()
    crashed = InteractionLogger(silent, TOPICS, tmp_path / "spool",
                                LogSettings(durability=mode, window=8, stall_s=60.0, retry_s=0.05))
    crashed.start()
    assert all(r.wait(5) for r in [crashed.submit(interaction(i)) for i in range(10)])
    assert wait_until(lambda: len(silent.delivered) == 8)  # the window: eight on the broker, none reported
    if mode == "memory":  # spooled on the way out, as a stalled broker makes it
        crashed.close(timeout_s=0.2)
    # the process dies: the spool holds all ten above its watermark
    up = FakeProducer(delivered=silent.delivered)
    tail, _ = reading_back(up)
    restarted = make_logger(up, durability=mode, readback=tail, window=2)
    assert restarted.flush(10.0)
    assert delivered_ids(up) == [f"id-{i:04d}" for i in range(10)]  # each once on the topic, in order
    assert restarted.found_on_topic == 8
