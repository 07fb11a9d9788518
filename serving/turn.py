"""One admitted completion request while it is served (what it asked for, what was sampled) and what
the server has in flight: the admission bound, client disconnects, request deadlines and shutdown
(:class:`InFlight`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from online_sao.schemas import SamplingParams
from serving.answers import UsageInfo
from serving.errors import APIError, client_disconnected, request_timed_out, server_overloaded, shutting_down
from serving.receipt import Receipt
from serving.tool_calls import ParsedAnswer
from serving.trajectories import TrajectoryPrefix


ROUTE_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
"""The HTTP path of each route a record names: the ``route`` label of serving's latency metrics,
the same values as its request counter's (which counts by path)."""
PROMPT_PARAMS = {"chat": "messages", "completions": "prompt"}
"""The request field that holds each route's prompt (the ``param`` of errors about it)."""


@dataclass
class Turn:
    """One admitted request while it is served."""

    interaction_id: str
    route: str
    prefix: TrajectoryPrefix
    sampling: SamplingParams
    user: str | None
    session_id: str | None
    segment: str | None = None
    """The request's segment key (:func:`serving.monitoring.request_segment`)."""
    template_messages: list[dict] | None = None
    message_keys: list[tuple] | None = None
    tools: list[dict] | None = None
    """Chat: the tools whose calls are parsed from the answer (None with ``tool_choice`` ``none``)."""
    rendered_tools: list[dict] | None = None
    """Chat: the tools the template rendered, the trajectory's (stored with the turn: a continuation
    renders them again, also one with ``tool_choice`` ``none``, which parses no call)."""
    prompt_text: str | None = None
    top_logprobs: int | None = None
    """Alternatives per token when the client asked for log-probs, else None."""
    created_at: float = field(default_factory=time.time)
    started: float = field(default_factory=time.perf_counter)
    timeout_s: float | None = None
    """Seconds from ``started`` within which the request must be answered (``serving.request_timeout_s``);
    None: no deadline."""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    alternatives: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    parsed: ParsedAnswer | None = None
    """Chat with tools: the answer split into content and tool calls, once it ended."""
    receipt: Receipt | None = None
    """Set when the interaction was submitted to the logger."""
    token_text_ends: list[int] = field(default_factory=list)
    """Where the texts of the first tokens end, in characters, as far as asked for (the completions'
    ``text_offset``): a stream asks at every chunk, and summing from the first token each time cost
    time in the square of the answer's length on the event loop."""

    @property
    def path(self) -> str:
        """The HTTP path it was asked on (:data:`ROUTE_PATHS`)."""
        return ROUTE_PATHS[self.route]

    @property
    def prompt_param(self) -> str:
        """The request field that holds its prompt, for errors about it."""
        return PROMPT_PARAMS[self.route]

    @property
    def created(self) -> int:
        """The answer's ``created`` (Unix seconds): one value for every chunk of a stream."""
        return int(self.created_at)

    @property
    def policy_versions(self) -> list[int]:
        return sorted(set(self.versions))

    @property
    def answer_finish_reason(self) -> str | None:
        """The finish reason clients see: ``tool_calls`` when the model ended its turn after calling tools."""
        if self.parsed is not None and self.parsed.calls and self.finish_reason == "stop":
            return "tool_calls"
        return self.finish_reason

    @property
    def content(self) -> str:
        """The text clients see as the answer (without tool-call blocks)."""
        return self.text if self.parsed is None else self.parsed.content

    def remaining_s(self) -> float | None:
        """Seconds left before its deadline (0 or less: passed); None without one."""
        return None if self.timeout_s is None else self.started + self.timeout_s - time.perf_counter()

    def usage(self) -> UsageInfo:
        prompt = len(self.prefix.engine_prompt)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=len(self.token_ids),
                         total_tokens=prompt + len(self.token_ids))


Disconnected = Callable[[], Awaitable[None]]
"""Returns (is awaited to completion) when the request's client has closed its connection."""


@dataclass(eq=False)
class _Section:
    """A stretch of one request's task that :class:`InFlight` may interrupt (:meth:`InFlight.interruptible`)."""

    turn: Turn
    task: asyncio.Task
    cancelling: int
    """The task's cancel requests when the section began (other cancellers' requests stay theirs)."""
    error: APIError | None = None
    """Why it was stopped: what the section ends with."""
    open: bool = True


class InFlight:
    """What the server has taken on: generation requests queued for a batch slot and holding one, the
    admission bound (``serving.max_waiting``), and the interruptions a request may meet while it waits
    for the engine or its log: its client leaving, its deadline passing (:attr:`Turn.timeout_s`), the
    server shutting down.

    Counted here, not read from an engine: every engine (torch, vLLM, a canary pair, the tests' fakes)
    is then bounded alike, and a request whose client left stops counting at once, while an engine
    drops it only at its next step. A request that has not sampled a token holds one of the batch's
    ``slots`` left free by those sampling (it is being prefilled), else it is queued for one.

    Interruptions cancel the request's task while it is inside :meth:`interruptible` (what it awaits
    there is the engine's stream or its record's durability): the engine's stream is closed (the
    sequence leaves the batch at its next step; what it sampled is logged with ``finish_reason``
    ``abort``) and the section ends with the interruption's :class:`APIError`, which the request still
    answers. Cancelling, rather than racing each await against the interruptions, keeps the token path
    free of extra tasks.
    """

    def __init__(self, max_waiting: int, slots: int):
        self.max_waiting = max_waiting
        self.slots = slots
        """The engine's batch (``serving.max_batch_size``)."""
        self.unstarted = 0
        """Admitted generation requests that have not sampled a token yet."""
        self.sampling = 0
        """Generation requests that sampled a token and have not finished."""
        self.draining = False
        """The server is shutting down: nothing new is admitted, nothing not started is started."""
        self.cut = False
        """The shutdown's grace is over: what still runs is cut."""
        self._sections: set[_Section] = set()

    @property
    def _free_slots(self) -> int:
        return max(0, self.slots - self.sampling)

    @property
    def waiting(self) -> int:
        """Requests queued for a batch slot: not started, beyond the slots free of sampling ones."""
        return max(0, self.unstarted - self._free_slots)

    @property
    def running(self) -> int:
        """Requests holding a batch slot: sampling, or being prefilled."""
        return self.sampling + min(self.unstarted, self._free_slots)

    def admit(self) -> None:
        """Raise the 503 that refuses a new request now (shutting down, or ``max_waiting`` queued)."""
        if self.draining:
            raise shutting_down(started=False)
        if max(0, self.unstarted + 1 - self._free_slots) > self.max_waiting:  # it would queue beyond the bound
            raise server_overloaded(self.waiting)

    def entered(self) -> None:
        """An admitted request was handed to the engine."""
        self.unstarted += 1

    def started(self) -> None:
        """A request sampled its first token."""
        self.unstarted -= 1
        self.sampling += 1

    def ended(self, started: bool) -> None:
        """A request left the engine (finished, failed or cancelled), after its first token or before."""
        if started:
            self.sampling -= 1
        else:
            self.unstarted -= 1

    @contextmanager
    def interruptible(self, turn: Turn, disconnected: Disconnected | None = None) -> Iterator[None]:
        """Run the body (in the request's task) so that a shutdown, the turn's deadline, or the client's
        disconnect when ``disconnected`` is given, interrupts it with its 503, 504 or 499 :class:`APIError`;
        raised at once when the interruption came before (the shutdown's or the deadline's, between two
        lines of a stream)."""
        if self.cut or (self.draining and not turn.token_ids):
            raise shutting_down(started=bool(turn.token_ids))
        remaining_s = turn.remaining_s()
        if remaining_s is not None and remaining_s <= 0:
            raise request_timed_out(turn.timeout_s, started=bool(turn.token_ids))
        task = asyncio.current_task()
        section = _Section(turn, task, task.cancelling())
        self._sections.add(section)
        watcher = None if disconnected is None else asyncio.ensure_future(self._stop_on(disconnected, section))
        # a timer, not a task: a stream opens a section per line, and a timer costs a heap entry
        deadline = (None if remaining_s is None
                    else asyncio.get_running_loop().call_later(remaining_s, self._expire, section))
        try:
            yield
        except asyncio.CancelledError:
            # ours, and no one else's cancel pending: answer it; else it goes on as the cancel it is
            if section.error is None or task.uncancel() > section.cancelling:
                raise
            raise section.error from None
        finally:
            section.open = False
            self._sections.discard(section)
            if watcher is not None:
                watcher.cancel()
            if deadline is not None:
                deadline.cancel()

    async def _stop_on(self, disconnected: Disconnected, section: _Section) -> None:
        await disconnected()
        self._stop(section, client_disconnected())

    def _expire(self, section: _Section) -> None:
        self._stop(section, request_timed_out(section.turn.timeout_s, started=bool(section.turn.token_ids)))

    def _stop(self, section: _Section, error: APIError) -> None:
        # the section's task is suspended inside it (this runs on another task or a timer of the same
        # loop, and a section leaves the set before its task next awaits): the cancel lands there
        if section.open and section.error is None:
            section.error = error
            section.task.cancel()

    def begin_shutdown(self, cut_after_s: float | None) -> None:
        """(event loop) Stop admitting; answer the requests that sampled nothing yet with 503 now (a client
        retries them elsewhere at once); let the others run for ``cut_after_s`` (None: as long as they
        take), then cut them (503, or a stream's error event), so each gets an answer before the server's
        own grace ends and it drops whatever is left."""
        if self.draining:
            return
        self.draining = True
        for section in list(self._sections):
            if not section.turn.token_ids:
                self._stop(section, shutting_down(started=False))
        if cut_after_s is not None:
            asyncio.get_running_loop().call_later(cut_after_s, self._cut)

    def _cut(self) -> None:
        self.cut = True
        for section in list(self._sections):
            self._stop(section, shutting_down(started=bool(section.turn.token_ids)))
