"""The learner waits out a broker outage: Kafka writes are retried until the broker takes them."""

from __future__ import annotations

import threading

import pytest

from streams.base import StreamUnavailable
from streams.broker_wait import until_broker_takes


class Flaky:
    def __init__(self, failures: int):
        self.failures = failures
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise StreamUnavailable("broker down")
        return "done"


def test_the_action_is_retried_until_the_broker_takes_it(monkeypatch):
    monkeypatch.setattr("streams.broker_wait.BROKER_RETRY_S", 0.01)
    action = Flaky(failures=3)
    assert until_broker_takes(action, "committing offsets", threading.Event()) == "done"
    assert action.calls == 4


def test_a_stop_request_ends_the_wait_with_the_error(monkeypatch):
    monkeypatch.setattr("streams.broker_wait.BROKER_RETRY_S", 0.01)
    stop = threading.Event()
    stop.set()
    with pytest.raises(StreamUnavailable):
        until_broker_takes(Flaky(failures=10), "announcing v3", stop)


def test_other_errors_are_not_retried():
    def broken():
        raise ValueError("not a broker problem")

    with pytest.raises(ValueError):
        until_broker_takes(broken, "committing offsets", threading.Event())
