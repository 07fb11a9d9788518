"""A streamed answer's server-sent events, from the turn's first piece to ``[DONE]`` or an error event.

:class:`AnswerStream` turns the text pieces of one admitted turn (:meth:`OpenAIServing._pieces
<serving.openai_serving.OpenAIServing._pieces>`, already started: the engine took the request before any
header went out) into SSE lines: an opening chunk (chat), the text as it may go out (with tools, text that
may begin a tool call, and blank text before it, waits for the end of the answer), the tool calls, the final
chunk once the record is durable, the usage chunk when asked for, ``[DONE]``. Whatever stops it after the
headers went out (a failure, the shutdown's cut, the request's deadline) ends it with a ``data: {"error": ...}``
event instead.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractContextManager, aclosing
from dataclasses import dataclass

from pydantic import BaseModel

from serving.answers import AnswerFormat
from serving.protocol import APIError, generation_failed
from serving.tool_calls import ToolCallParser
from serving.turn import Turn

DONE = "data: [DONE]\n\n"
"""The stream's last line when it ends normally."""


@dataclass(frozen=True)
class Streamed:
    """A streaming answer: its id (for the X-Interaction-Id header) and its SSE lines."""

    interaction_id: str
    events: AsyncIterator[str]


def sse(payload: object) -> str:
    data = payload.model_dump_json() if hasattr(payload, "model_dump_json") else json.dumps(payload)
    return f"data: {data}\n\n"


def stream_error(exc: Exception) -> dict:
    """The OpenAI-style error body for a failure after a stream began."""
    return (exc if isinstance(exc, APIError) else generation_failed(exc)).body()


@dataclass
class AnswerStream:
    """The SSE lines of one turn's streamed answer."""

    turn: Turn
    fmt: AnswerFormat
    model: str
    include_usage: bool
    parser: ToolCallParser | None
    """The tool-call parser when the request has tools, else None."""
    logprobs: Callable[[int], BaseModel | None]
    """The endpoint's log-probs of the turn's tokens from an index on (None unless asked for)."""
    acknowledge: Callable[[], Awaitable[None]]
    """Returns once the turn's record is durable; raises the 503 when it cannot be made so."""
    interruptible: Callable[[], AbstractContextManager[None]]
    """A section the shutdown's cut or the request's deadline may interrupt (:meth:`InFlight.interruptible
    <serving.turn.InFlight.interruptible>`)."""

    async def events(self, pieces: AsyncIterator[str]) -> AsyncIterator[str]:
        """The stream's SSE lines, ending with an error event when it fails, the shutdown cuts it or its
        deadline passes.

        Each line is awaited inside :attr:`interruptible`, not the sending of it (an interruption there
        could not be answered); the streaming response itself stops the stream when its client
        disconnects. After ``[DONE]`` nothing is awaited: an interruption then would follow a complete
        answer."""
        lines = self._lines(pieces)
        try:
            async with aclosing(lines):
                while True:
                    with self.interruptible():
                        line = await anext(lines, None)
                    if line is None:
                        break
                    yield line
                    if line == DONE:
                        break
        except Exception as exc:  # headers are sent: the error travels as an SSE event
            yield sse(stream_error(exc))

    def _chunk(self, choice: BaseModel, final: bool = False) -> str:
        turn = self.turn
        return sse(self.fmt.chunk(id=turn.interaction_id, created=turn.created, model=self.model,
                                  interaction_id=turn.interaction_id, choices=[choice],
                                  policy_version=max(turn.versions) if final else None,
                                  policy_versions=turn.policy_versions if final else None))

    async def _lines(self, pieces: AsyncIterator[str]) -> AsyncIterator[str]:
        """The stream's SSE lines from ``pieces`` to ``[DONE]``."""
        turn, fmt = self.turn, self.fmt
        sent_tokens, sent_text = 0, 0  # tokens whose log-probs went out; characters of turn.text that did

        def ready_piece() -> str | None:
            """The chunk of the text not yet sent, if any may go out (with tools, text that may be a
            tool call waits for the end of the answer)."""
            nonlocal sent_tokens, sent_text
            ready = len(turn.text) if self.parser is None else self.parser.held_from(turn.text)
            if ready <= sent_text:
                return None
            line = self._chunk(fmt.piece_choice(turn.text[sent_text:ready], self.logprobs(sent_tokens)))
            sent_tokens, sent_text = len(turn.token_ids), ready
            return line

        if fmt.opening_choice is not None:
            yield self._chunk(fmt.opening_choice())
        async with aclosing(pieces):
            if (line := ready_piece()) is not None:  # the piece read before the stream began
                yield line
            async for _ in pieces:
                if (line := ready_piece()) is not None:
                    yield line
        if turn.parsed is not None:
            rest = turn.content[sent_text:] if turn.content.startswith(turn.text[:sent_text]) else ""
            if rest:
                yield self._chunk(fmt.piece_choice(rest, self.logprobs(sent_tokens)))
                sent_tokens = len(turn.token_ids)
            for index, call in enumerate(turn.parsed.calls):
                yield self._chunk(fmt.tool_call_choice(index, call))
        await self.acknowledge()
        yield self._chunk(fmt.final_choice(turn.answer_finish_reason, self.logprobs(sent_tokens)), final=True)
        if self.include_usage:
            yield sse(fmt.chunk(id=turn.interaction_id, created=turn.created, model=self.model, choices=[],
                                usage=turn.usage(), interaction_id=turn.interaction_id))
        yield DONE
