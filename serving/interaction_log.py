"""Logging interactions and rewards to the broker, off the request's critical path.

Requests call :meth:`InteractionLogger.submit`, which encodes the record and
appends it to an in-memory queue; one sender thread hands records to the
producer (idempotent, acks=all: the backend's job) and learns per record,
through the producer's delivery report, whether the broker acknowledged it.

While records are acknowledged within ``stall_s`` the spool is not touched.
When the broker cannot be reached (``send`` raises :class:`StreamUnavailable`,
a delivery fails, or the oldest record waits longer than ``stall_s``) every
unacknowledged record and everything submitted after it goes to the local
spool (:mod:`serving.spool`), in submission order. The spool is then replayed
in order: at most ``window`` records are with the producer at a time, a record
still with the producer is never handed to it again (so no id is sent twice in
one process), a failed one is re-sent after ``retry_s``, and the on-disk
watermark advances over every acknowledged prefix. New records keep going to
the spool until it is empty, so replay always precedes them.

Admission: the queue is bounded by refusing new work (:meth:`refusal`), never
by dropping a record of work already admitted. When the spool cannot be
written (disk full, quota) while the broker is unreachable, records are held in
memory and :meth:`refusal` says the service can no longer log; the app answers
503 with that reason until either recovers.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from online_sao.config import TopicsConfig
from online_sao.schemas import Interaction, Reward, encode
from serving.spool import Spool, SpoolEntry
from streams.base import Producer, StreamUnavailable

log = logging.getLogger(__name__)

_JOIN_GRACE_S = 5.0


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


@dataclass(frozen=True)
class CloseReport:
    acknowledged: int
    """Records the broker acknowledged during this logger's life."""
    spooled: int
    """Records left in the spool for the next start."""
    held_in_memory: int
    """Records that could be neither delivered nor spooled (lost at exit)."""


class InteractionLogger:
    def __init__(self, producer: Producer, topics: TopicsConfig, spool_dir: Path, *,
                 max_queue: int = 10_000, window: int = 256, stall_s: float = 5.0, retry_s: float = 1.0,
                 spool_max_bytes: int = 1 << 30, clock: Callable[[], float] = time.monotonic):
        self._producer = producer
        self._topics = topics
        self._spool = Spool(spool_dir, spool_max_bytes)
        self._max_queue = max_queue
        self._window = window
        self._stall_s = stall_s
        self._retry_s = retry_s
        self._clock = clock
        self._cv = threading.Condition()
        self._queue: deque[_Pending] = deque()
        self._with_producer: dict[int, _Pending] = {}
        self._seq = self._spool.last_seq
        self._spooling = self._spool.pending_records > 0
        self._closing = False
        self._deadline = float("inf")
        self._crashed: str | None = None
        self.acknowledged = 0
        self.delivery_failures = 0
        self._thread = threading.Thread(target=self._run, name="interaction-logger", daemon=True)

    # ------------------------------------------------------------------ request side

    def start(self) -> None:
        self._thread.start()

    def submit(self, record: Interaction | Reward) -> None:
        """Queue a record for the broker; never blocks on the network or the disk."""
        topic = self._topics.interactions if isinstance(record, Interaction) else self._topics.rewards
        value = encode(record)
        with self._cv:
            if self._closing and not self._thread.is_alive():
                raise RuntimeError(f"the interaction logger is closed; {record.interaction_id} was not logged")
            self._seq += 1
            self._queue.append(_Pending(self._seq, topic, record.interaction_id.encode("utf-8"), value))
            self._cv.notify()

    def refusal(self) -> str | None:
        """Why new work must be refused now (None while it can be logged)."""
        if self._crashed is not None:
            return f"the interaction logger stopped: {self._crashed}"
        if self._closing:
            return "the server is shutting down"
        if len(self._queue) >= self._max_queue:
            return f"interaction log backlog is full ({len(self._queue)} records waiting for the broker)"
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
            self._cv.notify_all()
        if self._thread.is_alive():
            # the producer may block a send for its own timeout; give the thread that long too
            self._thread.join(timeout_s + self._stall_s + _JOIN_GRACE_S)
        if self._thread.is_alive():
            log.error("interaction logger thread did not stop; %d records were not spooled",
                      len(self._queue) + len(self._with_producer))
            return CloseReport(self.acknowledged, self._spool.pending_records,
                               len(self._queue) + len(self._with_producer))
        held = self._spool.held_in_memory
        return CloseReport(self.acknowledged, self._spool.pending_records - held, held)

    # ------------------------------------------------------------------ sender thread

    def _run(self) -> None:
        try:
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
        except Exception as exc:  # the thread must not die silently: readiness reports it
            log.exception("interaction logger stopped")
            self._crashed = f"{type(exc).__name__}: {exc}"

    def _drained(self) -> bool:
        """Everything submitted is acknowledged (caller holds the lock)."""
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
            (log.debug if self._spooling else log.warning)("broker unavailable, spooling: %s", exc)
        with self._cv:  # never handed: the spool (or the queue) still holds it
            pending.state = "new"
            del self._with_producer[pending.seq]
        return False

    def _delivered(self, pending: _Pending, error: BaseException | None) -> None:
        """Delivery report from the producer's I/O thread."""
        with self._cv:
            if error is None:
                pending.state = "acked"
                self.acknowledged += 1
            else:
                pending.state = "failed"
                self.delivery_failures += 1
                log.warning("record %d to %s not delivered: %s", pending.seq, pending.topic, error)
            pending.changed_at = self._clock()
            self._cv.notify_all()

    def _drop_acknowledged(self) -> None:
        with self._cv:
            for seq in [s for s, p in self._with_producer.items() if p.state == "acked"]:
                del self._with_producer[seq]

    def _direct_in_trouble(self) -> bool:
        now = self._clock()
        with self._cv:
            return any(p.state == "failed" or (p.state == "handed" and now - p.changed_at > self._stall_s)
                       for p in self._with_producer.values())

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
        if self._spool.pending_records == 0:
            with self._cv:
                self._spooling = False
                self._cv.notify_all()
            log.info("spool replayed: logging directly to the broker again")
            progressed = True
        return progressed
