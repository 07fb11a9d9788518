"""A sequence as the native engine's loop holds it, and the outbox that hands a round's token
events to their consumers' event loops (:mod:`.torch_engine`)."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

from serving.engine.base import GenerationRequest, TokenEvent
from serving.engine.sampling import RowSampling


@dataclass
class EngineSequence:
    """One request in the engine: its sampling settings, how far it got, whom to tell."""

    request: GenerationRequest
    sampling: RowSampling
    max_new: int
    loop: asyncio.AbstractEventLoop | None = None
    """The consumer's event loop (set by ``generate`` before the request is queued)."""
    events: "asyncio.Queue[TokenEvent | BaseException] | None" = None
    """The consumer's queue, read on ``loop``."""
    cancelled: threading.Event = field(default_factory=threading.Event)
    generated: int = 0
    last_token: int = -1


Delivery = tuple[EngineSequence, "TokenEvent | BaseException"]


def _put_all(items: list[Delivery]) -> None:
    """(consumer's event loop) Queue each event for its sequence's consumer."""
    for seq, event in items:
        seq.events.put_nowait(event)


class Outbox:
    """(loop thread) The events of one round, handed to each consumer event loop in one call.

    ``call_soon_threadsafe`` wakes the event loop through a socket write; one per
    token made the engine thread and the event loop trade the GIL 16 times per
    decode step of a full batch. Events of one sequence keep their order.
    """

    def __init__(self) -> None:
        self._by_loop: dict[asyncio.AbstractEventLoop, list[Delivery]] = {}

    def put(self, seq: EngineSequence, event: TokenEvent | BaseException) -> None:
        assert seq.loop is not None, "a sequence reaches the loop only through generate()"
        self._by_loop.setdefault(seq.loop, []).append((seq, event))

    def flush(self) -> None:
        for loop, items in self._by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the consumers' event loop is closed: nobody listens any more
                for seq, _ in items:
                    seq.cancelled.set()
        self._by_loop.clear()
