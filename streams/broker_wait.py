"""Riding out a broker outage: retry an action until the broker takes it.

Used by the learner and the judge. The learner's writes to Kafka (weights notices, the dead letters flushed before an
offset commit, the commit itself) are all safe to repeat: notices are idempotent
for serving (it ignores versions it already runs), and offsets are also in the
checkpoint, which is what a restart resumes from. So while the broker is
unreachable the learner waits for it instead of exiting, and resumes.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, TypeVar

from streams.base import StreamUnavailable

log = logging.getLogger(__name__)

BROKER_RETRY_S = 1.0
"""Pause between two attempts while the broker is unreachable."""

T = TypeVar("T")


def until_broker_takes(action: Callable[[], T], what: str, stop: threading.Event | None = None,
                       notify: Callable[[str], None] | None = None) -> T:
    """``action()``, repeated while it raises :class:`StreamUnavailable`; re-raises once ``stop`` is set.

    The first failure is reported through ``notify`` (a warning in the log by default), later
    ones only at debug level, so an outage of minutes is one line, not hundreds."""
    attempts = 0
    while True:
        try:
            result = action()
        except StreamUnavailable as exc:
            if stop is not None and stop.is_set():
                raise
            attempts += 1
            line = f"{what}: broker unreachable ({exc}); waiting for it"
            if attempts == 1:
                (notify or log.warning)(line)
            else:
                log.debug(line)
            if stop is not None:
                stop.wait(BROKER_RETRY_S)
            else:
                threading.Event().wait(BROKER_RETRY_S)
            continue
        if attempts:
            log.info("%s: done after the broker came back (%d attempts failed)", what, attempts)
        return result
