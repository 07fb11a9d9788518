"""Tool calling through the official openai client over real HTTP (the app over a scripted engine):
a call, the tool's result, the answer, plain and streamed; the logged trajectory and its advantages."""

from __future__ import annotations

import json

import pytest
import torch

from online_sao.advantages import skip_observation_gae
from online_sao.batch import collate
from serving.tool_calls import HermesToolCallParser
from trainer.rollouts import interaction_to_rollout

MODEL = "online-sao"
TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
CALL_TEXT = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
QUESTION = [{"role": "user", "content": "What is 2 plus 3?"}]


def test_hermes_parser_splits_content_and_calls_and_keeps_malformed_blocks():
    parser = HermesToolCallParser()
    parsed = parser.parse(f"Let me add.{CALL_TEXT}", TOOLS)
    assert parsed.content == "Let me add."
    [call] = parsed.calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("add", {"a": 2, "b": 3})
    assert parser.parse(f"\n{CALL_TEXT}\n", TOOLS).content == ""
    broken = "<tool_call>{not json}</tool_call>"
    assert parser.parse(broken, TOOLS).content == broken and parser.parse(broken, TOOLS).calls == ()
    assert parser.parse("no calls", TOOLS).content == "no calls"
    assert parser.held_from("plain text") == len("plain text")
    assert parser.held_from("plain <tool") == len("plain ")
    assert parser.held_from(f"ab{CALL_TEXT}") == 2


def test_blank_text_before_a_call_is_held_back_until_text_that_is_not_blank():
    parser = HermesToolCallParser()
    assert parser.held_from("\n") == 0  # may yet be followed by a call: then it is no content
    assert parser.held_from("\n <tool") == 0
    assert parser.held_from(f"\n{CALL_TEXT}") == 0
    assert parser.held_from("\nHi") == 3  # no longer blank: it goes out
    assert parser.held_from(f"Hi\n{CALL_TEXT}") == 3


NOT_CALLS = {
    "undeclared tool": '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
    "empty name": '<tool_call>{"name": "", "arguments": {}}</tool_call>',
    "name not a string": '<tool_call>{"name": ["add"], "arguments": {}}</tool_call>',
    "arguments text not JSON": '<tool_call>{"name": "add", "arguments": "not json"}</tool_call>',
    "arguments a list": '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',
    "arguments text of a list": '<tool_call>{"name": "add", "arguments": "[1, 2]"}</tool_call>',
    "arguments a number": '<tool_call>{"name": "add", "arguments": 5}</tool_call>',
    # the arguments written elsewhere: they were dropped and the block was a call with {} (add({}))
    "arguments under another key": '<tool_call>{"name": "add", "parameters": {"a": 2, "b": 3}}</tool_call>',
    "arguments beside the name": '<tool_call>{"name": "add", "a": 2, "b": 3}</tool_call>',
    "another key beside the arguments": '<tool_call>{"name": "add", "arguments": {}, "a": 2}</tool_call>',
    "NaN argument": '<tool_call>{"name": "add", "arguments": {"a": NaN, "b": 3}}</tool_call>',
    "infinite argument in text": '<tool_call>{"name": "add", "arguments": "{\\"a\\": Infinity}"}</tool_call>',
    "half an escaped emoji": '<tool_call>{"name": "add", "arguments": {"a": "\\ud83d", "b": 3}}</tool_call>',
    # deeper than Python's JSON parser goes: RecursionError, which is no ValueError (it was a 500 after
    # the answer was logged)
    "nested deeper than the parser": "<tool_call>" + "[" * 5000 + "</tool_call>",
    "arguments text nested deeper": '<tool_call>{"name": "add", "arguments": "' + "[" * 5000 + '"}</tool_call>',
}
"""Blocks that are no call OpenAI's clients could run (most of them well-formed JSON)."""


@pytest.mark.parametrize("block", NOT_CALLS.values(), ids=NOT_CALLS.keys())
def test_a_block_is_a_call_only_to_a_declared_tool_with_an_object_of_arguments(block):
    parsed = HermesToolCallParser().parse(f"Let me add.{block}{CALL_TEXT}", TOOLS)
    assert parsed.content == f"Let me add.{block}"
    [call] = parsed.calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("add", {"a": 2, "b": 3})


def test_arguments_written_as_json_text_or_left_out_are_an_object():
    parser = HermesToolCallParser()
    [as_text] = parser.parse('<tool_call>{"name": "add", "arguments": "{\\"a\\": 2}"}</tool_call>', TOOLS).calls
    [left_out] = parser.parse('<tool_call>{"name": "add"}</tool_call>', TOOLS).calls
    assert (json.loads(as_text.function.arguments), json.loads(left_out.function.arguments)) == ({"a": 2}, {})


def _streamed(client, **kwargs):
    """(content, tool calls as {index: (id, name, arguments)}, finish reason, interaction id)."""
    content, calls, finish, ids = "", {}, None, set()
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        ids.add(chunk.interaction_id)
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                calls[delta.index] = (delta.id, delta.function.name, delta.function.arguments)
            finish = choice.finish_reason or finish
    [interaction_id] = ids
    return content, calls, finish, interaction_id


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_round_trip_logs_the_tool_result_as_observation(fake_http_server, stream):
    server = fake_http_server
    client = server.openai()
    server.script(CALL_TEXT)
    if stream:
        content, calls, finish, first_id = _streamed(client, model=MODEL, messages=QUESTION, tools=TOOLS)
        [(call_id, name, arguments)] = calls.values()
        assistant = {"role": "assistant", "content": content or None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]}
    else:
        first = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS)
        finish, first_id, message = first.choices[0].finish_reason, first.interaction_id, first.choices[0].message
        content, [call] = message.content, message.tool_calls
        call_id, name, arguments = call.id, call.function.name, call.function.arguments
        assistant = message.model_dump(exclude_none=True)
    assert finish == "tool_calls" and not content
    assert (name, json.loads(arguments)) == ("add", {"a": 2, "b": 3})
    prompt = server.harness.tokenizer.decode(server.engine.requests[0].prompt_ids)
    assert "<tools>" in prompt and '"name": "add"' in prompt  # the template rendered the tools

    server.script("It is 5.")
    follow_up = dict(model=MODEL, tools=TOOLS, extra_body={"parent_interaction_id": first_id},
                     messages=QUESTION + [assistant, {"role": "tool", "tool_call_id": call_id, "content": "5"}])
    if stream:
        answer, calls, finish, second_id = _streamed(client, **follow_up)
        assert calls == {}
    else:
        second = client.chat.completions.create(**follow_up)
        answer, finish, second_id = second.choices[0].message.content, second.choices[0].finish_reason, \
            second.interaction_id
    assert (answer, finish) == ("It is 5.", "stop")

    records = {r.interaction_id: r for r in server.harness.interactions()}
    record = records[second_id]
    assert record.parent_id == first_id
    tokenizer = server.harness.tokenizer
    call_ids = tokenizer(CALL_TEXT, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    answer_ids = tokenizer("It is 5.", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    observation = record.response_ids[len(call_ids):-len(answer_ids)]
    assert record.response_ids == call_ids + observation + answer_ids
    assert record.action_mask == [True] * len(call_ids) + [False] * len(observation) + [True] * len(answer_ids)
    assert tokenizer.decode(observation) == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    assert record.turn_ends == [len(call_ids) - 1, len(record.response_ids) - 1]

    # the learner's skip-observation GAE: with gamma = lambda = 1, values 0 on actions and a reward of 1
    # at the end, every action token's advantage is 1 however large the values on the tool result are
    rollout = interaction_to_rollout(record, reward=1.0)
    batch = collate([rollout], pad_token_id=0)
    values = torch.where(batch.action_mask, 0.0, 1000.0)
    advantages, _ = skip_observation_gae(batch.rewards, values, batch.action_mask, gamma=1.0, lam=1.0)
    assert torch.equal(advantages[batch.action_mask], torch.ones(int(batch.action_mask.sum())))
    assert torch.equal(advantages[~batch.action_mask], torch.zeros(int((~batch.action_mask).sum())))
    tool_result = len(record.prompt_ids) + len(call_ids) + torch.arange(len(observation))
    assert not batch.action_mask[0, tool_result].any()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("label", ["undeclared tool", "arguments text not JSON", "NaN argument",
                                   "half an escaped emoji", "arguments under another key",
                                   "arguments beside the name"])
def test_a_block_that_is_no_call_reaches_the_client_as_content(fake_http_server, stream, label):
    server = fake_http_server
    client = server.openai()
    server.script(NOT_CALLS[label])
    if stream:
        content, calls, finish, _ = _streamed(client, model=MODEL, messages=QUESTION, tools=TOOLS)
    else:
        answer = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS)
        content, calls, finish = (answer.choices[0].message.content, answer.choices[0].message.tool_calls,
                                  answer.choices[0].finish_reason)
    assert (content, finish) == (NOT_CALLS[label], "stop") and not calls


def _called_with_result(server, client):
    """A first turn that calls the tool: (its answer, the assistant message, the tool's result message)."""
    server.script(CALL_TEXT)
    first = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS)
    assistant = first.choices[0].message.model_dump(exclude_none=True)
    return first, assistant, {"role": "tool", "tool_call_id": assistant["tool_calls"][0]["id"], "content": "5"}


def test_a_continuation_with_other_tools_or_an_edited_call_is_refused(fake_http_server):
    import openai

    server = fake_http_server
    client = server.openai()
    first, assistant, tool = _called_with_result(server, client)
    parent = {"parent_interaction_id": first.interaction_id}
    with pytest.raises(openai.BadRequestError) as other_tools:
        client.chat.completions.create(model=MODEL, messages=QUESTION + [assistant, tool], extra_body=parent,
                                       tools=[{"type": "function", "function": {"name": "sub"}}])
    assert other_tools.value.body["param"] == "tools"
    edited = json.loads(json.dumps(assistant))
    edited["tool_calls"][0]["function"]["arguments"] = '{"a": 2, "b": 4}'
    with pytest.raises(openai.BadRequestError) as edited_call:
        client.chat.completions.create(model=MODEL, messages=QUESTION + [edited, tool], extra_body=parent,
                                       tools=TOOLS)
    assert edited_call.value.body["param"] == "messages"


def test_without_tools_a_tool_call_text_is_plain_content(fake_http_server):
    server = fake_http_server
    server.script(CALL_TEXT)
    answer = server.openai().chat.completions.create(model=MODEL, messages=QUESTION)
    assert answer.choices[0].message.content == CALL_TEXT and answer.choices[0].message.tool_calls is None
    assert answer.choices[0].finish_reason == "stop"


STREAMED_AS_PLAIN = {  # label: (the model's answer, its content in a plain answer, its content streamed)
    "blank before a call": ("\n" + CALL_TEXT, None, ""),  # the "\n" went out while the plain answer said null
    "blank answer": ("\n\n", "\n\n", "\n\n"),
    "text before a call": ("\nLet me add." + CALL_TEXT, "\nLet me add.", "\nLet me add."),
}


@pytest.mark.parametrize("answer, plain, streamed", STREAMED_AS_PLAIN.values(), ids=STREAMED_AS_PLAIN.keys())
def test_streamed_content_is_the_plain_answers(fake_http_server, answer, plain, streamed):
    server = fake_http_server
    client = server.openai()
    server.script(answer)
    message = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS).choices[0].message
    content, _, _, _ = _streamed(client, model=MODEL, messages=QUESTION, tools=TOOLS)
    assert (message.content, content) == (plain, streamed)


def test_a_streamed_call_after_blank_text_continues_as_the_client_received_it(fake_http_server):
    # the "\n" went out as content while the logged reply's content was "": sent back, it was refused (400)
    server = fake_http_server
    client = server.openai()
    server.script("\n" + CALL_TEXT)
    content, calls, _, first_id = _streamed(client, model=MODEL, messages=QUESTION, tools=TOOLS)
    [(call_id, name, arguments)] = calls.values()
    assistant = {"role": "assistant", "content": content, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]}
    server.script("It is 5.")
    second = client.chat.completions.create(
        model=MODEL, tools=TOOLS, extra_body={"parent_interaction_id": first_id},
        messages=QUESTION + [assistant, {"role": "tool", "tool_call_id": call_id, "content": "5"}])
    assert second.choices[0].message.content == "It is 5."


HISTORY_ARGUMENTS_REFUSED = {
    # RecursionError is no ValueError: it was a 500
    "nested deeper than the parser": "[" * 5000,
    # an escape escaped twice passes the body's surrogate check; the tokenizer then failed (500)
    "half an escaped emoji": '{"a": "\\ud83d", "b": 3}',
}


@pytest.mark.parametrize("arguments", HISTORY_ARGUMENTS_REFUSED.values(), ids=HISTORY_ARGUMENTS_REFUSED.keys())
def test_history_call_arguments_no_template_can_render_are_refused(fake_http_server, arguments):
    import openai

    assistant = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": arguments}}]}
    with pytest.raises(openai.BadRequestError) as refused:
        fake_http_server.openai().chat.completions.create(
            model=MODEL, tools=TOOLS,
            messages=QUESTION + [assistant, {"role": "tool", "tool_call_id": "call_1", "content": "5"}])
    assert refused.value.body["param"] == "messages"
    assert fake_http_server.engine.requests == []  # nothing was sampled


@pytest.mark.parametrize("stream", [False, True])
def test_a_continuation_with_tool_choice_none_keeps_the_tools_in_the_prompt_and_parses_no_call(
        fake_http_server, stream):
    """The agent pattern that forces a final answer after the tool's result: the parent's tools with
    ``tool_choice`` ``none``. The trajectory's prompt keeps them (the logged ids are the engine's prompt),
    a call the model writes anyway is content, and the conversation goes on with the tools."""
    import openai

    server = fake_http_server
    client = server.openai()
    first, assistant, tool = _called_with_result(server, client)
    server.script(CALL_TEXT)
    forced = dict(model=MODEL, messages=QUESTION + [assistant, tool], tools=TOOLS, tool_choice="none",
                  extra_body={"parent_interaction_id": first.interaction_id})
    if stream:
        content, calls, finish, second_id = _streamed(client, **forced)
    else:
        second = client.chat.completions.create(**forced)
        content, calls, finish, second_id = (second.choices[0].message.content, second.choices[0].message.tool_calls,
                                             second.choices[0].finish_reason, second.interaction_id)
    assert (content, finish) == (CALL_TEXT, "stop") and not calls

    record = {r.interaction_id: r for r in server.harness.interactions()}[second_id]
    tokenizer = server.harness.tokenizer
    answer_ids = tokenizer(CALL_TEXT, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    prompted = server.engine.requests[1].prompt_ids
    assert record.prompt_ids + record.response_ids == list(prompted) + answer_ids
    assert "<tools>" in tokenizer.decode(prompted)
    observation = record.response_ids[len(answer_ids):-len(answer_ids)]
    assert tokenizer.decode(observation) == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"

    history = QUESTION + [assistant, tool, {"role": "assistant", "content": CALL_TEXT}]
    follow_up = {"parent_interaction_id": second_id}
    with pytest.raises(openai.BadRequestError) as other_tools:
        client.chat.completions.create(model=MODEL, messages=history + QUESTION, extra_body=follow_up,
                                       tools=[{"type": "function", "function": {"name": "sub"}}], tool_choice="none")
    assert other_tools.value.body["param"] == "tools"
    server.script(CALL_TEXT)
    third = client.chat.completions.create(model=MODEL, messages=history + QUESTION, extra_body=follow_up,
                                           tools=TOOLS)
    assert third.choices[0].finish_reason == "tool_calls"
