"""vLLM's request extensions (what OpenAI clients send through ``extra_body`` to vLLM-compatible
servers), through the official client over real HTTP (the app over a scripted engine): each value that
would change the sampling distribution, where sampling stops, the prompt or the answer's text is a 400
``unsupported_parameter`` naming the field, on both endpoints and before the engine sees the request;
the neutral values are served exactly as a request without them; the extensions that change none of
that are accepted and ignored. Before, every one of them was dropped without a word."""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import openai
import pytest

from serving.protocol import ChatCompletionRequest, CompletionRequest
from tests.serving.conftest import ANSWER, running_fake_http_server

MODEL = "online-sao"
MESSAGES = [{"role": "user", "content": "Tell me about tea."}]

REFUSED_ON_BOTH = [
    ("top_k", 1), ("top_k", 40), ("top_k", -2), ("min_p", 0.05), ("repetition_penalty", 1.1),
    ("repetition_penalty", 0.9), ("use_beam_search", True), ("watermarking", True), ("bad_words", ["tea"]),
    ("allowed_token_ids", [5, 6]), ("logits_processors", ["my_module.MyProcessor"]), ("vllm_xargs", {"k": 1}),
    ("min_tokens", 5), ("thinking_token_budget", 10), ("guided_json", {"type": "object"}), ("guided_json", "{}"),
    ("guided_regex", "[a-z]+"), ("guided_choice", ["yes", "no"]), ("guided_grammar", "root ::= \"a\""),
    ("structured_outputs", {"json": {"type": "object"}}), ("structured_outputs", {"choice": ["yes", "no"]}),
    ("ignore_eos", True), ("stop_token_ids", [7]), ("repetition_detection", {"max_pattern_size": 4, "min_count": 3}),
    ("truncate_prompt_tokens", 8), ("include_stop_str_in_output", True), ("skip_special_tokens", False),
    ("prompt_logprobs", 0), ("logprob_token_ids", [5]), ("return_tokens_as_token_ids", True),
    ("return_token_ids", True), ("return_token_offsets", True), ("structural_tag", '{"type": "structural_tag"}'),
    ("structural_tag", {"type": "structural_tag", "structures": [], "triggers": []}), ("best_of", 3),
]
"""vLLM's extensions of both endpoints, each with a value this service does not honour."""
REFUSED_ON_CHAT = [
    ("echo", True), ("add_generation_prompt", False), ("continue_final_message", True), ("add_special_tokens", True),
    ("chat_template", "{{ messages[0].content }}"), ("chat_template_kwargs", {"enable_thinking": False}),
    ("documents", [{"title": "Tea", "text": "Tea is a drink."}]), ("return_prompt_text", True),
]
REFUSED_ON_COMPLETIONS = [
    ("response_format", {"type": "json_object"}), ("add_special_tokens", False), ("prompt_embeds", "AAAAAA=="),
]

NEUTRAL_ON_BOTH = [
    {"top_k": -1, "min_p": 0, "repetition_penalty": 1, "use_beam_search": False, "watermarking": False,
     "bad_words": [], "allowed_token_ids": [], "logits_processors": [], "vllm_xargs": {}, "min_tokens": 0,
     "thinking_token_budget": -1, "guided_choice": [], "structured_outputs": {}, "ignore_eos": False,
     "stop_token_ids": [], "repetition_detection": {"max_pattern_size": 0, "min_pattern_size": 0, "min_count": 0},
     "truncate_prompt_tokens": -1, "include_stop_str_in_output": False, "skip_special_tokens": True,
     "logprob_token_ids": [], "return_tokens_as_token_ids": False, "return_token_ids": False,
     "return_token_offsets": False, "best_of": 1},
    {"top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "repetition_detection": {}},
    {name: None for name, _ in REFUSED_ON_BOTH},
]
"""The neutral values (as vLLM reads them), all at once: vLLM's defaults and the other spellings of 'off'."""
NEUTRAL_ON_CHAT = {"echo": False, "add_generation_prompt": True, "continue_final_message": False,
                   "add_special_tokens": False, "chat_template": "", "chat_template_kwargs": {}, "documents": [],
                   "return_prompt_text": False}
NEUTRAL_ON_COMPLETIONS = {"response_format": {"type": "text"}, "add_special_tokens": True, "prompt_embeds": None}
IGNORED = {"length_penalty": 0.5, "spaces_between_special_tokens": False, "truncation_side": "left",
           "guided_decoding_backend": "xgrammar", "guided_whitespace_pattern": " ", "priority": 3,
           "request_id": "mine-1", "cache_salt": "salt", "kv_transfer_params": {"x": 1}, "stream_interval": 4,
           "mm_processor_kwargs": {"x": 1}}
"""Extensions that change neither the tokens sampled nor the prompt nor the answer's text here."""


@pytest.fixture(scope="module")
def server(tmp_path_factory, chat_tokenizer) -> Iterator:
    """One server for the module (each refusal is one request that never reaches the engine)."""
    with running_fake_http_server(tmp_path_factory.mktemp("extensions"), chat_tokenizer) as served:
        served.script(ANSWER)
        yield served


def _assert_refused(server, create, field: str) -> None:
    sampled = len(server.engine.requests)
    with pytest.raises(openai.BadRequestError) as refused:
        create()
    body = refused.value.body
    assert (body["param"], body["code"]) == (field, "unsupported_parameter"), body
    assert body["message"].startswith(f"{field} is not supported: ")
    assert len(server.engine.requests) == sampled  # refused before the engine saw it


@pytest.mark.parametrize("field, value", REFUSED_ON_BOTH + REFUSED_ON_CHAT)
def test_chat_refuses_an_extension_it_cannot_honour_naming_it(server, field, value):
    client = server.openai()
    _assert_refused(server, lambda: client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                                                   extra_body={field: value}), field)


@pytest.mark.parametrize("field, value", REFUSED_ON_BOTH + REFUSED_ON_COMPLETIONS)
def test_completions_refuse_an_extension_they_cannot_honour_naming_it(server, field, value):
    client = server.openai()
    _assert_refused(server, lambda: client.completions.create(model=MODEL, prompt="Tea",
                                                              extra_body={field: value}), field)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_refused_extension_is_a_400_before_any_stream_begins(server, stream):
    client = server.openai()  # raised by create(), not while iterating
    _assert_refused(server, lambda: client.chat.completions.create(
        model=MODEL, messages=MESSAGES, stream=stream, extra_body={"top_k": 1}), "top_k")
    _assert_refused(server, lambda: client.completions.create(
        model=MODEL, prompt="Tea", stream=stream, extra_body={"guided_regex": "a+"}), "guided_regex")


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_usage_on_every_chunk_is_refused_and_off_is_served(server, route):
    """``continuous_usage_stats`` was dropped: the stream carried usage on its final chunk only."""
    client = server.openai()
    create = (partial(client.chat.completions.create, messages=MESSAGES) if route == "chat"
              else partial(client.completions.create, prompt="Tea"))
    field = "stream_options.continuous_usage_stats"
    _assert_refused(server, lambda: create(model=MODEL, stream=True, max_tokens=50, stream_options={
        "include_usage": True, "continuous_usage_stats": True}), field)
    chunks = list(create(model=MODEL, stream=True, max_tokens=50,
                         stream_options={"include_usage": True, "continuous_usage_stats": False}))
    assert [chunk.usage is not None for chunk in chunks] == [False] * (len(chunks) - 1) + [True]


def test_the_refusal_says_why(server):
    client = server.openai()
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body={"repetition_penalty": 1.2})
    assert "changes the sampling distribution" in refused.value.body["message"]
    assert "send 1 or leave it out" in refused.value.body["message"]
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt="Tea", extra_body={"ignore_eos": True})
    assert "max_tokens" in refused.value.body["message"]


@pytest.mark.parametrize("neutral", NEUTRAL_ON_BOTH, ids=["defaults", "other-offs", "nulls"])
def test_neutral_values_are_served_as_a_request_without_them(server, neutral):
    client = server.openai()
    chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 50}
    completion = {"model": MODEL, "prompt": "Tea", "max_tokens": 50}
    first = len(server.engine.requests)
    assert client.chat.completions.create(**chat).choices[0].message.content == ANSWER
    assert client.chat.completions.create(
        **chat, extra_body={**neutral, **NEUTRAL_ON_CHAT}).choices[0].message.content == ANSWER
    assert client.completions.create(**completion).choices[0].text == ANSWER
    assert client.completions.create(
        **completion, extra_body={**neutral, **NEUTRAL_ON_COMPLETIONS}).choices[0].text == ANSWER
    plain_chat, neutral_chat, plain_completion, neutral_completion = server.engine.requests[first:]
    for plain, with_neutral in ((plain_chat, neutral_chat), (plain_completion, neutral_completion)):
        assert with_neutral.sampling == plain.sampling and with_neutral.prompt_ids == plain.prompt_ids


def test_extensions_that_change_nothing_here_are_accepted_and_ignored(server):
    client = server.openai()
    assert client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                          extra_body=IGNORED).choices[0].message.content == ANSWER
    assert client.completions.create(model=MODEL, prompt="Tea", max_tokens=50,
                                     extra_body=IGNORED).choices[0].text == ANSWER


@pytest.mark.parametrize("field, value", [("top_k", 1.5), ("top_k", True), ("min_p", "0"), ("ignore_eos", 1),
                                          ("bad_words", "tea"), ("repetition_detection", {"min_count": "3"})])
def test_a_wrongly_typed_extension_is_an_invalid_value(server, field, value):
    """Typed as strictly as the OpenAI fields (the OpenAPI schema documents them and is fuzzed)."""
    with pytest.raises(openai.BadRequestError) as refused:
        server.openai().chat.completions.create(model=MODEL, messages=MESSAGES, extra_body={field: value})
    assert refused.value.body["code"] == "invalid_value" and field in refused.value.body["message"]


def test_every_refused_extension_is_declared_in_the_request_models():
    """Declared, so that the OpenAPI document shows them and the checks see them (an undeclared field
    is dropped by the models' extra="ignore")."""
    chat, completion = ChatCompletionRequest.model_fields, CompletionRequest.model_fields
    assert {name for name, _ in REFUSED_ON_BOTH + REFUSED_ON_CHAT} <= set(chat)
    assert {name for name, _ in REFUSED_ON_BOTH + REFUSED_ON_COMPLETIONS} <= set(completion)
    assert not set(IGNORED) & (set(chat) | set(completion))
