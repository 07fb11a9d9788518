"""What the official client and OpenAI's API reference lead a caller to expect, over real HTTP (the app
over a scripted engine): null for the fields the client declares nullable, one ``created`` per stream,
the same 4xx for a refused request whether it streams or not, ``models.retrieve``, and the error
codes of docs/SERVING.md ("Errors")."""

from __future__ import annotations

import openai
import pytest

from tests.serving.conftest import ANSWER

MODEL = "online-sao"
MESSAGES = [{"role": "user", "content": "Tell me about tea."}]


def test_null_for_a_field_the_client_declares_nullable_takes_its_default(fake_http_server):
    fake_http_server.script(ANSWER)
    client = fake_http_server.openai()
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=None, stream=None, logprobs=None)
    assert chat.choices[0].message.content == ANSWER and chat.choices[0].logprobs is None
    completion = client.completions.create(model=MODEL, prompt="Tea", max_tokens=50, n=None, echo=None, stream=None)
    assert completion.choices[0].text == ANSWER


def test_every_chunk_of_a_stream_has_the_answers_created(fake_http_server):
    fake_http_server.script(ANSWER)
    engine = fake_http_server.engine
    engine.delay_s = 1.1 / len(engine.script)  # the stream crosses at least one second boundary
    chunks = list(fake_http_server.openai().chat.completions.create(
        model=MODEL, messages=MESSAGES, stream=True, stream_options={"include_usage": True}))
    assert len(chunks) > 3 and len({c.created for c in chunks}) == 1


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_input_the_engine_refuses_is_a_400_before_any_stream_begins(fake_http_server, stream):
    fake_http_server.engine.fail_with = ValueError("token ids [99999] are outside the vocabulary of 400")
    with pytest.raises(openai.BadRequestError) as refused:  # raised by create(), not while iterating
        fake_http_server.openai().completions.create(model=MODEL, prompt=[99999], stream=stream)
    assert refused.value.body["param"] == "prompt" and refused.value.body["code"] == "invalid_value"
    assert "outside the vocabulary" in refused.value.body["message"]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_seed_no_generator_takes_is_a_400_naming_it(fake_http_server, stream):
    with pytest.raises(openai.BadRequestError) as refused:
        fake_http_server.openai().chat.completions.create(model=MODEL, messages=MESSAGES, seed=2 ** 64,
                                                          stream=stream)
    assert refused.value.body["param"] == "seed"
    assert fake_http_server.engine.requests == []


def test_the_extreme_seeds_a_generator_takes_are_served(fake_http_server):
    fake_http_server.script(ANSWER)
    client = fake_http_server.openai()
    for seed in (-(2 ** 63), 2 ** 64 - 1):
        assert client.chat.completions.create(model=MODEL, messages=MESSAGES, seed=seed).choices[0].message.content
    assert [r.sampling.seed for r in fake_http_server.engine.requests] == [-(2 ** 63), 2 ** 64 - 1]


def test_the_served_model_can_be_retrieved_and_another_is_not_found(fake_http_server):
    client = fake_http_server.openai()
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model" and card.id in {m.id for m in client.models.list()}
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4")
    assert missing.value.body["code"] == "model_not_found" and missing.value.body["param"] == "model"


def test_stream_options_without_a_stream_is_a_400_naming_it(fake_http_server):
    with pytest.raises(openai.BadRequestError) as refused:
        fake_http_server.openai().chat.completions.create(model=MODEL, messages=MESSAGES,
                                                          stream_options={"include_usage": True})
    assert refused.value.body["param"] == "stream_options"
    assert fake_http_server.engine.requests == []


@pytest.mark.parametrize("fields, param, code", [
    ({"n": 2}, "n", "unsupported_parameter"),
    ({"temperature": 0}, "temperature", "unsupported_parameter"),
    ({"stop": [f"s{i}" for i in range(17)]}, "stop", "invalid_value"),
    ({"max_completion_tokens": 100_000}, "max_completion_tokens", "max_tokens_too_large"),
    ({"max_tokens": 100_000}, "max_tokens", "max_tokens_too_large"),
], ids=["n", "greedy", "stop-count", "max-completion-tokens", "max-tokens"])
def test_each_refusal_has_the_documented_code_and_the_field_sent(fake_http_server, fields, param, code):
    with pytest.raises(openai.BadRequestError) as refused:
        fake_http_server.openai().chat.completions.create(model=MODEL, messages=MESSAGES, **fields)
    assert (refused.value.body["param"], refused.value.body["code"]) == (param, code)


@pytest.mark.parametrize("role", ["user", "system", "tool"])
def test_only_an_assistant_message_may_have_null_content(fake_http_server, role):
    fake_http_server.script(ANSWER)
    client = fake_http_server.openai()
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=[{"role": role, "content": None}, *MESSAGES])
    assert "needs content" in refused.value.body["message"]
    assert fake_http_server.engine.requests == []
    called = [{"role": "assistant", "content": None,
               "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
              {"role": "tool", "tool_call_id": "c1", "content": "4"}]
    answer = client.chat.completions.create(model=MODEL, messages=[*MESSAGES, *called])
    assert answer.choices[0].message.content == ANSWER
