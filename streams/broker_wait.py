"""Riding out a broker outage: retry an action until the broker takes it.

Used by the learner and the judge. The learner's writes to Kafka (weights notices, the dead letters flushed before an
offset commit, the commit itself) are all safe to repeat: notices are idempotent
for serving (it ignores versions it already runs), and offsets are also in the
checkpoint, which is what a restart resumes from. So while the broker is
unreachable the learner waits for it instead of exiting, and resumes.
"""

from __future__ import annotations

import threading
from typing import Callable, TypeVar

from online_sao.reachable import until_reachable
from streams.base import StreamUnavailable

BROKER_RETRY_S = 1.0
"""Pause between two attempts while the broker is unreachable."""

T = TypeVar("T")


def until_broker_takes(action: Callable[[], T], what: str, stop: threading.Event | None = None,
                       notify: Callable[[str], None] | None = None) -> T:
    """``action()``, repeated while it raises :class:`StreamUnavailable`; re-raises once ``stop``
    is set (:func:`online_sao.reachable.until_reachable`)."""
    return until_reachable(action, what, (StreamUnavailable,), BROKER_RETRY_S, stop, notify)
