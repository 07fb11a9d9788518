"""Shipping spooled records to the broker, shared by both modes of :mod:`serving.interaction_log`.

:class:`SpoolSender` hands records to the producer (at most ``window`` at a
time, never a record still with the producer, a failed one again after
``retry_s``), learns from delivery reports which ones the broker acknowledged,
and advances the spool's watermark over every acknowledged prefix. What a mode
does about a refused send or a delivery report it says through two callbacks.

All of a log's state is guarded by one lock, its :class:`Signal`: the sender,
the log that owns it and every thread of that log take it; ``Signal.events``
counts changes a waiting thread may have to act on.

A restarted spool is read back first (:mod:`serving.spool_readback`): pending
records the broker took before the crash count as acknowledged and are not sent
again, so the topic holds every acknowledged record once. Until the read back
succeeds (the broker reachable) nothing is sent.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

from serving.spool import Spool
from serving.spool_clock import ClockSteps
from serving.spool_format import SpoolEntry
from serving.spool_readback import TopicTail, already_on_topic, created_at
from streams.base import Producer, StreamUnavailable

log = logging.getLogger(__name__)


@dataclass
class Pending:
    """One record on its way to the broker, by its log's sequence number."""

    seq: int
    topic: str
    key: bytes | None
    value: bytes
    state: str = "new"
    """new -> handed -> acked | failed (-> handed again)."""
    changed_at: float = 0.0

    def entry(self) -> SpoolEntry:
        return SpoolEntry(self.seq, self.topic, self.key, self.value)


class Signal:
    """A log's one state lock, the condition its threads and ``flush`` wait on, and a change count."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        """Notified on submits (memory mode), delivery reports, progress and close."""
        self.events = 0
        """Counts changes a waiting thread may have to act on (appends, delivery reports)."""

    def own_condition(self) -> threading.Condition:
        """A condition on the same lock for one thread alone: a record then wakes only the thread
        that has work for it (every needless wake-up takes the interpreter lock from the engine's
        thread: benchmarks/results/serving.md)."""
        return threading.Condition(self.lock)

    def notify(self) -> None:
        with self.changed:
            self.events += 1
            self.changed.notify_all()


OnRefused = Callable[[StreamUnavailable], None]
"""The producer refused a record outright; it stays where it was (the spool or the queue)."""
OnDelivered = Callable[[Pending, "BaseException | None"], None]
"""A delivery report from the producer's I/O thread, after the sender noted it (outside the lock)."""


class SpoolSender:
    def __init__(self, producer: Producer, spool: Spool, signal: Signal, *, window: int, stall_s: float,
                 retry_s: float, on_refused: OnRefused, on_delivered: OnDelivered,
                 clock_steps: ClockSteps, clock: Callable[[], float] = time.monotonic,
                 readback: TopicTail | None = None):
        """``readback``: how to read the topics back after a restart (None: no read back, and a record
        the broker took just before a crash is sent again); ``clock_steps``: where steps back of the
        wall clock are written down for it (serving.spool_clock)."""
        self._producer, self._spool, self._signal, self._clock = producer, spool, signal, clock
        self._window, self._stall_s, self._retry_s = window, stall_s, retry_s
        self._on_refused, self._on_delivered = on_refused, on_delivered
        self._with_producer: dict[int, Pending] = {}
        """Records handed to the producer and not yet dropped, by sequence number (guarded by the signal)."""
        self.acknowledged = 0
        self.delivery_failures = 0
        self._readback = readback
        self._readback_window = spool.readback_window(window)
        """The read back checks this many of the oldest pending records: an earlier process may have
        handed the producer more than ``window`` (a wider serving.log_window)."""
        self._restart_seq = spool.last_seq
        """Records up to this sequence number were spooled by an earlier process."""
        self._clock_steps = clock_steps
        if spool.pending_records == 0:  # nothing an earlier step could hide is left
            self._clock_steps.forget()
        self._seen_restart_seq = 0
        """Records of an earlier process up to this one had their creation time shown to the clock steps."""
        self._readback_due = readback is not None and spool.pending_records > 0
        self.found_on_topic = 0
        """Pending records of the restarted spool that the broker already held (not sent again)."""

    # ------------------------------------------------------------------ what is with the producer

    @property
    def in_flight(self) -> int:
        """Records with the producer, acknowledged ones not yet dropped included."""
        return len(self._with_producer)

    def window_room(self) -> int:
        """How many more records the producer may take now (caller holds the lock)."""
        return self._window - len(self._with_producer)

    def all_acknowledged(self) -> bool:
        """Every record handed to the producer is acknowledged (caller holds the lock)."""
        return all(p.state == "acked" for p in self._with_producer.values())

    def unacknowledged_after(self, seq: int) -> list[Pending]:
        """Records with the producer above ``seq`` and not acknowledged, oldest first (caller holds the lock)."""
        waiting = [p for p in self._with_producer.values() if p.state != "acked" and p.seq > seq]
        return sorted(waiting, key=lambda p: p.seq)

    def stalled(self) -> bool:
        """A record waits for its acknowledgement longer than ``stall_s``."""
        now = self._clock()
        with self._signal.lock:
            return any(p.state == "handed" and now - p.changed_at > self._stall_s
                       for p in self._with_producer.values())

    def in_trouble(self) -> bool:
        """A delivery failed, or a record waits longer than ``stall_s``: the broker is not keeping up."""
        now = self._clock()
        with self._signal.lock:
            return any(p.state == "failed" or (p.state == "handed" and now - p.changed_at > self._stall_s)
                       for p in self._with_producer.values())

    def drop_acknowledged(self) -> None:
        with self._signal.lock:
            for seq in [s for s, p in self._with_producer.items() if p.state == "acked"]:
                del self._with_producer[seq]

    # ------------------------------------------------------------------ sending

    def hand(self, pending: Pending) -> bool:
        """Give one record to the producer; False when it cannot take it now."""
        with self._signal.lock:
            if self._seen_restart_seq < pending.seq <= self._restart_seq:  # its creation time is in its bytes only
                self._seen_restart_seq = pending.seq
                self._clock_steps.created(pending.seq, created_at(pending.entry()))
            self._clock_steps.before_send()  # a step back is on disk before a copy stamped after it can exist
            pending.state, pending.changed_at = "handed", self._clock()
            self._with_producer[pending.seq] = pending
        try:
            self._producer.send(pending.topic, pending.value, key=pending.key,
                                on_delivery=functools.partial(self._delivered, pending))
            return True
        except StreamUnavailable as exc:
            self._on_refused(exc)
        with self._signal.lock:  # never handed: the spool (or the queue) still holds it
            pending.state = "new"
            del self._with_producer[pending.seq]
        return False

    def _delivered(self, pending: Pending, error: BaseException | None) -> None:
        """Delivery report from the producer's I/O thread."""
        with self._signal.changed:
            if error is None:
                pending.state = "acked"
                self.acknowledged += 1
            else:
                pending.state = "failed"
                self.delivery_failures += 1
                log.warning("record %d to %s not delivered: %s", pending.seq, pending.topic, error)
            pending.changed_at = self._clock()
            self._signal.events += 1
            self._signal.changed.notify_all()
        self._on_delivered(pending, error)

    def _read_pending(self, limit: int) -> list[SpoolEntry] | None:
        """The spool's oldest pending records; None while its log cannot be read (``Spool.error`` says
        why; the caller reports no progress, so its thread tries again after ``retry_s``)."""
        try:
            return self._spool.read_pending(limit)
        except OSError:  # out of file descriptors, an I/O error: often passing, never a reason to stop
            return None

    def _read_back(self) -> bool:
        """Restarted spool: mark the pending records the broker already holds as acknowledged.
        False while the broker or the spool cannot be read (nothing may be sent until they can)."""
        pending = self._read_pending(self._readback_window)
        if pending is None:
            return False
        candidates = [e for e in pending if e.seq <= self._restart_seq]
        floor = self._clock_steps.read_back_floor(candidates[0].seq) if candidates else None
        try:
            found = already_on_topic(candidates, self._readback, floor)
        except StreamUnavailable as exc:
            self._on_refused(exc)
            return False
        now = self._clock()
        with self._signal.lock:
            for entry in candidates:
                if entry.seq in found:
                    self._with_producer[entry.seq] = Pending(entry.seq, entry.topic, entry.key, entry.value,
                                                             state="acked", changed_at=now)
            self.found_on_topic = len(found)
            self._readback_due = False
        # a warning when it found some: it happens only after a crash, and says what the crash cost
        (log.warning if found else log.info)(
            "spool read back: %d of the %d records that may have been sent before the restart are on the "
            "topics already and are not sent again", len(found), len(candidates))
        return True

    def replay(self) -> bool:
        """Hand the oldest spooled records to the producer and advance the acknowledged prefix."""
        if self._readback_due and not self._read_back():
            return False
        progressed = False
        acked_prefix: SpoolEntry | None = None
        prefix_open = True
        now = self._clock()
        pending_entries = self._read_pending(self._window)
        if pending_entries is None:
            return False
        for entry in pending_entries:
            with self._signal.lock:
                pending = self._with_producer.get(entry.seq)
            if pending is not None and pending.state == "acked":
                if prefix_open:
                    acked_prefix = entry
                continue
            prefix_open = False
            if pending is not None and (pending.state == "handed" or now - pending.changed_at < self._retry_s):
                continue
            if not self.hand(pending or Pending(entry.seq, entry.topic, entry.key, entry.value)):
                break
            progressed = True
        if acked_prefix is not None:
            self._spool.ack_through(acked_prefix)
            with self._signal.lock:
                self._clock_steps.acknowledged_through(acked_prefix.seq)
                for seq in [s for s in self._with_producer if s <= acked_prefix.seq]:
                    del self._with_producer[seq]
            progressed = True
        return progressed
