"""LangChain's ``ChatOpenAI`` bound to a tool, over real HTTP (the app over a scripted engine): the call,
the tool's result as a ToolMessage, the answer, as one logged trajectory.

``langchain-openai`` is in the test extras (pinned in constraints.txt); ``make test`` installs it.
LangChain is imported by the fixture, not at module level: the vLLM lane's environment collects this
file (and deselects its test) without having LangChain.
"""

from __future__ import annotations

import json

from types import SimpleNamespace

import pytest

CALL_TEXT = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@pytest.fixture
def lc() -> SimpleNamespace:
    """LangChain's client, messages and the ``add`` tool."""
    import langchain_openai
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    return SimpleNamespace(ChatOpenAI=langchain_openai.ChatOpenAI, HumanMessage=HumanMessage,
                           ToolMessage=ToolMessage, add=tool(add))


@pytest.mark.parametrize("streaming", [False, True])
def test_chat_openai_with_a_bound_tool_calls_it_and_answers(fake_http_server, lc, streaming):
    server = fake_http_server
    model = lc.ChatOpenAI(base_url=f"{server.url}/v1", api_key="not-needed-on-loopback",
                          model="online-sao", max_retries=0, streaming=streaming)
    agent = model.bind_tools([lc.add])
    server.script(CALL_TEXT)
    question = [lc.HumanMessage("What is 2 plus 3?")]
    called = agent.invoke(question)
    [call] = called.tool_calls
    assert (call["name"], call["args"]) == ("add", {"a": 2, "b": 3})
    prompt = server.harness.tokenizer.decode(server.engine.requests[0].prompt_ids)
    assert '"name": "add"' in prompt and "Add two integers." in prompt
    first_id = server.harness.interactions()[-1].interaction_id

    server.script("It is 5.")
    result = lc.ToolMessage(content=json.dumps(lc.add.invoke(call["args"])), tool_call_id=call["id"])
    answer = agent.invoke(question + [called, result], extra_body={"parent_interaction_id": first_id})
    assert answer.content == "It is 5." and answer.tool_calls == []

    record = server.harness.interactions()[-1]
    assert record.parent_id == first_id
    observation = [t for t, is_action in zip(record.response_ids, record.action_mask) if not is_action]
    assert server.harness.tokenizer.decode(observation) == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
