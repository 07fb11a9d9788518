"""The state of an interaction log that does not depend on its durability mode.

:class:`LogState` is shared by :class:`serving.interaction_log.InteractionLogger`
and its mode (:mod:`serving.write_ahead_log`, :mod:`serving.memory_log`): the
spool, the one lock (:class:`~serving.spool_sender.Signal`) that guards all of
it, the queue of submitted records, and the closing and crash state the mode's
threads read.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

from online_sao.config import ServingConfig, TopicsConfig
from serving.spool import Spool
from serving.spool_clock import ClockSteps
from serving.spool_readback import TopicTail
from serving.spool_sender import OnDelivered, OnRefused, Pending, Signal, SpoolSender
from streams.base import Producer

log = logging.getLogger(__name__)

Durability = Literal["write_ahead", "memory"]


@dataclass(frozen=True)
class LogSettings:
    """How an interaction log works; the fields mirror ``serving.log_*`` and ``serving.spool_max_bytes``."""

    durability: Durability = "write_ahead"
    """``serving.log_durability``: when a record counts as durable."""
    max_queue: int = 10_000
    """``serving.log_queue_size``: a backlog this long refuses new work."""
    window: int = 256
    """``serving.log_window``: records with the producer at most."""
    stall_s: float = 5.0
    """``serving.log_stall_s``: a record unacknowledged this long means the broker is unreachable."""
    retry_s: float = 1.0
    """``serving.log_retry_s``: pause before a failed record is sent again."""
    spool_max_bytes: int = 1 << 30
    """``serving.spool_max_bytes``: the spool's quota on disk."""
    ship_interval_s: float = 0.0
    """``serving.log_ship_interval_s``: write_ahead ships the spool in cycles this far apart."""

    @classmethod
    def from_config(cls, s: ServingConfig) -> "LogSettings":
        return cls(durability=s.log_durability, max_queue=s.log_queue_size, window=s.log_window,
                   stall_s=s.log_stall_s, retry_s=s.log_retry_s, spool_max_bytes=s.spool_max_bytes,
                   ship_interval_s=s.log_ship_interval_s)


class LogState:
    def __init__(self, spool_dir: Path, topics: TopicsConfig, settings: LogSettings,
                 clock: Callable[[], float] = time.monotonic, readback: TopicTail | None = None,
                 wall: Callable[[], float] = time.time):
        """``readback``: how the sender reads the topics back after a restart (serving.spool_readback);
        ``wall``: the clock records are created with, watched for steps back (serving.spool_clock)."""
        self.settings = settings
        self.readback = readback
        self.clock = clock
        self.spool = Spool(spool_dir, settings.spool_max_bytes, dead_letter_topic=topics.dead_letters)
        self.clock_steps = ClockSteps(spool_dir, self.spool.last_seq, wall)
        self.signal = Signal()
        self.queue: deque[Pending] = deque()
        """Submitted records not yet passed on (memory: to the producer; write_ahead: to the writer)."""
        self.closing = False
        self.deadline = float("inf")
        """When closing: deliver until then, then leave the rest in the spool."""
        self.crashed: str | None = None
        """Why a thread of the log stopped, if one did."""

    def sender(self, producer: Producer, on_refused: OnRefused, on_delivered: OnDelivered) -> SpoolSender:
        """A sender over this log's spool and lock, as the settings say."""
        s = self.settings
        return SpoolSender(producer, self.spool, self.signal, window=s.window, stall_s=s.stall_s, retry_s=s.retry_s,
                           on_refused=on_refused, on_delivered=on_delivered, clock=self.clock,
                           readback=self.readback, clock_steps=self.clock_steps)

    def thread(self, body: Callable[[], None], name: str) -> threading.Thread:
        """A daemon thread running ``body``; if it raises, :attr:`crashed` says why (and refusal() reports it)."""
        return threading.Thread(target=self._guard, args=(body,), name=name, daemon=True)

    def _guard(self, body: Callable[[], None]) -> None:
        try:
            body()
        except Exception as exc:  # the thread must not die silently: readiness reports it
            log.exception("interaction logger stopped")
            self.crashed = f"{type(exc).__name__}: {exc}"
            self.signal.notify()
