"""Wire models of the OpenAI-compatible API, the feedback API and OpenAI-style errors.

Requests accept (and ignore) OpenAI fields that do not change sampling here
(``presence_penalty``, ``logit_bias``, ...), so the official client works
unchanged. Two extensions arrive through the client's ``extra_body``:
``parent_interaction_id`` (continue an earlier interaction as one trajectory)
and ``session_id``. Responses add ``interaction_id``, ``policy_version`` (the
newest version that sampled a token) and ``policy_versions`` (every version that
sampled one, ascending).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from online_sao.schemas import FiniteFloat


class APIError(Exception):
    """An error answered with an OpenAI-style body ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code)).model_dump()


LOGGING_RETRY_AFTER_S = 5
"""Seconds a client is told to wait (Retry-After) when its record cannot be logged now."""


def logging_unavailable(message: str) -> APIError:
    """503 ``logging_unavailable``: the interaction log cannot take or secure a record now."""
    return APIError(503, message, type="service_unavailable", code="logging_unavailable",
                    headers={"Retry-After": str(LOGGING_RETRY_AFTER_S)})


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ----------------------------------------------------------------------------- requests

class _Request(BaseModel):
    # extra="ignore": the official client may send fields we do not act on. strict: JSON types as
    # documented (no true for 1, no "yes" for true), found by fuzzing the OpenAPI schema.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)


class StreamOptions(_Request):
    include_usage: bool = False


class TextPart(_Request):
    type: Literal["text"] = "text"
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        """The message content as one string (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def as_template_message(self) -> dict[str, str]:
        """The dict a tokenizer chat template renders."""
        message = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class SamplingRequest(_Request):
    model: str
    temperature: float | None = Field(None, ge=0, le=10)
    """0 (greedy) is refused by the serving layer: learning needs a sampling distribution."""
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)
    parent_interaction_id: str | None = Field(None, max_length=256)
    """Extension (``extra_body``): continue this earlier interaction as one trajectory."""
    session_id: str | None = Field(None, max_length=256)
    """Extension (``extra_body``): recorded on the interaction."""

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return [s for s in stops if s]


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    """Newer name of ``max_tokens``; either may be sent."""

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int]
    """One prompt: text, a one-element list of text, or token ids."""
    max_tokens: int | None = Field(16, ge=1)
    """OpenAI's default for the completions endpoint is 16."""

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


class TurnRewardIn(_Request):
    turn: int = Field(ge=0)
    """Index of the assistant turn in the trajectory (0 = first)."""
    value: FiniteFloat


class FeedbackRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)
    interaction_id: str = Field(min_length=1, max_length=256)
    reward: FiniteFloat
    source: str = Field("user", min_length=1, max_length=128)
    turn_rewards: list[TurnRewardIn] = []


# ----------------------------------------------------------------------------- responses

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


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    finish_reason: str
    logprobs: None = None


class ChatCompletionResponse(Answer):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(Chunk):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None
    logprobs: None = None


class CompletionResponse(Answer):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class CompletionChunk(Chunk):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


@dataclass(frozen=True)
class AnswerFormat:
    """How one endpoint's answers look: its answer and chunk models and the choice each carries."""

    answer: type[Answer]
    chunk: type[Chunk]
    answer_choice: Callable[[str, str], BaseModel]
    """The choice of a whole answer: (text, finish reason)."""
    piece_choice: Callable[[str], BaseModel]
    """The choice of a chunk carrying a piece of text."""
    final_choice: Callable[[str | None], BaseModel]
    """The choice of the chunk carrying the finish reason."""
    opening_choice: Callable[[], BaseModel] | None = None
    """The choice of a chunk sent before any text, if the endpoint sends one."""


CHAT_FORMAT = AnswerFormat(
    ChatCompletionResponse, ChatCompletionChunk,
    answer_choice=lambda text, finish: ChatChoice(message=ChatResponseMessage(content=text), finish_reason=finish),
    piece_choice=lambda piece: ChatChunkChoice(delta=DeltaMessage(content=piece)),
    final_choice=lambda finish: ChatChunkChoice(delta=DeltaMessage(), finish_reason=finish),
    opening_choice=lambda: ChatChunkChoice(delta=DeltaMessage(role="assistant", content="")))
COMPLETION_FORMAT = AnswerFormat(
    CompletionResponse, CompletionChunk,
    answer_choice=lambda text, finish: CompletionChoice(text=text, finish_reason=finish),
    piece_choice=lambda piece: CompletionChoice(text=piece, finish_reason=None),
    final_choice=lambda finish: CompletionChoice(text="", finish_reason=finish))


class FeedbackResponse(BaseModel):
    object: Literal["feedback"] = "feedback"
    interaction_id: str
    status: Literal["accepted"] = "accepted"


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "online-sao"
    policy_version: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
