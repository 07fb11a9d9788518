"""``serving.log_durability: memory``: records go straight to the producer; the disk only in an outage.

Records wait in an in-memory queue and go straight to the producer; the receipt
is durable at once (nothing waits on the disk). While records are acknowledged
within ``stall_s`` the spool is not touched. When the broker cannot be reached
(``send`` raises :class:`StreamUnavailable`, a delivery fails, or the oldest
record waits longer than ``stall_s``) every unacknowledged record and everything
after it goes to the spool, in order, and is replayed as in write-ahead mode;
new records keep going to the spool until it is empty, so replay always precedes
them. A crash loses what was still only in memory.
"""

from __future__ import annotations

import logging
import threading

from serving.log_state import LogState
from serving.receipt import Receipt
from serving.spool_sender import Pending
from streams.base import Producer, StreamUnavailable

log = logging.getLogger(__name__)


class MemoryMode:
    """Receipts are durable at once (a :class:`~serving.interaction_log.DurabilityMode`)."""

    def __init__(self, state: LogState, producer: Producer):
        self._state = state
        self._spool, self._signal = state.spool, state.signal
        self.sender = state.sender(producer, on_refused=self._refused, on_delivered=lambda pending, error: None)
        self._spooling = self._spool.pending_records > 0
        """Records go to the spool (the broker was unreachable, or the last run left records there)."""
        self._thread = state.thread(self._run, "interaction-logger")

    # ------------------------------------------------------------------ the logger's side

    @property
    def spooling(self) -> bool:
        """Records go to the spool."""
        return self._spooling

    def threads(self) -> list[threading.Thread]:
        return [self._thread]

    def stopped(self) -> bool:
        return not self._thread.is_alive()

    def queued(self, pending: Pending) -> Receipt:
        self._signal.events += 1
        self._signal.changed.notify_all()
        return Receipt(durable=True)

    def drained(self) -> bool:
        return not self._state.queue and not self._spooling and self.sender.all_acknowledged()

    def wake_all(self) -> None:
        pass  # the thread waits on the log's own condition, which closing notifies

    # ------------------------------------------------------------------ the thread

    def _refused(self, error: StreamUnavailable) -> None:
        (log.debug if self._spooling else log.warning)("broker unavailable, spooling: %s", error)

    def _run(self) -> None:
        state = self._state
        while True:
            with self._signal.lock:
                finished = state.closing and (self.drained() or state.clock() >= state.deadline)
            if finished:
                self._spool_leftovers()
                return
            if not self._step():
                with self._signal.changed:
                    busy = self._spooling or self.sender.in_flight or state.closing
                    self._signal.changed.wait(state.settings.retry_s if busy else None)

    def _step(self) -> bool:
        if self._spooling:
            moved = self._spool_queue()
            return self._replay() or moved
        self.sender.drop_acknowledged()
        if self.sender.in_trouble():
            self._start_spooling()
            return True
        queue = self._state.queue
        with self._signal.lock:
            batch = [queue.popleft() for _ in range(min(self.sender.window_room(), len(queue)))]
        for i, pending in enumerate(batch):
            if not self.sender.hand(pending):
                with self._signal.lock:
                    queue.extendleft(reversed(batch[i:]))
                self._start_spooling()
                return True
        return bool(batch)

    def _replay(self) -> bool:
        progressed = self.sender.replay()
        if self._spool.pending_records == 0:
            with self._signal.changed:
                self._spooling = False
                self._signal.changed.notify_all()
            log.info("spool replayed: logging directly to the broker again")
            progressed = True
        return progressed

    def _unacknowledged(self) -> list[Pending]:
        """Records not acknowledged and not yet in the spool, in submission order (caller holds the lock).

        Every record up to the spool's last sequence number is in the spool already."""
        on_disk = self._spool.last_seq
        return self.sender.unacknowledged_after(on_disk) + [p for p in self._state.queue if p.seq > on_disk]

    def _spool_leftovers(self) -> None:
        with self._signal.lock:
            records = self._unacknowledged()
            self._state.queue.clear()
        if records:
            self._spool.append([p.entry() for p in records])
            log.warning("shutdown: %d unacknowledged records left in the spool %s", len(records),
                        self._spool.directory)

    def _start_spooling(self) -> None:
        with self._signal.lock:
            records = self._unacknowledged()
            self._state.queue.clear()
            self._spooling = True
        self._spool.append([p.entry() for p in records])
        log.warning("broker unreachable, or a topic missing: %d records spooled to %s", len(records),
                    self._spool.directory)

    def _spool_queue(self) -> bool:
        with self._signal.lock:
            batch = list(self._state.queue)
            self._state.queue.clear()
        if batch:
            self._spool.append([p.entry() for p in batch])
        return bool(batch)
