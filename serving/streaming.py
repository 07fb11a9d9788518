"""A streamed answer's server-sent events, from the turn's first piece to ``[DONE]`` or an error event.

:class:`AnswerStream` turns the text pieces of one admitted turn (:meth:`OpenAIServing._pieces
<serving.openai_serving.OpenAIServing._pieces>`, already started: the engine took the request before any
header went out) into SSE lines: an opening chunk (chat), the text as it may go out (with tools, text that
may begin a tool call, and blank text before it, waits for the end of the answer), the tool calls, the final
chunk once the record is durable, the usage chunk when asked for, ``[DONE]``. Whatever stops it after the
headers went out (a failure, the shutdown's cut, the request's deadline) ends it with a ``data: {"error": ...}``
event instead.

The turn itself (its pieces, then its record's durability) runs in a task of its own (:class:`TurnDriver`),
not in the response's: a client that stops reading blocks only the sending of the lines (the server's
``send()`` waits for the socket), while the answer is still sampled to its end, logged, and counted out
of the engine's batch, and the request's deadline and the shutdown's cut still reach it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractContextManager, aclosing
from dataclasses import dataclass

from pydantic import BaseModel

from serving.answers import AnswerFormat
from serving.errors import APIError, generation_failed
from serving.tool_calls import ToolCallParser
from serving.turn import Turn

DONE = "data: [DONE]\n\n"
"""The stream's last line when it ends normally."""


@dataclass(frozen=True)
class Streamed:
    """A streaming answer: its id (for the X-Interaction-Id header) and its SSE lines."""

    interaction_id: str
    events: AsyncIterator[str]


LINE_BREAKS_ESCAPED = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})
"""Characters that readers splitting on every Unicode line break (httpx's ``iter_lines``, many hand-written
SSE readers) take for a line's end: written raw, an answer holding one cut its event's JSON in two.
Escaped, the JSON is the same."""


def sse(payload: object) -> str:
    data = payload.model_dump_json() if hasattr(payload, "model_dump_json") else json.dumps(payload)
    return f"data: {data.translate(LINE_BREAKS_ESCAPED)}\n\n"


def stream_error(exc: Exception) -> dict:
    """The OpenAI-style error body for a failure after a stream began."""
    return (exc if isinstance(exc, APIError) else generation_failed(exc)).body()


class TurnDriver:
    """Runs the rest of a streamed turn in a task of its own (made on creation, on the running loop): reads
    its pieces to the end, then waits for its record's durability, each await inside an ``interruptible``
    section, so the shutdown's cut and the request's deadline interrupt it (in this task) and the record is
    logged and the engine's slot freed whether or not the client reads the stream.

    The response reads :meth:`progress`. :meth:`stop` (the response ended early: its client left) cancels
    the task and waits for it, so the turn is logged once, as ``abort``."""

    def __init__(self, turn: Turn, pieces: AsyncIterator[str], acknowledge: Callable[[], Awaitable[None]],
                 interruptible: Callable[[], AbstractContextManager[None]]):
        self._turn = turn
        self._pieces = pieces
        self._marks: asyncio.Queue[tuple[int, int] | None] = asyncio.Queue()
        self._marks.put_nowait((len(turn.text), len(turn.token_ids)))  # the piece read before the stream began
        self.task = asyncio.get_running_loop().create_task(self._run(acknowledge, interruptible))
        self.task.add_done_callback(_retrieve)

    async def _run(self, acknowledge: Callable[[], Awaitable[None]],
                   interruptible: Callable[[], AbstractContextManager[None]]) -> None:
        turn = self._turn
        try:
            async with aclosing(self._pieces):
                while True:
                    with interruptible():
                        piece = await anext(self._pieces, None)
                    if piece is None:
                        break
                    self._marks.put_nowait((len(turn.text), len(turn.token_ids)))
            with interruptible():
                await acknowledge()
        finally:
            self._marks.put_nowait(None)

    async def progress(self) -> AsyncIterator[tuple[int, int]]:
        """The turn's characters of text and tokens after each piece, as the turn advances (however far
        the reader lags behind); at the end, what ended the turn is raised (nothing: its record is
        durable)."""
        while (mark := await self._marks.get()) is not None:
            yield mark
        await asyncio.wait({self.task})  # it ends at once after the last mark; not cancelled with the reader
        self.task.result()

    async def stop(self) -> None:
        """Cancel the turn unless it ended, and wait until it did (its record is then submitted)."""
        if not self.task.done():
            self.task.cancel()
            await asyncio.wait({self.task})
        await self._pieces.aclose()  # a task cancelled before its first step never opened them


def _retrieve(task: asyncio.Task) -> None:
    """A driver's outcome is read by its stream, or nobody's once the stream ended: never reported as lost."""
    if not task.cancelled():
        task.exception()


@dataclass
class AnswerStream:
    """The SSE lines of one turn's streamed answer."""

    turn: Turn
    fmt: AnswerFormat
    model: str
    include_usage: bool
    parser: ToolCallParser | None
    """The tool-call parser when the request has tools, else None."""
    logprobs: Callable[..., BaseModel | None]
    """The endpoint's log-probs of the turn's tokens from an index on, to an index when given (else to the
    end); None unless asked for."""
    acknowledge: Callable[[], Awaitable[None]]
    """Returns once the turn's record is durable; raises the 503 when it cannot be made so."""
    interruptible: Callable[[], AbstractContextManager[None]]
    """A section the shutdown's cut or the request's deadline may interrupt (:meth:`InFlight.interruptible
    <serving.turn.InFlight.interruptible>`)."""

    async def events(self, pieces: AsyncIterator[str]) -> AsyncIterator[str]:
        """The stream's SSE lines, ending with an error event when it fails, the shutdown cuts it or its
        deadline passes.

        The turn runs in its :class:`TurnDriver` (started here, at the stream's first line), where the
        interruptions reach it; the lines follow it, each sent as the client reads. The streaming response
        itself stops the stream when its client disconnects, which cancels the driver. After ``[DONE]``
        nothing is awaited: an interruption then would follow a complete answer."""
        driver = TurnDriver(self.turn, pieces, self.acknowledge, self.interruptible)
        try:
            async with aclosing(self._lines(driver)) as lines:
                async for line in lines:
                    yield line
        except Exception as exc:  # headers are sent: the error travels as an SSE event
            yield sse(stream_error(exc))
        finally:
            await driver.stop()

    def _chunk(self, choice: BaseModel, final: bool = False) -> str:
        turn = self.turn
        return sse(self.fmt.chunk(id=turn.interaction_id, created=turn.created, model=self.model,
                                  interaction_id=turn.interaction_id, choices=[choice],
                                  policy_version=max(turn.versions) if final else None,
                                  policy_versions=turn.policy_versions if final else None))

    async def _lines(self, driver: TurnDriver) -> AsyncIterator[str]:
        """The stream's SSE lines as ``driver`` advances the turn, to ``[DONE]``."""
        turn, fmt = self.turn, self.fmt
        sent_tokens, sent_text = 0, 0  # tokens whose log-probs went out; characters of turn.text that did

        def ready_piece(text_end: int, token_end: int) -> str | None:
            """The chunk of the text not yet sent, up to a piece that ended at ``text_end`` characters and
            ``token_end`` tokens (the driver may be further on), if any may go out (with tools, text that
            may be a tool call waits for the end of the answer)."""
            nonlocal sent_tokens, sent_text
            if self.parser is None:
                ready = text_end
            else:
                ready = self.parser.held_from(turn.text if text_end == len(turn.text) else turn.text[:text_end])
            if ready <= sent_text:
                return None
            logprobs = None if turn.top_logprobs is None else self.logprobs(sent_tokens, token_end)
            line = self._chunk(fmt.piece_choice(turn.text[sent_text:ready], logprobs))
            sent_tokens, sent_text = token_end, ready
            return line

        if fmt.opening_choice is not None:
            yield self._chunk(fmt.opening_choice())
        async with aclosing(driver.progress()) as progress:
            async for text_end, token_end in progress:  # at its end, the turn's record is durable
                if (line := ready_piece(text_end, token_end)) is not None:
                    yield line
        if turn.parsed is not None:
            rest = turn.content[sent_text:] if turn.content.startswith(turn.text[:sent_text]) else ""
            if rest:
                yield self._chunk(fmt.piece_choice(rest, self.logprobs(sent_tokens)))
                sent_tokens = len(turn.token_ids)
            for index, call in enumerate(turn.parsed.calls):
                yield self._chunk(fmt.tool_call_choice(index, call))
        yield self._chunk(fmt.final_choice(turn.answer_finish_reason, self.logprobs(sent_tokens)), final=True)
        if self.include_usage:
            yield sse(fmt.chunk(id=turn.interaction_id, created=turn.created, model=self.model, choices=[],
                                usage=turn.usage(), interaction_id=turn.interaction_id))
        yield DONE
