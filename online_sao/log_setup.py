"""How the long-running commands (serve, learn, judge, the drivers) log: one line format, the
libraries whose INFO lines are turned down, and the library lines held back when they repeat."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Callable

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
"""The long-running commands' log lines: when, how bad, which part."""

QUIET_LOGGERS = ("kafka", "httpx", "httpcore")
"""Libraries logged from WARNING up only: kafka-python narrates every connection at INFO, and httpx
logs every request's full URL at INFO (``HTTP Request: GET http://user:password@host/health``: the
MLflow server's password in clear), httpcore its connections at DEBUG."""


REPEATING_LINES: dict[str, tuple[str, ...] | None] = {
    "kafka.cluster": None, "kafka.coordinator": None, "kafka.net.manager": None, "kafka.net.connection": None,
    "kafka.net.transport": None, "kafka.producer.sender": None, "kafka.consumer.fetcher": None}
"""Library loggers (name -> the line templates held back when they repeat; None: every line) that
log on every retry for as long as their cause lasts. kafka-python's: a replica started before
``online-sao kafka up`` made its topics wrote "Topic ... not found in cluster metadata" at ERROR ten
times a second (36,000 lines an hour); a learner on a three-broker cluster with one broker down
wrote about 200 ERROR lines a minute ("Connection failed", "Marking the coordinator dead", "No node
available"). The project's own warnings say what happened and what to do (records wait in the
spool; the broker unreachable)."""

REPEAT_EVERY_S = 60.0
"""A line held back when it repeats passes once, then at most once per this many seconds."""
TRACKED_LINES = 1024
"""Distinct lines a :class:`ThrottleRepeats` remembers (the least recently passed go first): lines
that name a connection's port differ every time, and a long outage would grow the memory for ever."""


class ThrottleRepeats(logging.Filter):
    """Lets a line (one whose template is in ``templates``; None: any) through the first time its
    text appears, then once per ``every_s``, saying how many like it were held back; other lines
    pass as they are."""

    def __init__(self, templates: tuple[str, ...] | None = None, every_s: float = REPEAT_EVERY_S,
                 clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.templates, self.every_s, self.clock = templates, every_s, clock
        self._last: OrderedDict[str, tuple[float, int]] = OrderedDict()  # text -> (last passed, held since)

    def filter(self, record: logging.LogRecord) -> bool:
        if self.templates is not None and record.msg not in self.templates:
            return True
        message, now = record.getMessage(), self.clock()
        passed_at, held = self._last.get(message, (None, 0))
        if passed_at is not None and now - passed_at < self.every_s:
            self._last[message] = (passed_at, held + 1)
            return False
        self._last[message] = (now, 0)
        self._last.move_to_end(message)
        while len(self._last) > TRACKED_LINES:
            self._last.popitem(last=False)
        if held:
            record.msg, record.args = f"{message} ({held} more like it in the last {now - passed_at:.0f} s)", None
        return True


def quiet_chatty_libraries() -> None:
    """Log :data:`QUIET_LOGGERS` from WARNING up, whatever the root logger's level, and hold back the
    :data:`REPEATING_LINES` (one filter per logger, however often this runs)."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    for name, templates in REPEATING_LINES.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, ThrottleRepeats) for f in logger.filters):
            logger.addFilter(ThrottleRepeats(templates))


def log_to_stderr(level: int) -> None:
    """Log to stderr from ``level`` up in :data:`LOG_FORMAT` (with nothing set up, serve's INFO lines
    never showed and its warnings came out bare), :data:`QUIET_LOGGERS` from WARNING up. Setting the
    format is a no-op where logging is set up already (pytest)."""
    logging.basicConfig(level=level, format=LOG_FORMAT)
    quiet_chatty_libraries()
