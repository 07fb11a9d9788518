"""Closing a producer whose records the broker never takes: they are dropped, said in the log, and
the close returns without a Kafka error.

kafka-python's ``close(timeout)`` flushes first, and a flush that times out raises before the network
thread is told to stop: the producer stayed open with its thread running, and KafkaTimeoutError escaped
every service's close during an outage (the learner's shutdown turned it into a failure).
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import kafka.errors as kerr
import pytest

from streams.broker import LocalBroker
from streams.kafka_backend import KafkaBackend
from streams.kafka_producer import FORCE_CLOSE_JOIN_S, KafkaStreamProducer
from tests.fixtures.kafka import local_broker_config

CLIENT_TIMEOUT_S = 3.0


class _Sender:
    def __init__(self) -> None:
        self.forced = False
        self.joined_for: float | None = None

    def force_close(self) -> None:
        self.forced = True

    def join(self, timeout: float) -> None:
        self.joined_for = timeout


class _StuckProducer:
    """kafka-python 3.0.12's KafkaProducer.close with a record no broker takes: the flush it starts
    with raises (whatever the timeout) until the network thread was forced to drop what it holds."""

    def __init__(self) -> None:
        self._sender = _Sender()
        self.closes: list[float] = []

    def close(self, timeout: float | None = None) -> None:
        self.closes.append(timeout)
        if not self._sender.forced:
            raise kerr.KafkaTimeoutError("Timeout waiting for future")


def test_a_close_whose_flush_times_out_forces_the_network_thread_down_and_raises_nothing(caplog):
    stuck = _StuckProducer()
    producer = KafkaStreamProducer(stuck, "nowhere:9092", close_timeout_s=CLIENT_TIMEOUT_S)
    with caplog.at_level("WARNING", logger="streams.kafka_backend"):
        producer.close()
    assert stuck._sender.forced and stuck._sender.joined_for == FORCE_CLOSE_JOIN_S
    assert stuck.closes == [CLIENT_TIMEOUT_S, 0]  # bounded first, then once more to finish
    assert "not acknowledged within 3 s are dropped" in caplog.text


@pytest.mark.kafka
@contextmanager
def a_producer_whose_broker_stopped(tmp_path, kafka_lib_dir):
    """(the weights topic's name, a producer that had one record taken before its broker stopped)."""
    cfg = local_broker_config(tmp_path / "broker")
    broker = LocalBroker(cfg, lib_dir=kafka_lib_dir, stop_with_parent=True)
    broker.start()
    try:
        kcfg = cfg.kafka.model_copy(update={"client_timeout_s": CLIENT_TIMEOUT_S})
        backend = KafkaBackend(kcfg)
        backend.ensure_topics()
        producer = backend.producer()
        producer.send(kcfg.topics.weights, b"taken", key=b"k")
        producer.flush(10)
        broker.stop()
        yield kcfg.topics.weights, producer
    finally:
        broker.stop()


def test_closing_with_records_a_stopped_broker_never_took_drops_them_and_stops_the_producer(
        tmp_path, kafka_lib_dir, caplog):
    with a_producer_whose_broker_stopped(tmp_path, kafka_lib_dir) as (topic, producer):
        network_thread = producer._producer._sender
        reports: list[BaseException | None] = []
        for _ in range(2):
            producer.send(topic, b"never taken", key=b"k", on_delivery=reports.append)
        started = time.monotonic()
        with caplog.at_level("WARNING", logger="streams.kafka_backend"):
            producer.close()
        took = time.monotonic() - started
        assert "2 record(s) not acknowledged within 3 s are dropped" in caplog.text
        assert len(reports) == 2 and all(isinstance(r, Exception) for r in reports)  # each told it failed
        assert not network_thread.is_alive() and network_thread not in threading.enumerate()
        assert took < 2 * CLIENT_TIMEOUT_S + FORCE_CLOSE_JOIN_S  # kafka-python's close waits twice at most


def test_abandoning_forces_the_network_thread_down_at_once(caplog):
    """Serving, its records kept in the spool, stops without the bounded wait of close()."""
    stuck = _StuckProducer()
    producer = KafkaStreamProducer(stuck, "nowhere:9092", close_timeout_s=CLIENT_TIMEOUT_S)
    producer._unsettled = 2  # two sends the broker never acknowledged
    with caplog.at_level("INFO", logger="streams.kafka_producer"):
        producer.abandon()
    assert stuck._sender.forced and stuck.closes == [0]  # no flush of CLIENT_TIMEOUT_S first
    assert "without waiting: 2 record(s) not acknowledged are dropped here" in caplog.text


@pytest.mark.kafka
def test_an_abandoned_producer_is_closed_so_its_exit_hook_has_nothing_to_say(tmp_path, kafka_lib_dir):
    """Serving left its producer unclosed when records were spooled; kafka-python's atexit hook then
    closed it and printed "Exception ignored in atexit callback" with the flush's KafkaTimeoutError."""
    with a_producer_whose_broker_stopped(tmp_path, kafka_lib_dir) as (topic, producer):
        producer.send(topic, b"never taken", key=b"k")

        producer.abandon()

        assert producer._producer._closed  # the exit hook's close returns at once
        producer._producer.close(timeout=1)  # what the hook calls: nothing raised
