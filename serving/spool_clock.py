"""The wall clock stepping back, for the read back after a crash (:mod:`serving.spool_readback`).

The read back starts at the oldest pending record's creation time. The producer stamps the copy
the broker keeps with the wall clock of its send, which is later than the record's creation
unless the clock stepped back in between: NTP correcting a clock that ran fast, an operator
setting it. Then a copy can be stamped before the point where the read back starts; the next
start does not find it and sends the record a second time.

:class:`ClockSteps` notices a step when a record is about to be handed to the producer: the clock
reads earlier than a time already seen (a record's creation, an earlier send). Before that record
is handed, it writes down (fsynced) the clock's reading and the newest sequence number submitted
so far (at least the last one an earlier process spooled). While a record up to that number is
pending, the read back starts no later than that reading: every copy sent since is stamped at or
after it. Records up to that number count towards a further step only with the step's reading, so
one step is written once, not once per old record sent after a restart.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from online_sao.durable import replace_with_text

log = logging.getLogger(__name__)

CLOCK_STEP_FILE = "spool.clock-step"

STEP_BACK_TOLERANCE_S = 1.0
"""A reading this much earlier than the latest time seen is a step back. Smaller differences are
inside the read back's own margin (READBACK_MARGIN_S), and NTP slewing never moves the clock back;
writing down every jitter would cost an fsync on the sending path."""


@dataclass(frozen=True)
class ClockStep:
    floor_s: float
    """The clock's reading when the step was noticed: every copy sent since is stamped no earlier."""
    through_seq: int
    """Records up to this sequence number may have been created before the step."""


class ClockSteps:
    """What the spool's sender knows about steps back of the wall clock; the caller holds the log's lock."""

    def __init__(self, directory: Path, restart_seq: int, wall: Callable[[], float] = time.time):
        """``restart_seq``: the last sequence number an earlier process spooled."""
        self._path = Path(directory) / CLOCK_STEP_FILE
        self._wall = wall
        self._restart_seq = restart_seq
        self.step = self._read(restart_seq)
        """The step whose records may still be pending (from this process or an earlier one)."""
        self._latest = float("-inf")
        """The latest time seen: a record's creation or a send."""
        self._latest_seq = 0
        self.noticed = 0
        """Steps noticed by this process."""

    def created(self, seq: int, created_at: float) -> None:
        """A record was submitted, or an earlier process's record is about to be sent."""
        if self.step is not None and seq <= self.step.through_seq:
            # the step covers it: its copies are found as long as they are stamped at or after the step's
            # reading, so only a send before that reading is a further step (not every such record again)
            created_at = min(created_at, self.step.floor_s)
        self._latest = max(self._latest, created_at)
        self._latest_seq = max(self._latest_seq, seq)

    def before_send(self) -> None:
        """Call before a record is handed to the producer."""
        now = self._wall()
        if now < self._latest - STEP_BACK_TOLERANCE_S:
            self.noticed += 1
            log.warning("the wall clock stepped back %.1f s; a read back after a crash starts at the new "
                        "reading while records submitted until now are pending", self._latest - now)
            previous = self.step
            # an earlier process's records not yet sent were created before the step too (their creation
            # times are shown here one by one, as they are sent): the step covers them all at once
            through_seq = max(self._latest_seq, self._restart_seq, previous.through_seq if previous else 0)
            self.step = ClockStep(floor_s=now if previous is None else min(now, previous.floor_s),
                                  through_seq=through_seq)
            self._write(self.step)
            self._latest = now  # later sends are stamped after this reading: one write per step
        self._latest = max(self._latest, now)

    def read_back_floor(self, first_pending_seq: int) -> float | None:
        """Where a read back must start at the latest, given the oldest pending record (None: no step)."""
        if self.step is None or first_pending_seq > self.step.through_seq:
            return None
        return self.step.floor_s

    def acknowledged_through(self, seq: int) -> None:
        """The spool's watermark reached ``seq``: a step none of whose records is pending is forgotten."""
        if self.step is not None and seq >= self.step.through_seq:
            self.forget()

    def forget(self) -> None:
        """No record the step may hide is pending (a start that finds the spool empty)."""
        self.step = None
        try:
            self._path.unlink(missing_ok=True)
        except OSError as exc:  # kept: a later read back only starts earlier than it must
            log.warning("cannot remove %s: %s", self._path, exc)

    def _read(self, restart_seq: int) -> ClockStep | None:
        try:
            data = json.loads(self._path.read_text())
            return ClockStep(floor_s=float(data["floor_s"]), through_seq=int(data["through_seq"]))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            # damaged: read the earlier process's records back from the topics' start rather than miss a copy
            log.warning("unreadable %s (%s): the read back after this restart reads the topics whole", self._path, exc)
            return ClockStep(floor_s=0.0, through_seq=restart_seq)

    def _write(self, step: ClockStep) -> None:
        try:
            replace_with_text(self._path, json.dumps({"floor_s": step.floor_s, "through_seq": step.through_seq}))
        except OSError as exc:  # best effort, like the watermark: the cost is a possible second copy
            log.warning("cannot write %s (%s): after a crash, a record sent since the clock stepped back "
                        "may reach its topic twice", self._path, exc)
