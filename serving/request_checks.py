"""Refusals that need no tokenizer: what a request asks for that this service does not do.

Every refusal is a 400 naming the field. The service samples freely from the policy
and logs the exact distribution each token was drawn from, because the learner's
importance ratios need it: anything that would change that distribution without the
learner knowing (penalties, logit bias, structured output, forced tool calls) is
refused rather than silently ignored, and greedy decoding is refused because it has
no distribution to learn from.
"""

from __future__ import annotations

from online_sao.schemas import MIN_TEMPERATURE
from serving.protocol import APIError, ChatCompletionRequest, CompletionRequest, SamplingRequest

MAX_STOP_STRINGS = 16
"""Stop strings per request: each costs a scan of the held-back text per token."""

_CHANGES_DISTRIBUTION = ("changes the sampling distribution, which the learner would have to know; this "
                         "service samples from the policy as it is")


def _refuse(field: str, why: str) -> APIError:
    """400 ``unsupported_parameter``: a field this service does not honour, with the reason."""
    return APIError(400, f"{field} is not supported: {why}", param=field, code="unsupported_parameter")


def check_sampling(request: SamplingRequest) -> None:
    """n, temperature, stream options, stop strings, penalties and logit bias."""
    if request.n not in (None, 1):
        raise _refuse("n", f"n={request.n} asks for several completions; each request samples one, logged as "
                           "one interaction with its own id (send several requests)")
    if request.temperature == 0:
        raise _refuse("temperature", "temperature 0 (greedy decoding) leaves no sampling distribution, which "
                                     "online learning needs; use a small positive temperature")
    if request.stream_options is not None and not request.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
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


def check_chat(request: ChatCompletionRequest, tool_call_parser: str) -> None:
    """The chat-only fields: log-probs, structured output, tools."""
    if request.top_logprobs is not None and not request.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    if request.response_format is not None and request.response_format.type != "text":
        raise _refuse("response_format", f"{request.response_format.type!r} would constrain sampling, which "
                                         f"{_CHANGES_DISTRIBUTION}; only 'text' is served")
    if request.tools and tool_call_parser == "none":
        raise _refuse("tools", "this server reads no tool calls (serving.tool_call_parser is 'none')")
    if request.tool_choice is not None and request.tool_choice not in ("auto", "none"):
        raise _refuse("tool_choice", "forcing a tool call would constrain sampling, which "
                                     f"{_CHANGES_DISTRIBUTION}; send 'auto' or 'none'")
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


def check_completion(request: CompletionRequest) -> None:
    """The completions-only fields."""
    if request.best_of not in (None, 1):
        raise _refuse("best_of", "each request samples one completion, logged as one interaction (send several "
                                 "requests and keep the best)")
    if request.echo:
        raise _refuse("echo", "the answer is the completion only")
    if request.suffix:
        raise _refuse("suffix", "there is no fill-in-the-middle")
