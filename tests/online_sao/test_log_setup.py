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
