"""Riding out an outage of a service the learner needs: retry an action until the service answers.

The broker (streams/broker_wait.py) and the MLflow server (trainer/tracking.py) each name the
exception that means "not reachable now"; everything else propagates at once.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


def until_reachable(action: Callable[[], T], what: str, unreachable: tuple[type[BaseException], ...],
                    retry_s: float, stop: threading.Event | None = None,
                    notify: Callable[[str], None] | None = None) -> T:
    """``action()``, repeated every ``retry_s`` while it raises one of ``unreachable``;
    re-raises once ``stop`` is set.

    The first failure is reported through ``notify`` (a warning in the log by default), later
    ones only at debug level, so an outage of minutes is one line, not hundreds."""
    attempts = 0
    while True:
        try:
            result = action()
        except unreachable as exc:
            if stop is not None and stop.is_set():
                raise
            attempts += 1
            line = f"{what}: not available ({exc}); waiting for it"
            if attempts == 1:
                (notify or log.warning)(line)
            else:
                log.debug(line)
            (stop or threading.Event()).wait(retry_s)
            continue
        if attempts:
            log.info("%s: done after %d failed attempts", what, attempts)
        return result
