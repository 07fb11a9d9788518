"""``serving.log_durability: write_ahead``: a record is durable once it is fsynced in the spool.

A writer thread appends every submitted record to the spool (:mod:`serving.spool`)
and fsyncs it, all records waiting at that moment in one append (group commit:
concurrent requests share an fsync); then their receipts are durable. A sender
thread ships records from the spool in order (at most ``window`` with the
producer, each re-sent after ``retry_s`` if its delivery failed) and advances the
spool's acknowledgement watermark over every prefix the broker acknowledged, in
cycles at least ``ship_interval_s`` apart: nobody waits for the broker here, so
records and delivery reports are gathered, and one cycle's spool read, watermark
write and produce request serve many records (benchmarks/results/serving.md
measures what this saves). A crash or SIGKILL therefore loses nothing a client
was told about: the next start replays everything above the watermark, in
order. A record the broker acknowledged just before a crash, before its
watermark was written, is found on its topic by the next start's read back
(:mod:`serving.spool_readback`) and not sent again. When the spool cannot be written (disk
full, ``spool_max_bytes``), records are held in memory in order and become
durable when the broker acknowledges them; new work is refused only when the
broker is unreachable too.
"""

from __future__ import annotations

import logging
import threading

from serving.log_state import LogState
from serving.receipt import Receipt
from serving.spool_sender import Pending
from streams.base import Producer, StreamUnavailable

log = logging.getLogger(__name__)


class WriteAheadMode:
    """Receipts wait for the spool's fsync (a :class:`~serving.interaction_log.DurabilityMode`)."""

    def __init__(self, state: LogState, producer: Producer):
        self._state = state
        self._spool, self._signal = state.spool, state.signal
        self.sender = state.sender(producer, on_refused=self._refused, on_delivered=self._delivered)
        self._receipts: dict[int, Receipt] = {}
        """Receipts of records not yet durable, by sequence number (ascending)."""
        self._unreachable = False
        """The broker does not take records now (they wait in the spool); refusal() needs it when the disk is full."""
        self._writer_done = False
        self._writing = 0
        """Records taken from the queue whose spool append has not returned."""
        self._writer_wake = self._signal.own_condition()
        """The writer waits here for submitted records (and close)."""
        self._ship_timer = self._signal.own_condition()
        """The sender waits here between two shipping cycles (only close wakes it early)."""
        self.fsyncs = 0
        """Appends of the writer (each one fsync, for one or more records)."""
        self._threads = [state.thread(self._run_writer, "interaction-log-writer"),
                         state.thread(self._run_sender, "interaction-log-sender")]

    # ------------------------------------------------------------------ the logger's side

    @property
    def spooling(self) -> bool:
        """The broker is unreachable: records wait in the spool."""
        return self._unreachable

    def threads(self) -> list[threading.Thread]:
        return self._threads

    def stopped(self) -> bool:
        return self._writer_done

    def queued(self, pending: Pending) -> Receipt:
        receipt = self._receipts[pending.seq] = Receipt()
        self._writer_wake.notify()
        return receipt

    def drained(self) -> bool:
        return not self._state.queue and not self._writing and self._spool.pending_records == 0

    def wake_all(self) -> None:
        self._writer_wake.notify_all()
        self._ship_timer.notify_all()

    # ------------------------------------------------------------------ the broker's answers

    def _refused(self, error: StreamUnavailable) -> None:
        self._set_reachable(False, str(error))

    def _delivered(self, pending: Pending, error: BaseException | None) -> None:
        if error is None:
            with self._signal.lock:
                receipt = self._receipts.pop(pending.seq, None)
            if receipt is not None:
                receipt.resolve()  # the spool could not take it, the broker did: durable
        self._set_reachable(error is None, "" if error is None else str(error))

    def _set_reachable(self, reachable: bool, why: str) -> None:
        with self._signal.lock:
            if self._unreachable == (not reachable):
                return
            self._unreachable = not reachable
        if reachable:
            log.info("broker reachable again: %d records waiting in the spool", self._spool.pending_records)
        else:
            # kafka-python times out on a topic that does not exist as on a broker it cannot reach
            log.warning("broker unreachable, or a topic missing (%s; `online-sao kafka up` creates the topics): "
                        "records wait in the spool %s", why, self._spool.directory)

    # ------------------------------------------------------------------ threads

    def _run_writer(self) -> None:
        """Append what was submitted (one fsync per batch), then mark it durable."""
        state = self._state
        while True:
            with self._signal.lock:
                while not state.queue and not state.closing and not self._spool.held_in_memory:
                    self._writer_wake.wait()
                if not state.queue and self._spool.held_in_memory and not state.closing:
                    # the disk refused: retry the held records now and then
                    self._writer_wake.wait(state.settings.retry_s)
                batch = list(state.queue)
                state.queue.clear()
                self._writing = len(batch)  # still undelivered, though neither queued nor in the spool yet
                if not batch and state.closing:
                    self._writer_done = True  # submit() refuses from now on: nobody would write it
                    return
            if self._spool.append([p.entry() for p in batch]):
                self.fsyncs += 1
                self._resolve_through(self._spool.last_seq)
            elif batch:
                log.warning("cannot write the spool (%s): %d records held in memory until the broker "
                            "acknowledges them", self._spool.error, len(batch))
            with self._signal.lock:
                self._writing = 0
            self._signal.notify()

    def _resolve_through(self, seq: int) -> None:
        with self._signal.lock:
            done = [s for s in self._receipts if s <= seq]
            receipts = [self._receipts.pop(s) for s in done]
        for receipt in receipts:
            receipt.resolve()

    def _run_sender(self) -> None:
        """Ship the spool to the broker in order and acknowledge what it took."""
        state, signal = self._state, self._signal
        last_cycle = float("-inf")
        while True:
            with signal.lock:
                while not state.closing and (wait := last_cycle + state.settings.ship_interval_s - state.clock()) > 0:
                    self._ship_timer.wait(wait)  # gather records and delivery reports for one cycle
                seen = signal.events
                finished = state.closing and self._writer_done and (self.drained() or state.clock() >= state.deadline)
            if finished:
                return
            last_cycle = state.clock()
            progressed = self.sender.replay()
            if self.sender.stalled() and not self._unreachable:
                self._set_reachable(False, "records unacknowledged for longer than serving.log_stall_s")
            if not progressed:
                # read before taking the log's lock: the spool's lock is held through the writer's fsync,
                # and submit() on the event loop needs the log's lock (a record appended meanwhile
                # changes signal.events, so it is not slept over)
                busy = self._spool.pending_records or state.closing
                with signal.changed:
                    if signal.events == seen:
                        signal.changed.wait(state.settings.retry_s if busy else None)
