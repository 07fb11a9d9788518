"""The learner's own logging set-up: INFO lines with time and level, the libraries that log request
URLs (the MLflow server's password in them) turned down."""

from __future__ import annotations

import logging
import signal

import trainer.learner
from online_sao.config import Config


def test_the_learner_turns_httpx_down_to_warning(tmp_path, monkeypatch):
    """httpx logged ``HTTP Request: GET http://user:password@host/health`` at INFO on every start."""
    for name in ("kafka", "httpx", "httpcore"):  # set back after the test, for other tests' log captures
        monkeypatch.setattr(logging.getLogger(name), "level", logging.NOTSET)
    monkeypatch.setattr(trainer.learner, "run_on_ranks", lambda work, timeout_s: None)  # no training
    monkeypatch.setattr(signal, "signal", lambda *args: None)  # the test runner keeps its own handlers
    assert trainer.learner.run_learner(Config(paths={"data_dir": str(tmp_path)})) == 0
    assert logging.getLogger("httpx").level == logging.WARNING
