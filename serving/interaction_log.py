"""Logging interactions and rewards to the broker, with the client's acknowledgement tied to durability.

Requests call :meth:`InteractionLogger.submit`, which encodes the record, gives
it the next sequence number, topic and key (:mod:`streams.records`) and returns
a :class:`Receipt`; the request answers its client once the receipt says the
record is durable. How a record becomes durable is the logger's
:class:`DurabilityMode`, one per ``serving.log_durability``:

``write_ahead`` (default, :class:`~serving.write_ahead_log.WriteAheadMode`)
    Every record is appended to the spool and fsynced (group commit) before its
    receipt is durable; a sender ships the spool to the broker in cycles. A crash
    loses nothing a client was told about.

``memory`` (:class:`~serving.memory_log.MemoryMode`)
    Records go straight to the producer and the receipt is durable at once; only
    when the broker cannot be reached do they go to the spool, to be replayed in
    order. A crash loses what was still only in memory.

Both ship the spool with :class:`~serving.spool_sender.SpoolSender`. After a
crash, a record the broker took before its acknowledgement reached the spool is
found on its topic by the restarted sender's read back (``readback``) and not
sent again, so the topic holds every acknowledged record once
(:mod:`serving.spool_readback`).

Admission: the backlog is bounded by refusing new work (:meth:`InteractionLogger.refusal`),
never by dropping a record of work already admitted. When the spool cannot be
written while the broker is unreachable, ``refusal`` says the service can no
longer log and why; the app answers 503 with that reason until either recovers.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

from online_sao.config import TopicsConfig
from online_sao.schemas import Interaction, Reward, encode
from serving.log_state import Durability, LogSettings, LogState
from serving.memory_log import MemoryMode
from serving.receipt import Receipt
from serving.spool_readback import TopicTail
from serving.spool_sender import Pending, SpoolSender
from serving.write_ahead_log import WriteAheadMode
from streams.base import Producer
from streams.records import record_key, record_topic

__all__ = ["CloseReport", "Durability", "DurabilityMode", "InteractionLogger", "LogSettings"]

log = logging.getLogger(__name__)

JOIN_GRACE_S = 5.0
"""Extra wait for a logger thread to stop on close, beyond the flush timeout and a blocked send."""


@dataclass(frozen=True)
class CloseReport:
    acknowledged: int
    """Records the broker acknowledged during this logger's life."""
    spooled: int
    """Records left in the spool for the next start."""
    held_in_memory: int
    """Records that could be neither delivered nor spooled (lost at exit)."""


class DurabilityMode(Protocol):
    """How queued records become durable and reach the broker: the mode's threads take them from
    ``LogState.queue``. Methods marked so are called with the log's lock held."""

    sender: SpoolSender

    @property
    def spooling(self) -> bool:
        """Records wait in the spool because the broker is unreachable (or was, until they are replayed)."""
        ...

    def threads(self) -> list[threading.Thread]:
        """The mode's threads (made, not started)."""
        ...

    def stopped(self) -> bool:
        """(lock held) Nothing takes records from the queue any more."""
        ...

    def queued(self, pending: Pending) -> Receipt:
        """(lock held) ``pending`` was queued: wake whoever takes it; its receipt."""
        ...

    def drained(self) -> bool:
        """(lock held) Every submitted record is acknowledged."""
        ...

    def wake_all(self) -> None:
        """(lock held) The log is closing: wake every thread of the mode."""
        ...


MODES: dict[str, Callable[[LogState, Producer], DurabilityMode]] = {
    "write_ahead": WriteAheadMode, "memory": MemoryMode}


class InteractionLogger:
    def __init__(self, producer: Producer, topics: TopicsConfig, spool_dir: Path,
                 settings: LogSettings = LogSettings(), clock: Callable[[], float] = time.monotonic,
                 readback: TopicTail | None = None, wall: Callable[[], float] = time.time):
        """``readback``: how to read the topics back after a restart, so that records the broker took
        just before a crash are not sent again (:mod:`serving.spool_readback`; None: they are);
        ``wall``: the clock records are created with (:mod:`serving.spool_clock`)."""
        if settings.durability not in MODES:
            raise ValueError(f"unknown log durability {settings.durability!r}")
        self._state = LogState(spool_dir, topics, settings, clock, readback, wall)
        self._mode = MODES[settings.durability](self._state, producer)
        self._threads = self._mode.threads()
        self._topics = topics
        self._seq = self._state.spool.last_seq
        self.durability = settings.durability

    @property
    def mode(self) -> DurabilityMode:
        return self._mode

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def submit(self, record: Interaction | Reward) -> Receipt:
        """Queue a record for the broker; never blocks on the network or the disk. The
        receipt says when the record is durable (at once in ``memory`` mode)."""
        value = encode(record)
        state = self._state
        with state.signal.lock:
            if state.closing and self._mode.stopped():
                raise RuntimeError(f"the interaction logger is closed; {record.interaction_id} was not logged")
            self._seq += 1
            state.clock_steps.created(self._seq, record.created_at)
            pending = Pending(self._seq, record_topic(record, self._topics), record_key(record), value)
            state.queue.append(pending)
            return self._mode.queued(pending)

    def refusal(self) -> str | None:
        """Why new work must be refused now (None while it can be logged)."""
        state = self._state
        if state.crashed is not None:
            return f"the interaction logger stopped: {state.crashed}"
        if state.closing:
            return "the server is shutting down"
        backlog = len(state.queue) + state.spool.held_in_memory
        if backlog >= state.settings.max_queue:
            return f"interaction log backlog is full ({backlog} records waiting for the disk or the broker)"
        if self._mode.spooling and state.spool.error is not None:
            return f"cannot log interactions: the broker is unreachable and {state.spool.error}"
        return None

    @property
    def queue_depth(self) -> int:
        return len(self._state.queue)

    @property
    def spool_bytes(self) -> int:
        return self._state.spool.pending_bytes

    @property
    def spool_records(self) -> int:
        return self._state.spool.pending_records

    @property
    def spooling(self) -> bool:
        """memory: records go to the spool; write_ahead: the broker is unreachable (records wait there)."""
        return self._mode.spooling

    @property
    def found_on_topic(self) -> int:
        """Records of a restarted spool that the broker already held and were not sent again."""
        return self._mode.sender.found_on_topic

    @property
    def acknowledged(self) -> int:
        """Records the broker acknowledged so far."""
        return self._mode.sender.acknowledged

    def flush(self, timeout_s: float) -> bool:
        """Wait until every submitted record is acknowledged; False if ``timeout_s`` passed first."""
        state = self._state
        deadline = state.clock() + timeout_s
        with state.signal.changed:
            while not self._mode.drained():
                remaining = deadline - state.clock()
                if remaining <= 0 or state.crashed is not None:
                    return False
                state.signal.changed.wait(min(remaining, state.settings.retry_s))
            return True

    def close(self, timeout_s: float = 10.0) -> CloseReport:
        """Deliver what can be delivered within ``timeout_s``; spool the rest for the next start."""
        state, sender = self._state, self._mode.sender
        with state.signal.changed:
            state.closing = True
            state.deadline = state.clock() + timeout_s
            state.signal.events += 1
            state.signal.changed.notify_all()
            self._mode.wake_all()
        for thread in self._threads:
            if thread.is_alive():
                # the producer may block a send for its own timeout; give the thread that long too
                thread.join(timeout_s + state.settings.stall_s + JOIN_GRACE_S)
        if any(thread.is_alive() for thread in self._threads):
            lost = len(state.queue) + sender.in_flight
            log.error("interaction logger thread did not stop; %d records were not spooled", lost)
            return CloseReport(sender.acknowledged, state.spool.pending_records, lost)
        state.spool.close()
        held = state.spool.held_in_memory
        return CloseReport(sender.acknowledged, state.spool.pending_records - held, held)
