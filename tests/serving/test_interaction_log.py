"""The interaction logger: direct delivery, spooling through outages, in-order replay, exactly once."""

from __future__ import annotations

import pytest

from online_sao.config import TopicsConfig
from online_sao.schemas import Interaction, Reward, decode
from serving.interaction_log import InteractionLogger
from tests.serving.conftest import wait_until
from tests.serving.fakes import FakeProducer

TOPICS = TopicsConfig()


def interaction(i: int) -> Interaction:
    return Interaction(interaction_id=f"id-{i:04d}", model="m", prompt_ids=[1, 2], response_ids=[3],
                       action_mask=[True], logprobs=[-0.5], versions=[0])


def delivered_ids(producer: FakeProducer) -> list[str]:
    return [decode(value).interaction_id for _, _, value in producer.delivered]


@pytest.fixture
def make_logger(tmp_path):
    loggers = []

    def make(producer, **kwargs) -> InteractionLogger:
        options = dict(stall_s=0.2, retry_s=0.05, window=4) | kwargs
        logger = InteractionLogger(producer, TOPICS, tmp_path / "spool", **options)
        logger.start()
        loggers.append(logger)
        return logger

    yield make
    for logger in loggers:
        logger.close(timeout_s=1.0)


def test_records_go_straight_to_the_broker_while_it_is_up(make_logger, tmp_path):
    producer = FakeProducer()
    logger = make_logger(producer)
    for i in range(10):
        logger.submit(interaction(i))
    logger.submit(Reward(interaction_id="id-0003", value=1.0))
    assert logger.flush(5.0)
    assert delivered_ids(producer) == [f"id-{i:04d}" for i in range(10)] + ["id-0003"]
    assert [t for t, _, _ in producer.delivered] == [TOPICS.interactions] * 10 + [TOPICS.rewards]
    assert producer.delivered[0][1] == b"id-0000"  # keyed by interaction id
    assert logger.spool_records == 0 and not (tmp_path / "spool" / "spool.log").exists()


def test_an_outage_spools_and_the_replay_delivers_everything_once_in_order(make_logger):
    producer = FakeProducer()
    logger = make_logger(producer)
    logger.submit(interaction(0))
    assert logger.flush(5.0)
    producer.go_down()
    for i in range(1, 6):
        logger.submit(interaction(i))
    assert wait_until(lambda: logger.spooling and logger.spool_records == 5)
    for i in range(6, 20):  # submitted during the outage: straight to the spool
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


def test_records_the_producer_gave_up_on_are_sent_again(make_logger):
    producer = FakeProducer()
    logger = make_logger(producer)
    producer.go_down()
    for i in range(3):
        logger.submit(interaction(i))
    assert wait_until(lambda: logger.spooling)
    assert producer.expire() == 3  # delivery timed out: not written
    assert wait_until(lambda: len(producer.held) == 3)  # re-sent after retry_s
    for i in range(3, 8):
        logger.submit(interaction(i))
    producer.come_back()
    assert logger.flush(10.0)
    assert delivered_ids(producer) == [f"id-{i:04d}" for i in range(8)]


def test_sends_refused_outright_are_spooled_and_replayed(make_logger):
    producer = FakeProducer(refuse_sends=True)
    logger = make_logger(producer)
    for i in range(6):
        logger.submit(interaction(i))
    assert wait_until(lambda: logger.spool_records == 6)
    producer.refuse_sends = False
    assert logger.flush(10.0)
    assert delivered_ids(producer) == [f"id-{i:04d}" for i in range(6)]


def test_close_during_an_outage_leaves_the_spool_for_the_next_start(make_logger, tmp_path):
    down = FakeProducer()
    first = InteractionLogger(down, TOPICS, tmp_path / "spool", stall_s=0.2, retry_s=0.05)
    first.start()
    down.go_down()
    for i in range(7):
        first.submit(interaction(i))
    report = first.close(timeout_s=0.5)
    assert (report.spooled, report.held_in_memory) == (7, 0)
    up = FakeProducer()
    second = make_logger(up)
    second.submit(interaction(7))
    assert second.flush(10.0)
    assert delivered_ids(up) == [f"id-{i:04d}" for i in range(8)]  # spool first, then the new record


def test_close_with_the_broker_up_delivers_everything(tmp_path):
    producer = FakeProducer()
    logger = InteractionLogger(producer, TOPICS, tmp_path / "spool")
    logger.start()
    for i in range(50):
        logger.submit(interaction(i))
    report = logger.close(timeout_s=5.0)
    assert (report.acknowledged, report.spooled, report.held_in_memory) == (50, 0, 0)
    assert len(producer.delivered) == 50


def test_a_full_spool_during_an_outage_refuses_new_work_until_the_broker_returns(make_logger):
    producer = FakeProducer()
    record_bytes = 600  # one spooled interaction is about this large
    logger = make_logger(producer, spool_max_bytes=3 * record_bytes)
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


def test_a_full_queue_refuses_new_work(tmp_path):
    logger = InteractionLogger(FakeProducer(), TOPICS, tmp_path / "spool", max_queue=3)  # not started
    for i in range(3):
        logger.submit(interaction(i))
    assert "backlog is full" in logger.refusal()


def test_an_unexpected_producer_error_is_reported_not_hidden(make_logger):
    class Broken(FakeProducer):
        def send(self, *args, **kwargs):
            raise RuntimeError("producer is closed")

    logger = make_logger(Broken())
    logger.submit(interaction(0))
    assert wait_until(lambda: logger.refusal() is not None)
    assert "producer is closed" in logger.refusal()
