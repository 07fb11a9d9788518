"""Refusals that need no tokenizer: what a request asks for that this service does not do.

Every refusal is a 400 naming the field. The service samples freely from the policy
and logs the exact distribution each token was drawn from, because the learner's
importance ratios need it: anything that would change that distribution without the
learner knowing (penalties, logit bias, structured output, forced tool calls, and
vLLM's extensions such as top_k, min_p or guided decoding) is refused rather than
silently ignored, and greedy decoding is refused because it has no distribution to
learn from. So is a vLLM extension that would change where sampling stops, the
prompt, or the answer's text: the client would get something else than it asked
for without being told. Their neutral values (top_k -1, min_p 0, ...) are accepted.

A chat request is also refused (400 naming the message's field) where its tool messages do not answer
its assistant messages' calls, as OpenAI refuses it: such a conversation was rendered and logged as
one the model never had.
"""

from __future__ import annotations

from online_sao.schemas import MIN_TEMPERATURE
from serving.errors import APIError
from serving.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, SamplingRequest

MAX_STOP_STRINGS = 16
"""Stop strings per request: each costs a scan of the held-back text per token."""

_CHANGES_DISTRIBUTION = ("changes the sampling distribution, which the learner would have to know; this "
                         "service samples from the policy as it is")


def _refuse(field: str, why: str) -> APIError:
    """400 ``unsupported_parameter``: a field this service does not honour, with the reason."""
    return APIError(400, f"{field} is not supported: {why}", param=field, code="unsupported_parameter")


_CONSTRAINS = f"structured output would constrain sampling, which {_CHANGES_DISTRIBUTION}"
_STOPS = "an answer ends where the policy samples a stop token or stop string, or at max_tokens"
_NO_LOGITS_PROCESSORS = f"a logits processor {_CHANGES_DISTRIBUTION}"

_SAMPLING_EXTENSIONS: tuple[tuple[str, tuple, str], ...] = (
    # (field, its neutral values, why another is refused): vLLM's extensions of both endpoints
    ("top_k", (None, 0, -1), f"keeping only the k likeliest tokens {_CHANGES_DISTRIBUTION} (send 0 or -1, "
                             "vLLM's 'every token', or leave it out)"),
    ("min_p", (None, 0), f"dropping the tokens below a share of the likeliest {_CHANGES_DISTRIBUTION} "
                         "(send 0 or leave it out)"),
    ("repetition_penalty", (None, 1), f"a penalty {_CHANGES_DISTRIBUTION} (send 1 or leave it out)"),
    ("use_beam_search", (None, False), "beam search picks tokens by a search, not by sampling from the policy as "
                                       "online learning needs (send false or leave it out)"),
    ("watermarking", (None, False), f"a watermark biases the tokens sampled, which {_CHANGES_DISTRIBUTION}"),
    ("bad_words", (None, []), f"banning words {_CHANGES_DISTRIBUTION} (send [] or leave it out)"),
    ("allowed_token_ids", (None, []), f"restricting the tokens {_CHANGES_DISTRIBUTION} (send [] or leave it out)"),
    ("logits_processors", (None, []), f"{_NO_LOGITS_PROCESSORS} (send [] or leave it out)"),
    ("vllm_xargs", (None, {}), f"these are arguments of custom logits processors; this service runs none, and "
                               f"{_NO_LOGITS_PROCESSORS} (send {{}} or leave it out)"),
    ("min_tokens", (None, 0), f"holding back the stop tokens until then {_CHANGES_DISTRIBUTION} (send 0 or leave "
                              "it out)"),
    ("thinking_token_budget", (None, -1), "ending the reasoning at a budget writes tokens the policy did not "
                                          "sample (send -1 or leave it out)"),
    ("guided_json", (None,), _CONSTRAINS),
    ("guided_regex", (None,), _CONSTRAINS),
    ("guided_choice", (None, []), _CONSTRAINS),
    ("guided_grammar", (None,), _CONSTRAINS),
    ("structured_outputs", (None, {}), _CONSTRAINS),
    ("structural_tag", (None,), _CONSTRAINS),
    ("ignore_eos", (None, False), f"{_STOPS}; sampling on past the end-of-sequence token is not served (send false "
                                  "or leave it out)"),
    ("stop_token_ids", (None, []), f"{_STOPS}; other stop tokens are not served (send stop strings, or [])"),
    ("truncate_prompt_tokens", (None, -1), "the prompt is never truncated: one over the context is refused (send -1 "
                                           "or leave it out)"),
    ("include_stop_str_in_output", (None, False), "the answer leaves out the stop string that ended it (send false "
                                                  "or leave it out)"),
    ("skip_special_tokens", (None, True), "the answer's text leaves out special tokens (send true or leave it out)"),
    ("prompt_logprobs", (None,), "answers carry the log-probs of the sampled tokens only"),
    ("logprob_token_ids", (None, []), "the log-probs listed are the sampled token's and its likeliest alternatives "
                                      "(top_logprobs in chat, logprobs in completions)"),
    ("return_tokens_as_token_ids", (None, False), "log-probs name their tokens as text"),
    ("return_token_ids", (None, False), "answers carry no token ids"),
    ("return_token_offsets", (None, False), "answers carry no token offsets"),
)
"""vLLM's extensions (sent with the client's ``extra_body``) that :func:`check_sampling` refuses unless
neutral. Each would change the sampling distribution, where sampling stops, the prompt or the answer's
text; this service does none of that, and answering as if the field had not been sent would give the
client something else than it asked for without telling it. The vLLM fields accepted and ignored, and
why, are listed in :class:`serving.protocol.SamplingRequest`."""

_TEMPLATE = "prompts are rendered with the model's own chat template, as it is"
_CHAT_EXTENSIONS: tuple[tuple[str, tuple, str], ...] = (
    ("echo", (None, False), "the answer is the new message only (send false or leave it out)"),
    ("add_generation_prompt", (None, True), "the prompt always ends with the template's generation prompt: the "
                                            "answer is a new assistant message (send true or leave it out)"),
    ("continue_final_message", (None, False), "the answer is a new assistant message; continuing the last one is "
                                              "not served (send false or leave it out)"),
    ("add_special_tokens", (None, False), "the chat template writes the special tokens; more would change the "
                                          "prompt (send false or leave it out)"),
    ("chat_template", (None, ""), _TEMPLATE),
    ("chat_template_kwargs", (None, {}), f"{_TEMPLATE}, without other arguments"),
    ("documents", (None, []), "documents are not rendered into the prompt (send them in a message)"),
    ("return_prompt_text", (None, False), "answers carry no prompt text"),
)
"""The chat endpoint's vLLM extensions refused unless neutral, as :data:`_SAMPLING_EXTENSIONS`."""

_COMPLETION_EXTENSIONS: tuple[tuple[str, tuple, str], ...] = (
    ("add_special_tokens", (None, True), "a text prompt gets the special tokens the tokenizer puts before a text "
                                         "(send token ids to choose them yourself)"),
    ("prompt_embeds", (None,), "prompts are text or token ids"),
)
"""The completions endpoint's vLLM extensions refused unless neutral, as :data:`_SAMPLING_EXTENSIONS`."""


def _check_extensions(request: SamplingRequest, extensions: tuple[tuple[str, tuple, str], ...]) -> None:
    for field, neutral, why in extensions:
        if getattr(request, field) not in neutral:
            raise _refuse(field, why)


def check_sampling(request: SamplingRequest) -> None:
    """n, best_of, temperature, stream options, stop strings, penalties, logit bias, response format and
    vLLM's extensions of both endpoints."""
    if request.n not in (None, 1):
        raise _refuse("n", f"n={request.n} asks for several completions; each request samples one, logged as "
                           "one interaction with its own id (send several requests)")
    if request.best_of not in (None, 1):
        raise _refuse("best_of", "each request samples one completion, logged as one interaction (send several "
                                 "requests and keep the best)")
    if request.temperature == 0:
        raise _refuse("temperature", "temperature 0 (greedy decoding) leaves no sampling distribution, which "
                                     "online learning needs; use a small positive temperature")
    if request.stream_options is not None and not request.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
    if request.stream_options is not None and request.stream_options.continuous_usage_stats:
        raise _refuse("stream_options.continuous_usage_stats", "usage comes once, with the final chunk, when "
                                                               "include_usage is true (send false or leave it out)")
    if request.temperature is not None and request.temperature < MIN_TEMPERATURE:
        raise APIError(400, f"temperature {request.temperature:g} is below the smallest supported, "
                            f"{MIN_TEMPERATURE:g}", param="temperature")
    if len(request.stop_list()) > MAX_STOP_STRINGS:
        raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings are supported", param="stop")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(request, name) not in (None, 0):
            raise _refuse(name, f"a non-zero penalty {_CHANGES_DISTRIBUTION} (send 0 or leave it out)")
    if request.logit_bias:
        raise _refuse("logit_bias", f"a bias {_CHANGES_DISTRIBUTION} (send {{}} or leave it out)")
    if request.response_format is not None and request.response_format.type != "text":
        raise _refuse("response_format", f"{request.response_format.type!r} would constrain sampling, which "
                                         f"{_CHANGES_DISTRIBUTION}; only 'text' is served")
    _check_extensions(request, _SAMPLING_EXTENSIONS)
    if request.repetition_detection and any(request.repetition_detection.values()):
        raise _refuse("repetition_detection", f"{_STOPS}; stopping at a repeated pattern is not served (send "
                                              "zeros, {}, or leave it out)")


def check_chat(request: ChatCompletionRequest, tool_call_parser: str) -> None:
    """The chat-only fields: log-probs, tools, the calls and results in messages, output modalities and vLLM's
    chat extensions."""
    if request.top_logprobs is not None and not request.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    if request.tools and tool_call_parser == "none":
        raise _refuse("tools", "this server reads no tool calls (serving.tool_call_parser is 'none')")
    if request.tool_choice is not None and request.tool_choice not in ("auto", "none"):
        raise _refuse("tool_choice", "forcing a tool call would constrain sampling, which "
                                     f"{_CHANGES_DISTRIBUTION}; send 'auto' or 'none'")
    _check_tools(request)
    _check_tool_conversation(request.messages)
    if request.functions:
        raise _refuse("functions", "send the functions as tools")
    if request.function_call is not None and request.function_call not in ("auto", "none"):
        raise _refuse("function_call", "send tools (a forced call would constrain sampling)")
    if request.modalities is not None and set(request.modalities) != {"text"}:
        raise _refuse("modalities", "this service answers with text only")
    if request.audio is not None:
        raise _refuse("audio", "this service answers with text only")
    if request.web_search_options is not None:
        raise _refuse("web_search_options", "the model has no web search")
    _check_extensions(request, _CHAT_EXTENSIONS)


def _check_tools(request: ChatCompletionRequest) -> None:
    """``tools`` lists at least one tool, none strict, and ``tool_choice`` comes with them (OpenAI answers 400
    to both; accepted, a ``tool_choice`` without tools chose among nothing)."""
    if request.tool_choice is not None and not request.tools:
        raise APIError(400, "tool_choice is only allowed when tools are specified", param="tool_choice")
    if request.tools is not None and not request.tools:
        raise APIError(400, "tools must list at least one tool (leave it out to offer none)", param="tools")
    for i, tool in enumerate(request.tools or []):
        if tool.function.strict:
            raise _refuse(f"tools[{i}].function.strict", "strict adherence to the parameters' schema would "
                                                         f"constrain sampling, which {_CHANGES_DISTRIBUTION} "
                                                         "(send false or leave it out)")


def _check_tool_conversation(messages: list[ChatMessage]) -> None:
    """Tool results answer calls, as OpenAI checks a conversation: only an assistant message calls tools, each
    call with an id; the tool messages right after it answer each of its calls once, before any other message.
    A result that answers no call was rendered into the prompt and logged in the trajectory the learner trains
    on as if the model had called for it."""
    caller: int | None = None  # the assistant message whose calls the tool messages that follow answer
    unanswered: set[str] = set()  # the ids of its calls no tool message has answered yet
    for i, message in enumerate(messages):
        if message.tool_calls and message.role != "assistant":
            raise APIError(400, f"messages[{i}] is a {message.role} message with tool_calls; only an assistant "
                                "message calls tools", param=f"messages[{i}].tool_calls")
        if message.role == "tool":
            _check_tool_result(messages, i, caller, unanswered)
            unanswered.discard(message.tool_call_id)
            continue
        if unanswered:
            raise _unanswered(caller, unanswered)
        caller, unanswered = (i, _call_ids(message, i)) if message.tool_calls else (None, set())
    if unanswered:
        raise _unanswered(caller, unanswered)


def _call_ids(message: ChatMessage, index: int) -> set[str]:
    """The ids of an assistant message's calls; each needs one, which the tool message answering it names."""
    if any(call.id is None for call in message.tool_calls):
        raise APIError(400, f"a tool call of messages[{index}] has no id: the tool message answering it names "
                            "the call by its id", param=f"messages[{index}].tool_calls")
    return {call.id for call in message.tool_calls}


def _check_tool_result(messages: list[ChatMessage], index: int, caller: int | None, unanswered: set[str]) -> None:
    """The tool message ``messages[index]`` answers a call of ``messages[caller]`` not answered yet."""
    message = messages[index]
    if message.tool_call_id is None:
        raise APIError(400, f"the tool message messages[{index}] has no tool_call_id: it must name the call it "
                            "answers", param=f"messages[{index}].tool_call_id")
    if caller is None:
        raise APIError(400, f"the tool message messages[{index}] answers no call: tool messages must follow an "
                            "assistant message with tool_calls", param=f"messages[{index}]")
    if message.tool_call_id not in unanswered:
        known = sorted(call.id for call in messages[caller].tool_calls)
        raise APIError(400, f"the tool message messages[{index}] answers tool_call_id {message.tool_call_id!r}, "
                            f"which is no call of messages[{caller}] waiting for its result (its calls: "
                            f"{', '.join(known)}; each is answered once)", param=f"messages[{index}].tool_call_id")


def _unanswered(caller: int, unanswered: set[str]) -> APIError:
    return APIError(400, f"the tool calls of messages[{caller}] ({', '.join(sorted(unanswered))}) have no result: "
                         "an assistant message with tool_calls must be followed by a tool message answering each "
                         "call's id, before any other message", param=f"messages[{caller}].tool_calls")


def check_completion(request: CompletionRequest) -> None:
    """The completions-only fields."""
    if request.echo:
        raise _refuse("echo", "the answer is the completion only")
    if request.suffix:
        raise _refuse("suffix", "there is no fill-in-the-middle")
    _check_extensions(request, _COMPLETION_EXTENSIONS)
