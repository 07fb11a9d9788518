"""Shipping spooled records to the broker: the sender half of :mod:`serving.interaction_log`.

:class:`SpoolSender` hands records to the producer (at most ``window`` at a
time, never a record still with the producer, a failed one again after
``retry_s``), learns from delivery reports which ones the broker acknowledged,
and advances the spool's watermark over every acknowledged prefix. Its state is
guarded by one condition variable shared with the logger; ``_events`` counts
changes a waiting thread may have to act on.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

from serving.receipt import Receipt
from serving.spool import Spool, SpoolEntry
from streams.base import Producer, StreamUnavailable

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    seq: int
    topic: str
    key: bytes | None
    value: bytes
    state: str = "new"
    """new -> handed -> acked | failed (-> handed again)."""
    changed_at: float = 0.0

    def entry(self) -> SpoolEntry:
        return SpoolEntry(self.seq, self.topic, self.key, self.value)


class SpoolSender:
    def __init__(self, producer: Producer, spool: Spool, *, write_ahead: bool, window: int, stall_s: float,
                 retry_s: float, clock: Callable[[], float] = time.monotonic):
        self._producer = producer
        self._spool = spool
        self._write_ahead = write_ahead
        self._window = window
        self._stall_s = stall_s
        self._retry_s = retry_s
        self._clock = clock
        self._state_lock = threading.RLock()
        self._cv = threading.Condition(self._state_lock)
        """Guards the state below; waited on for appends, delivery reports and drain (flush)."""
        self._events = 0
        """Counts changes a waiting thread may have to act on (appends, delivery reports)."""
        self._receipts: dict[int, Receipt] = {}
        """write_ahead: receipts of records not yet durable, by sequence number (ascending)."""
        self._with_producer: dict[int, _Pending] = {}
        self._spooling = False
        """memory: records go to the spool. write_ahead: the broker is unreachable."""
        self.acknowledged = 0
        self.delivery_failures = 0

    def _notify(self) -> None:
        with self._cv:
            self._events += 1
            self._cv.notify_all()

    def _stalled(self) -> bool:
        now = self._clock()
        with self._cv:
            return any(p.state == "handed" and now - p.changed_at > self._stall_s
                       for p in self._with_producer.values())

    def _set_reachable(self, reachable: bool, why: str) -> None:
        """write_ahead: note whether the broker takes records (refusal() needs it when the disk is full)."""
        with self._cv:
            if self._spooling == (not reachable):
                return
            self._spooling = not reachable
        if reachable:
            log.info("broker reachable again: %d records waiting in the spool", self._spool.pending_records)
        else:
            log.warning("broker unreachable (%s): records wait in the spool %s", why, self._spool.directory)

    def _hand(self, pending: _Pending) -> bool:
        """Give one record to the producer; False when it cannot take it now."""
        with self._cv:
            pending.state, pending.changed_at = "handed", self._clock()
            self._with_producer[pending.seq] = pending
        try:
            self._producer.send(pending.topic, pending.value, key=pending.key,
                                on_delivery=functools.partial(self._delivered, pending))
            return True
        except StreamUnavailable as exc:
            if self._write_ahead:
                self._set_reachable(False, str(exc))
            else:
                (log.debug if self._spooling else log.warning)("broker unavailable, spooling: %s", exc)
        with self._cv:  # never handed: the spool (or the queue) still holds it
            pending.state = "new"
            del self._with_producer[pending.seq]
        return False

    def _delivered(self, pending: _Pending, error: BaseException | None) -> None:
        """Delivery report from the producer's I/O thread."""
        receipt = None
        with self._cv:
            if error is None:
                pending.state = "acked"
                self.acknowledged += 1
                receipt = self._receipts.pop(pending.seq, None)
            else:
                pending.state = "failed"
                self.delivery_failures += 1
                log.warning("record %d to %s not delivered: %s", pending.seq, pending.topic, error)
            pending.changed_at = self._clock()
            self._events += 1
            self._cv.notify_all()
        if self._write_ahead:
            if receipt is not None:
                receipt.resolve()  # the spool could not take it, the broker did: durable
            self._set_reachable(error is None, "" if error is None else str(error))

    def _drop_acknowledged(self) -> None:
        with self._cv:
            for seq in [s for s, p in self._with_producer.items() if p.state == "acked"]:
                del self._with_producer[seq]

    def _direct_in_trouble(self) -> bool:
        now = self._clock()
        with self._cv:
            return any(p.state == "failed" or (p.state == "handed" and now - p.changed_at > self._stall_s)
                       for p in self._with_producer.values())

    def _replay(self) -> bool:
        """Hand the oldest spooled records to the producer and advance the acknowledged prefix."""
        progressed = False
        entries = self._spool.read_pending(self._window)
        acked_prefix: SpoolEntry | None = None
        prefix_open = True
        now = self._clock()
        for entry in entries:
            with self._cv:
                pending = self._with_producer.get(entry.seq)
            if pending is not None and pending.state == "acked":
                if prefix_open:
                    acked_prefix = entry
                continue
            prefix_open = False
            if pending is not None and (pending.state == "handed" or now - pending.changed_at < self._retry_s):
                continue
            if not self._hand(pending or _Pending(entry.seq, entry.topic, entry.key, entry.value)):
                break
            progressed = True
        if acked_prefix is not None:
            self._spool.ack_through(acked_prefix)
            with self._cv:
                for seq in [s for s in self._with_producer if s <= acked_prefix.seq]:
                    del self._with_producer[seq]
            progressed = True
        if self._spool.pending_records == 0 and not self._write_ahead:
            with self._cv:
                self._spooling = False
                self._cv.notify_all()
            log.info("spool replayed: logging directly to the broker again")
            progressed = True
        return progressed
