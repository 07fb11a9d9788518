"""How the long-running commands (serve, learn, judge, the drivers) log: one line format, and the
libraries whose INFO lines are turned down."""

from __future__ import annotations

import logging

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
"""The long-running commands' log lines: when, how bad, which part."""

QUIET_LOGGERS = ("kafka", "httpx", "httpcore")
"""Libraries logged from WARNING up only: kafka-python narrates every connection at INFO, and httpx
logs every request's full URL at INFO (``HTTP Request: GET http://user:password@host/health``: the
MLflow server's password in clear), httpcore its connections at DEBUG."""


def quiet_chatty_libraries() -> None:
    """Log :data:`QUIET_LOGGERS` from WARNING up, whatever the root logger's level."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


def log_to_stderr(level: int) -> None:
    """Log to stderr from ``level`` up in :data:`LOG_FORMAT` (with nothing set up, serve's INFO lines
    never showed and its warnings came out bare), :data:`QUIET_LOGGERS` from WARNING up. Setting the
    format is a no-op where logging is set up already (pytest)."""
    logging.basicConfig(level=level, format=LOG_FORMAT)
    quiet_chatty_libraries()
