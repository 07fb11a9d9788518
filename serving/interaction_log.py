"""Logging interactions and rewards to the broker, with the client's acknowledgement tied to durability.

Requests call :meth:`InteractionLogger.submit`, which encodes the record, gives
it the next sequence number and returns a :class:`Receipt`; the request answers
its client once the receipt says the record is durable. Two modes
(``serving.log_durability``):

``write_ahead`` (default)
    A writer thread appends every submitted record to the spool
    (:mod:`serving.spool`) and fsyncs it, all records waiting at that moment in
    one append (group commit: concurrent requests share an fsync); then their
    receipts are durable. A sender thread ships records from the spool in
    order (at most ``window`` with the producer, each re-sent after ``retry_s``
    if its delivery failed) and advances the spool's acknowledgement watermark
    over every prefix the broker acknowledged, in cycles at least
    ``ship_interval_s`` apart: nobody waits for the broker here, so records and
    delivery reports are gathered, and one cycle's spool read, watermark write
    and produce request serve many records (benchmarks/results/serving.md
    measures what this saves). A crash or SIGKILL therefore
    loses nothing a client was told about: the next start replays everything
    above the watermark, in order. A record the broker acknowledged just before
    a crash, before its watermark was written, is sent again (at-least-once
    across crashes); the learner drops the second copy by interaction id.
    When the spool cannot be written (disk full, ``spool_max_bytes``), records
    are held in memory in order and become durable when the broker
    acknowledges them; new work is refused only when the broker is unreachable
    too (see below).

``memory``
    Records wait in an in-memory queue and go straight to the producer; the
    receipt is durable at once (nothing waits on the disk). While records are
    acknowledged within ``stall_s`` the spool is not touched. When the broker
    cannot be reached (``send`` raises :class:`StreamUnavailable`, a delivery
    fails, or the oldest record waits longer than ``stall_s``) every
    unacknowledged record and everything after it goes to the spool, in
    order, and is replayed as above; new records keep going to the spool until
    it is empty, so replay always precedes them. A crash loses what was still
    only in memory.

Admission: the backlog is bounded by refusing new work (:meth:`refusal`), never
by dropping a record of work already admitted. When the spool cannot be
written while the broker is unreachable, :meth:`refusal` says the service can
no longer log and why; the app answers 503 with that reason until either
recovers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

from online_sao.config import TopicsConfig
from online_sao.schemas import Interaction, Reward, encode
from serving.receipt import Receipt
from serving.spool import Spool
from serving.spool_sender import SpoolSender, _Pending
from streams.base import Producer

log = logging.getLogger(__name__)

_JOIN_GRACE_S = 5.0
"""Extra wait for a logger thread to stop on close, beyond the flush timeout and a blocked send."""

Durability = Literal["write_ahead", "memory"]


@dataclass(frozen=True)
class CloseReport:
    acknowledged: int
    """Records the broker acknowledged during this logger's life."""
    spooled: int
    """Records left in the spool for the next start."""
    held_in_memory: int
    """Records that could be neither delivered nor spooled (lost at exit)."""


class InteractionLogger(SpoolSender):
    def __init__(self, producer: Producer, topics: TopicsConfig, spool_dir: Path, *,
                 durability: Durability = "write_ahead", max_queue: int = 10_000, window: int = 256,
                 stall_s: float = 5.0, retry_s: float = 1.0, spool_max_bytes: int = 1 << 30,
                 ship_interval_s: float = 0.0, clock: Callable[[], float] = time.monotonic):
        if durability not in ("write_ahead", "memory"):
            raise ValueError(f"unknown log durability {durability!r}")
        spool = Spool(spool_dir, spool_max_bytes, dead_letter_topic=topics.dead_letters)
        super().__init__(producer, spool, write_ahead=durability == "write_ahead",
                         window=window, stall_s=stall_s, retry_s=retry_s, clock=clock)
        self._topics = topics
        self.durability = durability
        self._max_queue = max_queue
        self._ship_interval_s = ship_interval_s
        self._queue: deque[_Pending] = deque()
        """memory: records for the producer; write_ahead: records for the writer."""
        self._seq = self._spool.last_seq
        self._spooling = not self._write_ahead and self._spool.pending_records > 0
        self._closing = False
        self._writer_done = not self._write_ahead
        self._writing = 0  # write_ahead: records taken from the queue whose spool append has not returned
        self._deadline = float("inf")
        self._crashed: str | None = None
        # Each thread waits on its own condition (all on the one state lock), so that a record
        # wakes only the thread that has work for it: every needless wake-up takes the
        # interpreter lock from the engine's thread (benchmarks/results/serving.md).
        self._writer_wake = threading.Condition(self._state_lock)
        """write_ahead: the writer waits here for submitted records (and close)."""
        self._ship_timer = threading.Condition(self._state_lock)
        """write_ahead: the sender waits here between two shipping cycles (only close wakes it early)."""
        self.fsyncs = 0
        """write_ahead: appends of the writer (each one fsync, for one or more records)."""
        if self._write_ahead:
            self._writer: threading.Thread | None = threading.Thread(target=self._guard, args=(self._run_writer,),
                                                                      name="interaction-log-writer", daemon=True)
            self._thread = threading.Thread(target=self._guard, args=(self._run_sender,),
                                            name="interaction-log-sender", daemon=True)
        else:
            self._writer = None
            self._thread = threading.Thread(target=self._guard, args=(self._run_memory,),
                                            name="interaction-logger", daemon=True)

    # ------------------------------------------------------------------ request side

    def start(self) -> None:
        if self._writer is not None:
            self._writer.start()
        self._thread.start()

    def submit(self, record: Interaction | Reward) -> Receipt:
        """Queue a record for the broker; never blocks on the network or the disk. The
        receipt says when the record is durable (at once in ``memory`` mode)."""
        topic = self._topics.interactions if isinstance(record, Interaction) else self._topics.rewards
        value = encode(record)
        receipt = Receipt(durable=not self._write_ahead)
        with self._cv:
            if self._closing and (self._writer_done if self._write_ahead else not self._thread.is_alive()):
                raise RuntimeError(f"the interaction logger is closed; {record.interaction_id} was not logged")
            self._seq += 1
            self._queue.append(_Pending(self._seq, topic, record.interaction_id.encode("utf-8"), value))
            if self._write_ahead:
                self._receipts[self._seq] = receipt
                self._writer_wake.notify()
            else:
                self._events += 1
                self._cv.notify_all()
        return receipt

    def refusal(self) -> str | None:
        """Why new work must be refused now (None while it can be logged)."""
        if self._crashed is not None:
            return f"the interaction logger stopped: {self._crashed}"
        if self._closing:
            return "the server is shutting down"
        backlog = len(self._queue) + self._spool.held_in_memory
        if backlog >= self._max_queue:
            return f"interaction log backlog is full ({backlog} records waiting for the disk or the broker)"
        if self._spooling and self._spool.error is not None:
            return f"cannot log interactions: the broker is unreachable and {self._spool.error}"
        return None

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def spool_bytes(self) -> int:
        return self._spool.pending_bytes

    @property
    def spool_records(self) -> int:
        return self._spool.pending_records

    @property
    def spooling(self) -> bool:
        """memory: records go to the spool; write_ahead: the broker is unreachable (records wait there)."""
        return self._spooling

    def flush(self, timeout_s: float) -> bool:
        """Wait until every submitted record is acknowledged; False if ``timeout_s`` passed first."""
        deadline = self._clock() + timeout_s
        with self._cv:
            while not self._drained():
                remaining = deadline - self._clock()
                if remaining <= 0 or self._crashed is not None:
                    return False
                self._cv.wait(min(remaining, self._retry_s))
            return True

    def close(self, timeout_s: float = 10.0) -> CloseReport:
        """Deliver what can be delivered within ``timeout_s``; spool the rest for the next start."""
        with self._cv:
            self._closing = True
            self._deadline = self._clock() + timeout_s
            self._events += 1
            self._cv.notify_all()
            self._writer_wake.notify_all()
            self._ship_timer.notify_all()
        for thread in (self._writer, self._thread):
            if thread is not None and thread.is_alive():
                # the producer may block a send for its own timeout; give the thread that long too
                thread.join(timeout_s + self._stall_s + _JOIN_GRACE_S)
        if self._thread.is_alive() or (self._writer is not None and self._writer.is_alive()):
            log.error("interaction logger thread did not stop; %d records were not spooled",
                      len(self._queue) + len(self._with_producer))
            return CloseReport(self.acknowledged, self._spool.pending_records,
                               len(self._queue) + len(self._with_producer))
        self._spool.close()
        held = self._spool.held_in_memory
        return CloseReport(self.acknowledged, self._spool.pending_records - held, held)

    # ------------------------------------------------------------------ threads

    def _guard(self, body: Callable[[], None]) -> None:
        try:
            body()
        except Exception as exc:  # the thread must not die silently: readiness reports it
            log.exception("interaction logger stopped")
            self._crashed = f"{type(exc).__name__}: {exc}"
            self._notify()

    def _run_writer(self) -> None:
        """write_ahead: append what was submitted (one fsync per batch), then mark it durable."""
        while True:
            with self._cv:
                while not self._queue and not self._closing and not self._spool.held_in_memory:
                    self._writer_wake.wait()
                if not self._queue and self._spool.held_in_memory and not self._closing:
                    self._writer_wake.wait(self._retry_s)  # the disk refused: retry the held records now and then
                batch = list(self._queue)
                self._queue.clear()
                self._writing = len(batch)  # still undelivered, though neither queued nor in the spool yet
                if not batch and self._closing:
                    self._writer_done = True  # submit() refuses from now on: nobody would write it
                    return
            if self._spool.append([p.entry() for p in batch]):
                self.fsyncs += 1
                self._resolve_through(self._spool.last_seq)
            elif batch:
                log.warning("cannot write the spool (%s): %d records held in memory until the broker "
                            "acknowledges them", self._spool.error, len(batch))
            with self._cv:
                self._writing = 0
            self._notify()

    def _resolve_through(self, seq: int) -> None:
        with self._cv:
            done = [s for s in self._receipts if s <= seq]
            receipts = [self._receipts.pop(s) for s in done]
        for receipt in receipts:
            receipt.resolve()

    def _run_sender(self) -> None:
        """write_ahead: ship the spool to the broker in order and acknowledge what it took."""
        last_cycle = float("-inf")
        while True:
            with self._cv:
                while not self._closing and (wait := last_cycle + self._ship_interval_s - self._clock()) > 0:
                    self._ship_timer.wait(wait)  # gather records and delivery reports for one cycle
                seen = self._events
                finished = self._closing and self._writer_done and (
                    self._drained() or self._clock() >= self._deadline)
            if finished:
                return
            last_cycle = self._clock()
            progressed = self._replay()
            if self._stalled() and not self._spooling:
                self._set_reachable(False, "records unacknowledged for longer than serving.log_stall_s")
            if not progressed:
                with self._cv:
                    if self._events == seen:
                        busy = self._spool.pending_records or self._closing
                        self._cv.wait(self._retry_s if busy else None)

    def _run_memory(self) -> None:
        while True:
            with self._cv:
                finished = self._closing and (self._drained() or self._clock() >= self._deadline)
            if finished:
                self._spool_leftovers()
                return
            if not self._step():
                with self._cv:
                    busy = self._spooling or self._with_producer or self._closing
                    self._cv.wait(self._retry_s if busy else None)

    def _drained(self) -> bool:
        """Everything submitted is acknowledged (caller holds the lock)."""
        if self._write_ahead:
            return not self._queue and not self._writing and self._spool.pending_records == 0
        return (not self._queue and not self._spooling
                and all(p.state == "acked" for p in self._with_producer.values()))

    def _spool_leftovers(self) -> None:
        with self._cv:
            records = self._unacknowledged()
            self._queue.clear()
        if records:
            self._spool.append([p.entry() for p in records])
            log.warning("shutdown: %d unacknowledged records left in the spool %s", len(records),
                        self._spool.directory)

    def _step(self) -> bool:
        if self._spooling:
            moved = self._spool_queue()
            return self._replay() or moved
        self._drop_acknowledged()
        if self._direct_in_trouble():
            self._start_spooling()
            return True
        with self._cv:
            room = self._window - len(self._with_producer)
            batch = [self._queue.popleft() for _ in range(min(room, len(self._queue)))]
        for i, pending in enumerate(batch):
            if not self._hand(pending):
                with self._cv:
                    self._queue.extendleft(reversed(batch[i:]))
                self._start_spooling()
                return True
        return bool(batch)

    def _unacknowledged(self) -> list[_Pending]:
        """Records not acknowledged and not yet in the spool, in submission order (caller holds the lock).

        Every record up to the spool's last sequence number is in the spool already."""
        on_disk = self._spool.last_seq
        waiting = [p for p in self._with_producer.values() if p.state != "acked" and p.seq > on_disk]
        return sorted(waiting, key=lambda p: p.seq) + [p for p in self._queue if p.seq > on_disk]

    def _start_spooling(self) -> None:
        with self._cv:
            records = self._unacknowledged()
            self._queue.clear()
            self._spooling = True
        self._spool.append([p.entry() for p in records])
        log.warning("broker unreachable: %d records spooled to %s", len(records), self._spool.directory)

    def _spool_queue(self) -> bool:
        with self._cv:
            batch = list(self._queue)
            self._queue.clear()
        if batch:
            self._spool.append([p.entry() for p in batch])
        return bool(batch)
