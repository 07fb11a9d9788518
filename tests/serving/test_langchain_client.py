"""LangChain's ``ChatOpenAI`` bound to a tool, over real HTTP (the app over a scripted engine): the call,
the tool's result as a ToolMessage, the answer, as one logged trajectory.

``langchain-openai`` is in the test extras (pinned in constraints.txt); ``make test`` installs it.
"""

from __future__ import annotations

import json

import langchain_openai
import pytest
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool

CALL_TEXT = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@pytest.mark.parametrize("streaming", [False, True])
def test_chat_openai_with_a_bound_tool_calls_it_and_answers(fake_http_server, streaming):
    server = fake_http_server
    model = langchain_openai.ChatOpenAI(base_url=f"{server.url}/v1", api_key="not-needed-on-loopback",
                                        model="online-sao", max_retries=0, streaming=streaming)
    agent = model.bind_tools([add])
    server.script(CALL_TEXT)
    question = [HumanMessage("What is 2 plus 3?")]
    called = agent.invoke(question)
    [call] = called.tool_calls
    assert (call["name"], call["args"]) == ("add", {"a": 2, "b": 3})
    prompt = server.harness.tokenizer.decode(server.engine.requests[0].prompt_ids)
    assert '"name": "add"' in prompt and "Add two integers." in prompt
    first_id = server.harness.interactions()[-1].interaction_id

    server.script("It is 5.")
    result = ToolMessage(content=json.dumps(add.invoke(call["args"])), tool_call_id=call["id"])
    answer = agent.invoke(question + [called, result], extra_body={"parent_interaction_id": first_id})
    assert answer.content == "It is 5." and answer.tool_calls == []

    record = server.harness.interactions()[-1]
    assert record.parent_id == first_id
    observation = [t for t, is_action in zip(record.response_ids, record.action_mask) if not is_action]
    assert server.harness.tokenizer.decode(observation) == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
