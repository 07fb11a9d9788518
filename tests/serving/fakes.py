"""Small fakes for serving unit tests: an engine with scripted tokens and a producer with outages."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass, field
from typing import AsyncIterator

import torch

from serving.engine.base import GenerationRequest, SwapResult, TokenEvent
from serving.engine.torch_engine import StepStats
from streams.base import DeliveryReport, Producer, StreamUnavailable


class StepGate:
    """A TorchEngine's ``on_step``: records every step in ``stats`` and holds the loop after decode step
    ``hold_at`` (setting ``reached``) until the test sets ``resume``. Unless ``armed``, it counts decode
    steps only from :meth:`arm` on (an engine that warms up before traffic)."""

    def __init__(self, hold_at: int, armed: bool = True):
        self.hold_at = hold_at
        self.stats: list[StepStats] = []
        self.reached, self.resume = threading.Event(), threading.Event()
        self._armed_at: int | None = 0 if armed else None

    def arm(self) -> None:
        self._armed_at = len(self.stats)

    def __call__(self, step: StepStats) -> None:
        self.stats.append(step)
        if self._armed_at is None or step.kind != "decode":
            return
        if sum(s.kind == "decode" for s in self.stats[self._armed_at:]) == self.hold_at:
            self.reached.set()
            assert self.resume.wait(10), "the test never let the engine's loop go on"


class FakeEngine:
    """Implements ``InferenceEngine``: answers every request with ``script`` (token ids).

    Token i has log-probability ``-0.1 * (i + 1)`` and the engine's current version.
    A stop token ends the answer with 'stop'; ``max_tokens`` with 'length'. ``delay_s``
    pauses before each token (to test disconnects and concurrency). ``slots`` bounds the answers
    sampled at once (the others queue before their first token, like a full batch), and an answer
    holds after ``hold_after`` tokens until ``release`` is set (or it is cancelled).
    """

    def __init__(self, script: list[int], stop_ids: frozenset[int] = frozenset(), delay_s: float = 0.0):
        self.script = script
        self.stop_ids = stop_ids
        self.delay_s = delay_s
        self.version = 0
        self.requests: list[GenerationRequest] = []
        self.started = False
        self.open_streams = 0
        self.fail_with: Exception | None = None
        """Raised when a request arrives, before any token."""
        self.fail_after: tuple[int, Exception] | None = None
        """``(n, error)``: raised after the n-th token of an answer (a failure once a stream began)."""
        self.slots: int | None = None
        """Answers sampled at once, at most (None: no bound); set before the first request."""
        self.queued = 0
        """Requests waiting for a slot."""
        self.hold_after: int | None = None
        """Tokens after which an answer waits for ``release``."""
        self.holding = 0
        """Answers waiting for ``release`` now."""
        self.release = threading.Event()
        self._semaphore: asyncio.Semaphore | None = None

    @property
    def policy_version(self) -> int:
        return self.version

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        self.requests.append(request)
        if self.fail_with is not None:
            raise self.fail_with
        self.open_streams += 1
        try:
            async with self._slot():
                for i, token in enumerate(self.script):
                    if i == self.hold_after:
                        await self._hold()
                    if self.delay_s:
                        await asyncio.sleep(self.delay_s)
                    last = i + 1 == request.sampling.max_tokens or i + 1 == len(self.script)
                    finish = "stop" if token in request.stop_token_ids else ("length" if last else None)
                    yield TokenEvent(token, -0.1 * (i + 1), self.version, finish)
                    if finish is not None:
                        return
                    if self.fail_after is not None and i + 1 == self.fail_after[0]:
                        raise self.fail_after[1]
        finally:
            self.open_streams -= 1

    @contextlib.asynccontextmanager
    async def _slot(self):
        """One of ``slots`` while the answer is sampled (nothing without a bound)."""
        if self.slots is None:
            yield
            return
        if self._semaphore is None:  # made on the server's loop
            self._semaphore = asyncio.Semaphore(self.slots)
        self.queued += 1
        try:
            await self._semaphore.acquire()
        finally:
            self.queued -= 1
        try:
            yield
        finally:
            self._semaphore.release()

    async def _hold(self) -> None:
        self.holding += 1
        try:
            while not self.release.is_set():  # a threading.Event: the test thread sets it
                await asyncio.sleep(0.01)
        finally:
            self.holding -= 1

    def swap_weights(self, version: int, state_dict: dict[str, torch.Tensor], force: bool = False) -> SwapResult:
        applied = force or version > self.version
        if applied:
            self.version = version
        return SwapResult(version, applied, 0.0, 0.0)

    async def start(self) -> None:
        self.started = True

    async def stop(self) -> None:
        self.started = False


@dataclass
class _Sent:
    topic: str
    value: bytes
    key: bytes | None
    report: DeliveryReport | None


@dataclass
class FakeProducer(Producer):
    """A producer whose broker can go down: while down, sends are held (like kafka-python
    retrying) and reported when it comes back, or failed with :meth:`expire`.

    ``delivered`` is the broker's log: (topic, key, value) in the order the broker wrote them.
    ``refuse_sends`` makes ``send`` itself raise StreamUnavailable (metadata unavailable).
    """

    up: bool = True
    refuse_sends: bool = False
    delivered: list[tuple[str, bytes | None, bytes]] = field(default_factory=list)
    held: list[_Sent] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def send(self, topic: str, value: bytes, key: bytes | None = None,
             on_delivery: DeliveryReport | None = None) -> None:
        if self.refuse_sends:
            raise StreamUnavailable("fake broker: metadata unavailable")
        sent = _Sent(topic, value, key, on_delivery)
        with self.lock:
            if not self.up:
                self.held.append(sent)
                return
            self.delivered.append((topic, key, value))
        if on_delivery is not None:
            on_delivery(None)

    def go_down(self) -> None:
        with self.lock:
            self.up = False

    def come_back(self) -> None:
        """The broker returns: held records are written and acknowledged, in order."""
        with self.lock:
            self.up = True
            held, self.held = self.held, []
            for s in held:
                self.delivered.append((s.topic, s.key, s.value))
        for s in held:
            if s.report is not None:
                s.report(None)

    def expire(self) -> int:
        """Held records time out (delivery timeout): reported failed, not written."""
        with self.lock:
            held, self.held = self.held, []
        for s in held:
            if s.report is not None:
                s.report(StreamUnavailable("fake broker: delivery timed out"))
        return len(held)

    def flush(self, timeout_s: float | None = None) -> None:
        if self.held:
            raise StreamUnavailable("fake broker: records not acknowledged")

    def close(self) -> None:
        pass
