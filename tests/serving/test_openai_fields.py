"""OpenAI request fields through the official client over real HTTP (the app over a scripted engine):
log-probs in both endpoints' shapes, plain and streamed, equal to the logged behaviour log-probs; a
400 naming each field the service refuses, and their default values accepted."""

from __future__ import annotations

import openai
import pytest

from tests.serving.conftest import ANSWER

MODEL = "online-sao"
MESSAGES = [{"role": "user", "content": "Tell me about tea."}]


def _turn_logprobs(server, interaction_id: str) -> list[float]:
    [record] = [r for r in server.harness.interactions() if r.interaction_id == interaction_id]
    return record.logprobs


def test_chat_logprobs_plain_and_streamed_are_the_logged_ones(fake_http_server):
    server = fake_http_server
    server.script(ANSWER)
    tokenizer = server.harness.tokenizer
    client = server.openai()
    answer = client.chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=2)
    content = answer.choices[0].logprobs.content
    logged = _turn_logprobs(server, answer.interaction_id)
    # every sampled token, the stop token included, with its behaviour log-probability
    assert [t.logprob for t in content] == logged == pytest.approx([-0.1 * (i + 1) for i in range(len(logged))])
    assert [t.token for t in content] == [tokenizer.decode([i]) for i in server.engine.script]
    assert bytes(b for t in content[:-1] for b in t.bytes).decode() == ANSWER  # exact bytes, split characters too
    assert all(t.top_logprobs == [] for t in content)  # the fake engine lists no alternatives

    streamed, ids = [], set()
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True, stream=True):
        ids.add(chunk.interaction_id)
        for choice in chunk.choices:
            streamed += choice.logprobs.content if choice.logprobs else []
    [streamed_id] = ids
    assert [t.logprob for t in streamed] == _turn_logprobs(server, streamed_id)

    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_plain_and_streamed_are_the_logged_ones(fake_http_server):
    server = fake_http_server
    server.script(ANSWER)
    client = server.openai()
    answer = client.completions.create(model=MODEL, prompt="Tea", logprobs=2, max_tokens=50)
    lp = answer.choices[0].logprobs
    assert lp.token_logprobs == _turn_logprobs(server, answer.interaction_id)
    assert len(lp.tokens) == len(lp.top_logprobs) == len(lp.text_offset) == len(lp.token_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]

    streamed, tokens, offsets, ids = [], [], [], set()
    for chunk in client.completions.create(model=MODEL, prompt="Tea", logprobs=0, max_tokens=50, stream=True):
        ids.add(chunk.interaction_id)
        for choice in chunk.choices:
            streamed += choice.logprobs.token_logprobs if choice.logprobs else []
            tokens += choice.logprobs.tokens if choice.logprobs else []
            offsets += choice.logprobs.text_offset if choice.logprobs else []
    [streamed_id] = ids
    assert streamed == _turn_logprobs(server, streamed_id)
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]  # across chunks too


@pytest.mark.parametrize("field, value", [
    ("presence_penalty", 0.5), ("frequency_penalty", -1.0), ("logit_bias", {"5": 10}),
    ("response_format", {"type": "json_object"}),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}),
    ("tool_choice", "required"), ("tool_choice", {"type": "function", "function": {"name": "add"}}),
    ("top_logprobs", 3), ("n", 2), ("functions", [{"name": "add"}]), ("function_call", {"name": "add"}),
    ("modalities", ["text", "audio"]), ("audio", {"voice": "alloy", "format": "wav"}),
    ("web_search_options", {}),
])
def test_a_field_the_service_cannot_honour_is_a_400_naming_it(fake_http_server, field, value):
    client = fake_http_server.openai()
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, **{field: value})
    assert refused.value.body["param"] == field and field in refused.value.body["message"]
    assert fake_http_server.engine.requests == []


ADD = {"type": "function", "function": {"name": "add"}}
STRICT_SUB = {"type": "function", "function": {"name": "sub", "parameters": {"type": "object"}, "strict": True}}


@pytest.mark.parametrize("fields, param, code", [
    # strict schema adherence constrains sampling like json_schema structured output; it was accepted, rendered
    # into the prompt and not enforced
    ({"tools": [ADD, STRICT_SUB]}, "tools[1].function.strict", "unsupported_parameter"),
    # as OpenAI answers: tool_choice only with tools, and tools lists at least one (both were accepted)
    ({"tool_choice": "auto"}, "tool_choice", "invalid_value"),
    ({"tool_choice": "none"}, "tool_choice", "invalid_value"),
    ({"tool_choice": "auto", "tools": []}, "tool_choice", "invalid_value"),
    ({"tools": []}, "tools", "invalid_value"),
], ids=["strict", "choice-without-tools", "none-without-tools", "choice-with-empty-tools", "empty-tools"])
def test_tool_fields_openai_refuses_are_a_400_naming_the_field(fake_http_server, fields, param, code):
    client = fake_http_server.openai()
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, **fields)
    assert (refused.value.body["param"], refused.value.body["code"]) == (param, code)
    assert param in refused.value.body["message"]
    assert fake_http_server.engine.requests == []
    fake_http_server.script(ANSWER)
    not_strict = {"type": "function", "function": {**STRICT_SUB["function"], "strict": False}}
    answer = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[ADD, not_strict],
                                            tool_choice="auto")
    assert answer.choices[0].message.content == ANSWER


@pytest.mark.parametrize("field, value", [("presence_penalty", 0.5), ("frequency_penalty", 0.1),
                                          ("logit_bias", {"7": -100}), ("best_of", 2), ("echo", True),
                                          ("suffix", " and more"), ("n", 2)])
def test_completions_refuse_the_same_sampling_fields(fake_http_server, field, value):
    with pytest.raises(openai.BadRequestError) as refused:
        fake_http_server.openai().completions.create(model=MODEL, prompt="Tea", **{field: value})
    assert refused.value.body["param"] == field


def test_default_values_of_those_fields_are_accepted(fake_http_server):
    fake_http_server.script(ANSWER)
    answer = fake_http_server.openai().chat.completions.create(
        model=MODEL, messages=MESSAGES, presence_penalty=0, frequency_penalty=0.0, logit_bias={},
        response_format={"type": "text"}, tool_choice="none", parallel_tool_calls=True, modalities=["text"],
        tools=[{"type": "function", "function": {"name": "add"}}])
    assert answer.choices[0].message.content == ANSWER
    prompt = fake_http_server.harness.tokenizer.decode(fake_http_server.engine.requests[0].prompt_ids)
    assert "<tools>" not in prompt  # tool_choice none: the tools are not offered


def test_default_values_of_the_completion_fields_are_accepted(fake_http_server):
    fake_http_server.script(ANSWER)
    answer = fake_http_server.openai().completions.create(model=MODEL, prompt="Tea", max_tokens=50, best_of=1,
                                                          echo=False, suffix="", presence_penalty=0, n=1)
    assert answer.choices[0].text == ANSWER
