"""Wire models of the OpenAI-compatible API (the feedback API and the model list: :mod:`serving.service_models`;
errors: :mod:`serving.errors`).

Requests accept (and ignore) OpenAI fields that change nothing here
(``store``, ``service_tier``, ...), so the official client works unchanged; fields
that would change sampling in a way this service does not implement
(penalties, ``logit_bias``, structured output) are declared so that the
serving layer can refuse a non-default value by name. So are the extensions
vLLM-compatible servers take through the client's ``extra_body`` (``top_k``,
``min_p``, ``repetition_penalty``, ``guided_json``, ``structured_outputs``, ...):
undeclared, they were silently dropped and the client got another distribution
than it asked for. Two extensions of this service arrive the same way:
``parent_interaction_id`` (continue an earlier interaction as one trajectory) and
``session_id``. Completion answers are in :mod:`serving.answers`.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from online_sao.json_depth import MAX_JSON_DEPTH, too_deep
from online_sao.schemas import has_lone_surrogate
from serving.errors import APIError


SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 64 - 1
"""Seeds a torch generator takes (``manual_seed``): any 64-bit integer, signed or not."""


# ----------------------------------------------------------------------------- requests

class _Request(BaseModel):
    # extra="ignore": the official client may send fields we do not act on. Any field whose value could
    # change what is sampled, where it stops, the prompt or the answer's text is declared instead, so that
    # serving.request_checks refuses it by name (see SamplingRequest). strict: JSON types as
    # documented (no true for 1, no "yes" for true), found by fuzzing the OpenAPI schema.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool | None = False
    """vLLM's extension (usage on every chunk): null or false, usage comes with the final chunk only."""


class TextPart(_Request):
    type: Literal["text"] = "text"
    text: str


_NOT_JSON = object()
"""What :func:`decoded_arguments` answers for arguments that are not JSON text."""


def decoded_arguments(arguments: str) -> object:
    """The value a history tool call's ``arguments`` text spells, or :data:`_NOT_JSON` when it is not JSON
    (such text is rendered and compared as sent). Refused (400) when it nests deeper than the JSON parser
    goes (RecursionError, no ValueError: it was a 500) or decodes to a lone UTF-16 surrogate: an escape
    escaped twice (``"\\\\ud83d"``) passes the body's check and the tokenizer then failed on the rendered
    text (500). This server never returns such arguments (:func:`serving.tool_calls.arguments_json`)."""
    if too_deep(arguments):  # measured, not parsed: the parser recurses to the interpreter's limit first
        raise APIError(400, f"the arguments of a tool call in messages nest deeper than {MAX_JSON_DEPTH} levels",
                       param="messages")
    try:
        value = json.loads(arguments)
    except ValueError:
        return _NOT_JSON
    except RecursionError:
        raise APIError(400, "the arguments of a tool call in messages nest deeper than the JSON parser allows",
                       param="messages") from None
    if has_lone_surrogate(value):
        raise APIError(400, "the arguments of a tool call in messages hold a lone UTF-16 surrogate escape "
                            "(\\ud800-\\udfff), which is not text", param="messages")
    return value


class FunctionCallIn(_Request):
    name: str
    arguments: str
    """JSON text of the arguments."""


class ToolCallIn(_Request):
    """A tool call of an earlier assistant message, as the client sends it back."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn

    def template_call(self) -> dict:
        """The call as chat templates render it (Hugging Face's convention: arguments as an object when
        they are JSON of one)."""
        arguments = decoded_arguments(self.function.arguments)
        if arguments is _NOT_JSON:
            arguments = self.function.arguments
        call = {"type": "function", "function": {"name": self.function.name, "arguments": arguments}}
        return call if self.id is None else {"id": self.id, **call}


class FunctionSpec(_Request):
    model_config = ConfigDict(extra="allow", strict=True)  # a tool's schema is the client's to define
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None
    """Null or false: strict schema adherence would constrain sampling (``serving.request_checks``)."""


class ToolSpec(_Request):
    type: Literal["function"] = "function"
    function: FunctionSpec

    def template_tool(self) -> dict:
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: dict


class ResponseFormat(_Request):
    type: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    """An assistant message's tool calls, as this server returned them."""

    @model_validator(mode="after")
    def _content_unless_assistant(self) -> "ChatMessage":
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content (only an assistant message may leave it null)")
        return self

    def text(self) -> str:
        """The message content as one string: text parts joined with a newline, as vLLM joins them (joined
        with nothing, "Summarise the text below." and "The cat sat" rendered as "below.The cat")."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)

    def as_template_message(self) -> dict[str, str]:
        """The dict a tokenizer chat template renders."""
        message = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [call.template_call() for call in self.tool_calls]
        return message

    def key(self) -> tuple:
        """What identifies the message as a client sends it back: role, text and tool calls (name and
        arguments, JSON normalised; call ids are not compared)."""
        return message_key(self.role, self.text(), [(c.function.name, c.function.arguments)
                                                    for c in self.tool_calls or []])


def message_key(role: str, text: str, calls: list[tuple[str, str]]) -> tuple:
    """See :meth:`ChatMessage.key`."""
    def normal(arguments: str) -> str:
        value = decoded_arguments(arguments)
        return arguments if value is _NOT_JSON else json.dumps(value, sort_keys=True)

    return role, text, tuple((name, normal(arguments)) for name, arguments in calls)


class SamplingRequest(_Request):
    model: str
    temperature: float | None = Field(None, ge=0, le=10)
    """0 (greedy) is refused by the serving layer: learning needs a sampling distribution."""
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    n: int | None = None
    """Only 1 (null and absent mean 1, as in OpenAI's API)."""
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = Field(
        None, max_length=16)
    """OpenAI's string map (at most 16 pairs); ``serving.segment_field`` may name the key that
    holds the request's segment; otherwise unused."""
    parent_interaction_id: str | None = Field(None, max_length=256)
    """Extension (``extra_body``): continue this earlier interaction as one trajectory."""
    session_id: str | None = Field(None, max_length=256)
    """Extension (``extra_body``): recorded on the interaction."""
    presence_penalty: float | None = None
    """Refused unless 0: a penalty changes the sampling distribution, which the learner must know."""
    frequency_penalty: float | None = None
    """Refused unless 0, like ``presence_penalty``."""
    logit_bias: dict[str, float] | None = None
    """Refused unless empty, like ``presence_penalty``."""
    response_format: ResponseFormat | None = None
    """Only ``text``: structured output would constrain sampling (vLLM's completions take it too)."""
    best_of: int | None = None
    """Only 1, like ``n`` (OpenAI's completions field; vLLM's chat takes it too)."""

    # vLLM's extensions (the official client sends them with ``extra_body``), declared so that
    # serving.request_checks can refuse any value but the neutral one (given after each) by name: each
    # would change the sampling distribution, where sampling stops, the prompt or the answer's text, and
    # left undeclared it was dropped without a word. Left undeclared, and so accepted and ignored, are
    # those that change none of these here: length_penalty (beam search only, as in vLLM; use_beam_search
    # is refused), spaces_between_special_tokens (spaces special tokens the text keeps: it keeps none,
    # skip_special_tokens false is refused), truncation_side, guided_decoding_backend and
    # guided_whitespace_pattern (modifiers of a refused field), include_reasoning (no reasoning parser
    # here: the content is the whole answer, as in vLLM without one), the media options (mm_processor_kwargs,
    # media_io_kwargs, mm_payload, return_mm_kwargs: messages are text), and how the server runs rather
    # than what it answers (priority, request_id, cache_salt, kv_transfer_params, ec_transfer_params,
    # stream_interval, routed_experts_prompt_start).
    top_k: int | None = None
    """Null, 0 or -1 (vLLM's "every token")."""
    min_p: float | None = None
    """Null or 0."""
    repetition_penalty: float | None = None
    """Null or 1."""
    use_beam_search: bool | None = None
    """Null or false."""
    watermarking: bool | None = None
    """Null or false."""
    bad_words: list[str] | None = None
    """Null or empty."""
    allowed_token_ids: list[int] | None = None
    """Null or empty."""
    logits_processors: list[str | dict] | None = None
    """Null or empty (older vLLM's per-request logits processors)."""
    vllm_xargs: dict | None = None
    """Null or empty (arguments of vLLM's custom logits processors)."""
    min_tokens: int | None = None
    """Null or 0."""
    thinking_token_budget: int | None = None
    """Null or -1 (vLLM's "unlimited")."""
    guided_json: str | dict | None = None
    """Null (older vLLM's structured output, like the three below)."""
    guided_regex: str | None = None
    """Null."""
    guided_choice: list[str] | None = None
    """Null or empty."""
    guided_grammar: str | None = None
    """Null."""
    structured_outputs: dict | None = None
    """Null or empty (vLLM's structured output)."""
    structural_tag: str | dict | None = None
    """Null (vLLM's structured output between trigger tags)."""
    ignore_eos: bool | None = None
    """Null or false."""
    stop_token_ids: list[int] | None = None
    """Null or empty."""
    repetition_detection: dict[str, int] | None = None
    """Null, or every size and count 0 (vLLM's "off")."""
    truncate_prompt_tokens: int | None = None
    """Null or -1 (vLLM's "to the context", where a prompt over it is refused here)."""
    include_stop_str_in_output: bool | None = None
    """Null or false."""
    skip_special_tokens: bool | None = None
    """Null or true."""
    prompt_logprobs: int | None = None
    """Null."""
    logprob_token_ids: list[int] | None = None
    """Null or empty."""
    return_tokens_as_token_ids: bool | None = None
    """Null or false."""
    return_token_ids: bool | None = None
    """Null or false."""
    return_token_offsets: bool | None = None
    """Null or false."""

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
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    """Needs ``logprobs``; how many alternatives each token lists."""
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """``auto`` (the default with tools) and ``none``, only with ``tools``; a forced call is refused (sampling
    is not constrained)."""
    parallel_tool_calls: bool | None = None
    """Accepted; the model may write several calls in one answer either way."""
    modalities: list[str] | None = None
    """Only ``["text"]``."""
    audio: dict | None = None
    """Refused: no audio output."""
    functions: list[dict] | None = None
    """Refused (OpenAI's older tool calling): send ``tools``."""
    function_call: str | dict | None = None
    """Refused unless ``none`` or ``auto``, like ``functions``."""
    web_search_options: dict | None = None
    """Refused: the model has no web search."""
    # vLLM's chat extensions, refused but for the neutral value given (see SamplingRequest).
    echo: bool | None = None
    """Null or false (vLLM: the answer begins with the last message when it is the assistant's)."""
    add_generation_prompt: bool | None = None
    """Null or true."""
    continue_final_message: bool | None = None
    """Null or false."""
    add_special_tokens: bool | None = None
    """Null or false (the chat template writes the special tokens)."""
    chat_template: str | None = None
    """Null or empty."""
    chat_template_kwargs: dict | None = None
    """Null or empty."""
    documents: list[dict] | None = None
    """Null or empty."""
    return_prompt_text: bool | None = None
    """Null or false."""

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def default_max_tokens(self) -> int | None:
        """None: an answer may use the room left (OpenAI's chat default)."""
        return None

    def max_tokens_field(self) -> str:
        """The name under which the client sent its token limit (for errors about it)."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def requested_top_logprobs(self) -> int | None:
        """Alternatives per token when log-probs are asked for, else None."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def listed_tools(self) -> list[dict] | None:
        """The request's tools as the chat template renders them; None when it sends none."""
        return [tool.template_tool() for tool in self.tools] if self.tools else None

    def active_tools(self) -> list[dict] | None:
        """The tools whose calls are parsed from the answer (and that a new conversation's template
        renders): none when absent or ``tool_choice`` is ``none``. A continuation with ``none`` still
        renders its trajectory's tools (``serving.prompts``)."""
        return None if self.tool_choice == "none" else self.listed_tools()


COMPLETIONS_MAX_TOKENS = 16
"""OpenAI's default ``max_tokens`` of the completions endpoint (the chat endpoint's is the room left)."""


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int]
    """One prompt: text, a one-element list of text, or token ids."""
    max_tokens: int | None = Field(None, ge=1)
    """Absent or null: :data:`COMPLETIONS_MAX_TOKENS`, or the server's limit where lower (only a value sent
    is checked against the limits: the default was refused where ``serving.max_new_tokens`` is below it)."""
    logprobs: int | None = Field(None, ge=0, le=5)
    """Log-probs of the sampled tokens and this many alternatives each."""
    echo: bool | None = None
    """Refused when true: the answer is the completion only."""
    suffix: str | None = None
    """Refused unless empty: no fill-in-the-middle."""
    # vLLM's completions extensions, refused but for the neutral value given (see SamplingRequest).
    add_special_tokens: bool | None = None
    """Null or true (a text prompt gets the tokenizer's leading special tokens)."""
    prompt_embeds: str | list[str] | None = None
    """Null: prompts are text or token ids."""

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def default_max_tokens(self) -> int | None:
        return COMPLETIONS_MAX_TOKENS

    def max_tokens_field(self) -> str:
        return "max_tokens"

    def requested_top_logprobs(self) -> int | None:
        return self.logprobs

