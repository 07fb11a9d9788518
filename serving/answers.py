"""Wire models of completion answers: whole answers and stream chunks of both endpoints, their
log-probs and tool calls, and the :class:`AnswerFormat` that tells the two endpoints apart.

Answers add ``interaction_id``, ``policy_version`` (the newest version that sampled a
token) and ``policy_versions`` (every version that sampled one, ascending) to OpenAI's shape.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, Field, model_serializer


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


def _unix_now() -> int:
    return int(time.time())


class _Traced(BaseModel):
    interaction_id: str
    policy_version: int
    policy_versions: list[int]


class Answer(_Traced):
    """A whole completion answer; a subclass fixes ``object`` and the type of ``choices`` (the fields
    keep this order on the wire)."""

    id: str
    object: str
    created: int = Field(default_factory=_unix_now)
    model: str
    choices: list
    usage: UsageInfo


class Chunk(BaseModel):
    """One streamed chunk; a subclass fixes ``object`` and the type of ``choices``."""

    id: str
    object: str
    created: int = Field(default_factory=_unix_now)
    model: str
    choices: list
    usage: UsageInfo | None = None
    interaction_id: str
    policy_version: int | None = None
    policy_versions: list[int] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    """The token's UTF-8 bytes (a byte-level token may hold part of a character)."""


class TokenLogprob(TopLogprob):
    """One sampled token with its behaviour log-probability and the most likely alternatives."""

    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None
    refusal: None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]
    """Offset of each token in the completion text (the first chunk's first token at 0)."""


def completion_logprobs(tokens: list[TokenLogprob], offset: int) -> CompletionLogprobs:
    """The completions endpoint's shape of ``tokens``; the first starts at ``offset`` in the text."""
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token.token)
    return CompletionLogprobs(tokens=[t.token for t in tokens], token_logprobs=[t.logprob for t in tokens],
                              top_logprobs=[_by_text(t.top_logprobs) for t in tokens],
                              text_offset=offsets)


def _by_text(alternatives: list) -> dict[str, float]:
    """The completions shape of a token's alternatives, text -> log-prob, most likely first. Byte-level
    tokens holding part of one character all read "\ufffd": the first (likeliest) of a text is kept (the
    last was: fewer than k entries, and a sampled token likeliest among those of its text shown with the
    log-prob of another)."""
    by_text: dict[str, float] = {}
    for alternative in alternatives:
        by_text.setdefault(alternative.token, alternative.logprob)
    return by_text


class FunctionCall(BaseModel):
    name: str
    arguments: str
    """JSON text of the arguments, as the model wrote them (re-serialised when it wrote an object)."""


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class _WithoutEmptyToolCalls(BaseModel):
    """``tool_calls`` appears on the wire only when there are some."""

    @model_serializer(mode="wrap")
    def _drop_empty_tool_calls(self, handler):
        data = handler(self)
        if data.get("tool_calls") is None:
            data.pop("tool_calls", None)
        return data


class ChatResponseMessage(_WithoutEmptyToolCalls):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    finish_reason: str
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(Answer):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class ToolCallDelta(BaseModel):
    index: int
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaMessage(_WithoutEmptyToolCalls):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(Chunk):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(Answer):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class CompletionChunk(Chunk):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


@dataclass(frozen=True)
class Reply:
    """What one choice of a whole answer says."""

    text: str
    finish_reason: str
    logprobs: BaseModel | None = None
    tool_calls: tuple[ToolCall, ...] = ()


def _chat_answer(reply: Reply) -> ChatChoice:
    calls = list(reply.tool_calls) or None
    content = None if calls and not reply.text else reply.text
    return ChatChoice(message=ChatResponseMessage(content=content, tool_calls=calls),
                      finish_reason=reply.finish_reason, logprobs=reply.logprobs)


@dataclass(frozen=True)
class AnswerFormat:
    """How one endpoint's answers look: its answer and chunk models and the choice each carries."""

    answer: type[Answer]
    chunk: type[Chunk]
    answer_choice: Callable[[Reply], BaseModel]
    """The choice of a whole answer."""
    piece_choice: Callable[[str, BaseModel | None], BaseModel]
    """The choice of a chunk carrying a piece of text (and the log-probs of its tokens)."""
    final_choice: Callable[[str | None, BaseModel | None], BaseModel]
    """The choice of the chunk carrying the finish reason (and the log-probs of tokens not sent yet)."""
    logprobs: Callable[[list[TokenLogprob], int], BaseModel]
    """The endpoint's log-probs of some tokens, the first at this offset in the text."""
    opening_choice: Callable[[], BaseModel] | None = None
    """The choice of a chunk sent before any text, if the endpoint sends one."""
    tool_call_choice: Callable[[int, ToolCall], BaseModel] | None = None
    """The choice of a chunk carrying one whole tool call (its index in the answer), if the endpoint has them."""


CHAT_FORMAT = AnswerFormat(
    ChatCompletionResponse, ChatCompletionChunk,
    answer_choice=_chat_answer,
    piece_choice=lambda piece, lp: ChatChunkChoice(delta=DeltaMessage(content=piece), logprobs=lp),
    final_choice=lambda finish, lp: ChatChunkChoice(delta=DeltaMessage(), finish_reason=finish, logprobs=lp),
    logprobs=lambda tokens, _offset: ChatLogprobs(content=tokens),
    opening_choice=lambda: ChatChunkChoice(delta=DeltaMessage(role="assistant", content="")),
    tool_call_choice=lambda index, call: ChatChunkChoice(delta=DeltaMessage(tool_calls=[ToolCallDelta(
        index=index, id=call.id, function=call.function)])))
COMPLETION_FORMAT = AnswerFormat(
    CompletionResponse, CompletionChunk,
    answer_choice=lambda reply: CompletionChoice(text=reply.text, finish_reason=reply.finish_reason,
                                                 logprobs=reply.logprobs),
    piece_choice=lambda piece, lp: CompletionChoice(text=piece, finish_reason=None, logprobs=lp),
    final_choice=lambda finish, lp: CompletionChoice(text="", finish_reason=finish, logprobs=lp),
    logprobs=completion_logprobs)
