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
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Protocol

import torch

from online_sao.schemas import SamplingParams


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    """Token ids that end generation (the eos/end-of-turn ids); the stop token is
    sampled and logged as an action but not returned as text."""


@dataclass(frozen=True)
class TokenEvent:
    token_id: int
    logprob: float
    version: int
    finish_reason: str | None = None
    """None while generating; 'stop' or 'length' on the last token."""


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
        except BaseException as exc:  # handed back to the thread waiting in run_between_steps, which raises it
            self.error = exc
        self.seconds = time.perf_counter() - start
        self.done.set()


def run_between_steps(apply: Callable[[], None], cond: threading.Condition, jobs: list[LoopJob],
                      loop_alive: Callable[[], bool], run_here: Callable[[LoopJob], None]) -> LoopJob:
    """Hand ``apply`` to the engine's loop thread and wait until it ran between two steps.

    ``jobs`` is the loop's queue, guarded by ``cond`` (the loop drains it in place
    under ``cond``); ``loop_alive`` is read under ``cond``. Without a running loop
    the job runs on this thread through ``run_here`` (which takes the engine's own
    lock). An exception raised by ``apply`` is raised here.
    """
    job = LoopJob(apply)
    with cond:
        queued = loop_alive()
        if queued:
            jobs.append(job)
            cond.notify()
    if queued:
        job.done.wait()
    else:
        run_here(job)
    if job.error is not None:
        raise job.error
    return job


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
    position left to generate into. Raises ValueError naming the problem."""
    if not prompt_ids:
        raise ValueError("the prompt has no tokens")
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token ids {bad[:5]} are outside the vocabulary of {vocab_size}")
    if max_positions is not None and len(prompt_ids) >= max_positions:
        raise ValueError(f"a prompt of {len(prompt_ids)} tokens leaves no room in the model's "
                         f"{max_positions} positions")


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
