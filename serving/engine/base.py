"""The inference-engine seam of serving.

The HTTP layer turns a request into a :class:`GenerationRequest` of token ids
and consumes :class:`TokenEvent` s as the engine samples them. Engines: the
native PyTorch engine (:mod:`serving.engine.torch_engine`, default) and vLLM
(:mod:`serving.engine.vllm_engine`). Every sampled token carries its behaviour
log-probability under the exact sampling distribution and the policy version
that sampled it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Generic, Protocol, TypeVar

import torch

from online_sao.schemas import SamplingParams
from online_sao.weights import CorruptWeights

log = logging.getLogger(__name__)

W = TypeVar("W")
"""What an engine queues for its loop: its own record of one request."""


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    """Token ids that end generation (the eos/end-of-turn ids); the stop token is
    sampled and logged as an action but not returned as text."""
    top_logprobs: int = 0
    """How many of the most likely tokens (under the tempered nucleus distribution:
    :attr:`TokenEvent.top_logprobs`) each :class:`TokenEvent` lists beside the sampled
    one; 0 lists none."""
    trajectory_id: str | None = None
    """For a continuation: the interaction id of its trajectory's first turn that sampled tokens
    (``turn_origins[0]``); None when this request begins its trajectory (then ``request_id`` is
    that id). A canary answers every turn of a trajectory with one engine
    (:mod:`serving.engine.canary`)."""
    previous_version: int | None = None
    """For a continuation: the policy version that sampled its trajectory's last sampled token (its previous
    turn's); None when this request begins its trajectory. A canary keeps a continuation of a turn its newest
    engine answered there while that engine serves this version (:mod:`serving.engine.canary`)."""


@dataclass(frozen=True)
class TokenEvent:
    token_id: int
    logprob: float
    version: int
    finish_reason: str | None = None
    """None while generating; 'stop' or 'length' on the last token."""
    top_logprobs: tuple[tuple[int, float], ...] = ()
    """The request's ``top_logprobs`` most likely tokens at this position as ``(token_id, logprob)``,
    most likely first, under the tempered nucleus distribution (temperature and top-p applied); tokens
    outside the nucleus (log-probability -inf) are left out, so there may be fewer. That is the
    distribution of ``logprob`` except for a greedy token (temperature at most ``GREEDY_TEMPERATURE``):
    its ``logprob`` is 0, that of the point mass at the arg-max that chose it, while its alternatives
    are still the tempered ones, where the point mass would list the chosen token alone and say
    nothing of the others. So there the chosen token's own entry (if listed) is its tempered
    log-probability, not 0, and a tie rounded by the temperature may list another token first."""


@dataclass(frozen=True)
class SwapResult:
    version: int
    applied: bool
    load_s: float
    """Seconds spent loading and verifying off the request path."""
    stall_s: float
    """Seconds decoding was paused for the switch itself."""
    reason: str = ""


@dataclass
class LoopJob:
    """Work an engine's loop thread runs between two model steps (a weight switch)."""

    apply: Callable[[], None]
    done: threading.Event = field(default_factory=threading.Event)
    seconds: float = 0.0
    """How long ``apply`` paused the loop."""
    error: BaseException | None = None

    def run(self) -> None:
        start = time.perf_counter()
        try:
            self.apply()
        except BaseException as exc:  # handed back to the thread waiting in EngineLoop.between_steps, which raises it
            self.error = exc
        self.seconds = time.perf_counter() - start
        self.done.set()


class RequestRefused(ValueError):
    """An engine cannot serve a request as asked; raised by ``generate`` before anything is sampled
    (a 400). ``field`` names what it cannot serve: a :class:`GenerationRequest` field
    (``prompt_ids``, ``top_logprobs``) or a :class:`~online_sao.schemas.SamplingParams` one
    (``temperature``, ``seed``), so that the HTTP layer names the request's parameter; None when no one
    field is to blame."""

    def __init__(self, message: str, field: str | None):
        super().__init__(message)
        self.field = field


class EngineStopped(RuntimeError):
    """The engine stopped before the request finished."""


class EngineLoop(Generic[W]):
    """What an engine's loop thread shares with its callers, and the steps every engine's loop takes.

    Callers queue requests (:meth:`submit`) and weight switches (:meth:`swap`);
    the loop thread (``target`` of :meth:`start`) takes them with :meth:`next_round`
    and runs the switches between two model steps. ``cond`` guards the queues and
    flags; :attr:`version` is the policy version of the weights the loop uses.
    """

    def __init__(self, initial_version: int = 0):
        self.cond = threading.Condition()
        self.waiting: deque[W] = deque()
        """Requests queued for the loop, oldest first."""
        self.jobs: list[LoopJob] = []
        """Weight switches waiting for the loop to run them between two steps."""
        self.alive = False
        """The loop thread runs and takes requests (read under ``cond``)."""
        self.stopping = False
        self.version = initial_version
        self._swap_lock = threading.Lock()  # one swap at a time
        self._thread: threading.Thread | None = None

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self, target: Callable[[], None], name: str) -> None:
        """Run ``target`` (the engine's loop) on a daemon thread, unless one runs already."""
        if self._thread is not None:
            return
        self.stopping, self.alive = False, True
        self._thread = threading.Thread(target=target, name=name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Tell the loop to stop and wait until it did (blocking)."""
        if self._thread is None:
            return
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        self._thread.join()
        self._thread = None

    def submit(self, request: W) -> None:
        """Queue a request for the loop; :class:`EngineStopped` if no loop takes requests."""
        with self.cond:
            if not self.alive or self.stopping:
                raise EngineStopped("the engine is not running (call start())")
            self.waiting.append(request)
            self.cond.notify()

    def next_round(self, busy: bool, room: int | None,
                   gone: Callable[[W], bool] | None = None) -> tuple[list[LoopJob], list[W]]:
        """(loop thread) Wait for work: a switch, a queued request, a stop, or none when ``busy`` (requests
        in flight). Take every switch and up to ``room`` queued requests (all when None, none once
        stopping); after a stop :attr:`alive` is False. Queued requests for which ``gone`` is true
        (their caller left: a disconnect, a deadline) are dropped first, so that they take no place
        in ``room`` and no live request waits behind them."""
        with self.cond:
            if gone is not None and self.waiting:
                self.waiting = deque(request for request in self.waiting if not gone(request))
            while not (self.stopping or self.jobs or self.waiting or busy):
                self.cond.wait()
            jobs = list(self.jobs)
            self.jobs.clear()  # in place: a swap waiting in between_steps holds this list
            if self.stopping:
                self.alive = False
                return jobs, []
            count = len(self.waiting) if room is None else min(room, len(self.waiting))
            return jobs, [self.waiting.popleft() for _ in range(count)]

    def take_waiting(self) -> list[W]:
        """(loop thread, stopped) The requests still queued; the queue is empty after."""
        with self.cond:
            leftovers = list(self.waiting)
            self.waiting.clear()
        return leftovers

    def switch_pending(self) -> bool:
        with self.cond:
            return bool(self.jobs)

    def between_steps(self, apply: Callable[[], None], run_here: Callable[[LoopJob], None]) -> LoopJob:
        """Hand ``apply`` to the loop thread and wait until it ran between two steps.

        Without a running loop the job runs on this thread through ``run_here`` (which
        takes the engine's own lock if it has one). An exception raised by ``apply`` is
        raised here.
        """
        job = LoopJob(apply)
        with self.cond:
            queued = self.alive
            if queued:
                self.jobs.append(job)
                self.cond.notify()
        if queued:
            job.done.wait()
        else:
            run_here(job)
        if job.error is not None:
            raise job.error
        return job

    def swap(self, version: int, force: bool, prepare: Callable[[], Callable[[], None]],
             run_here: Callable[[LoopJob], None]) -> SwapResult:
        """The weight swap of every engine (blocking, thread-safe): ignore a version not newer than the
        serving one unless ``force`` (rollback); ``prepare()`` checks and loads the weights off the
        request path (raising :class:`CorruptWeights` to refuse them) and returns the switch, which
        runs between two steps and makes ``version`` the serving one."""
        with self._swap_lock:
            current = self.version
            if version <= current and not force:
                return SwapResult(version, False, 0.0, 0.0,
                                  reason=f"ignored: version {version} is not newer than the serving version {current}")
            start = time.perf_counter()
            try:
                switch = prepare()
            except CorruptWeights as exc:
                log.warning("refused weights version %d: %s", version, exc)
                return SwapResult(version, False, time.perf_counter() - start, 0.0, reason=f"refused: {exc}")
            load_s = time.perf_counter() - start

            def apply() -> None:
                switch()
                self.version = version

            stall_s = self.between_steps(apply, run_here).seconds
            log.info("serving weights version %d (was %d): load %.3fs, stall %.4fs", version, current, load_s, stall_s)
            return SwapResult(version, True, load_s, stall_s)


class InferenceEngine(Protocol):
    @property
    def policy_version(self) -> int: ...

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """Stream the sampled tokens of one request; the last event has a finish_reason."""
        ...

    def swap_weights(self, version: int, state_dict: dict[str, torch.Tensor], force: bool = False) -> SwapResult:
        """Load a new version and switch between two decode steps. Thread-safe, blocking.
        An older version than the current one is ignored unless ``force`` (rollback)."""
        ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def check_prompt(prompt_ids: list[int], vocab_size: int, max_positions: int | None) -> None:
    """Refuse a prompt the model cannot take: empty, ids outside the vocabulary, or no
    position left to generate into. Raises RequestRefused naming the problem."""
    if not prompt_ids:
        raise RequestRefused("the prompt has no tokens", "prompt_ids")
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestRefused(f"token ids {bad[:5]} are outside the vocabulary of {vocab_size}", "prompt_ids")
    if max_positions is not None and len(prompt_ids) >= max_positions:
        raise RequestRefused(f"a prompt of {len(prompt_ids)} tokens leaves no room in the model's "
                             f"{max_positions} positions", "prompt_ids")


async def relay_events(events: "asyncio.Queue[TokenEvent | BaseException]",
                       cancelled: threading.Event) -> AsyncIterator[TokenEvent]:
    """Yield what an engine thread puts on ``events`` until the finishing event; an
    exception put there is raised. A consumer that stops early sets ``cancelled`` so the
    engine frees the request's slot at its next step."""
    try:
        while True:
            event = await events.get()
            if isinstance(event, BaseException):
                raise event
            yield event
            if event.finish_reason is not None:
                return
    finally:
        cancelled.set()
