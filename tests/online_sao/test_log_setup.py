"""The long-running commands' logging: the libraries that log secrets or chatter at INFO are turned down."""

from __future__ import annotations

import logging

from online_sao import log_setup


def test_libraries_that_log_request_urls_are_turned_down_to_warning(monkeypatch):
    """httpx logged ``HTTP Request: GET http://user:password@host/health`` at INFO: the MLflow
    server's password in clear on every learner start."""
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])  # as in a fresh process (pytest's capture handlers put aside)
    monkeypatch.setattr(root, "level", logging.WARNING)
    for name in ("kafka", "httpx", "httpcore"):
        monkeypatch.setattr(logging.getLogger(name), "level", logging.NOTSET)
    log_setup.log_to_stderr(logging.INFO)
    assert root.level == logging.INFO
    assert [logging.getLogger(name).getEffectiveLevel() for name in ("kafka", "httpx", "httpcore")] == [
        logging.WARNING] * 3


def _cluster_line(topic: str) -> logging.LogRecord:
    return logging.LogRecord("kafka.cluster", logging.ERROR, "cluster.py", 591,
                             "Topic %s not found in cluster metadata", (topic,), None)


def test_a_line_kafka_repeats_every_metadata_refresh_passes_once_a_minute_with_a_count():
    """kafka-python logged "Topic sao.interactions not found in cluster metadata" at ERROR about ten
    times a second while a replica waited for topics the cluster lacked."""
    now = [0.0]
    throttle = log_setup.ThrottleRepeats(("Topic %s not found in cluster metadata",), every_s=60.0,
                                         clock=lambda: now[0])
    passed = []
    for t in (0.0, 0.1, 0.2, 30.0, 60.5, 61.0):
        now[0] = t
        for topic in ("sao.interactions", "sao.rewards"):
            record = _cluster_line(topic)
            if throttle.filter(record):
                passed.append((t, record.getMessage()))
    assert passed == [
        (0.0, "Topic sao.interactions not found in cluster metadata"),
        (0.0, "Topic sao.rewards not found in cluster metadata"),
        (60.5, "Topic sao.interactions not found in cluster metadata (3 more like it in the last 60 s)"),
        (60.5, "Topic sao.rewards not found in cluster metadata (3 more like it in the last 60 s)")]
    other = logging.LogRecord("kafka.cluster", logging.ERROR, "cluster.py", 1, "Something else %s", ("x",), None)
    assert all(throttle.filter(other) for _ in range(3))


def test_the_throttle_is_installed_once_on_each_of_kafkas_repeating_loggers(monkeypatch):
    for name in ("kafka.cluster", "kafka.coordinator", "kafka.net.manager"):
        monkeypatch.setattr(logging.getLogger(name), "filters", [])
    log_setup.quiet_chatty_libraries()
    log_setup.quiet_chatty_libraries()
    for name in ("kafka.cluster", "kafka.coordinator", "kafka.net.manager"):
        assert [type(f) for f in logging.getLogger(name).filters] == [log_setup.ThrottleRepeats]


def test_every_line_of_a_repeating_logger_is_held_back_and_the_memory_of_lines_is_bounded(monkeypatch):
    """A learner beside a lost broker: "Connection failed: KafkaConnectionError: 111 ECONNREFUSED" and
    its like, about 200 ERROR lines a minute; lines naming a connection's port differ every time."""
    now = [0.0]
    throttle = log_setup.ThrottleRepeats(None, every_s=60.0, clock=lambda: now[0])

    def line(text: str) -> logging.LogRecord:
        return logging.LogRecord("kafka.net.manager", logging.ERROR, "manager.py", 1, text, None, None)

    passed = [throttle.filter(line("Connection failed: KafkaConnectionError: 111 ECONNREFUSED")) for _ in range(5)]
    assert passed == [True, False, False, False, False]
    monkeypatch.setattr(log_setup, "TRACKED_LINES", 3)
    assert all(throttle.filter(line(f"socket disconnected [127.0.0.1:{port}]")) for port in range(10))
    assert len(throttle._last) == 3
