"""One agent episode through the OpenAI API: ask, run the tools the model calls, send their
results back as a continuation of the same trajectory, judge the final answer, send the reward.

The agent is a client like any other: the official ``openai`` package over HTTP, the
continuation linked by the endpoint's ``parent_interaction_id`` extension, the reward
posted to ``/v1/feedback`` for the newest interaction id (it carries the whole
trajectory), from where serving sends it to Kafka's rewards topic.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import httpx
from openai import AsyncOpenAI

from apps.agent.judge import ToolUse, Verdict, execute_call, judge_episode
from apps.config import AgentConfig
from apps.default_model.calculator import CALCULATOR_TOOL
from apps.default_model.tool_corpus import ToolTask

FEEDBACK_SOURCE = "agent"
"""``source`` of the rewards the agent sends."""


@dataclass(frozen=True)
class Episode:
    """What one task produced; a row of the results file."""

    index: int
    """Order in which the task started (0-based)."""
    question: str
    expected: str
    tool_uses: list[ToolUse]
    final_answer: str
    interaction_ids: list[str]
    """One per request, the first turn first; the reward went to the last."""
    policy_version: int | None
    """Newest policy version that sampled a token of the final answer's trajectory."""
    called: bool
    call_correct: bool
    answer_correct: bool
    reward: float
    finished_at: float
    """Unix time the reward was accepted."""
    latency_s: float

    def to_json(self) -> dict:
        return asdict(self)


def _extension(response: object, name: str) -> object:
    return (getattr(response, "model_extra", None) or {}).get(name)


class Agent:
    """Runs episodes against one endpoint: ``base_url`` is the server root (``/v1`` is appended)."""

    def __init__(self, base_url: str, model: str, settings: AgentConfig, api_key: str | None = None) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key or "unused")
        self.http = httpx.AsyncClient(base_url=base_url, headers=headers, timeout=60.0)
        self.model = model
        self.settings = settings

    async def _ask(self, messages: list[dict], parent: str | None):
        return await self.client.chat.completions.create(
            model=self.model, messages=messages, tools=[CALCULATOR_TOOL], max_tokens=self.settings.max_tokens,
            temperature=self.settings.temperature,
            extra_body={"parent_interaction_id": parent} if parent else None)

    async def run(self, index: int, task: ToolTask) -> Episode:
        """One task end to end; the reward is accepted by the server when this returns."""
        started = time.monotonic()
        messages: list[dict] = [{"role": "user", "content": task.question}]
        reply = await self._ask(messages, None)
        ids = [str(_extension(reply, "interaction_id"))]
        uses: list[ToolUse] = []
        for _ in range(self.settings.max_tool_rounds):
            message = reply.choices[0].message
            if not message.tool_calls:
                break
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                result = execute_call(call.function.name, call.function.arguments)
                uses.append(ToolUse(call.function.name, call.function.arguments, result))
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
            reply = await self._ask(messages, ids[-1])
            ids.append(str(_extension(reply, "interaction_id")))
        final = reply.choices[0].message.content or ""
        verdict: Verdict = judge_episode(task, uses, final)
        response = await self.http.post("/v1/feedback", json={"interaction_id": ids[-1], "reward": verdict.reward,
                                                               "source": FEEDBACK_SOURCE})
        response.raise_for_status()
        version = _extension(reply, "policy_version")
        return Episode(index=index, question=task.question, expected=task.result, tool_uses=uses,
                       final_answer=final, interaction_ids=ids,
                       policy_version=version if isinstance(version, int) else None,
                       called=verdict.called, call_correct=verdict.call_correct,
                       answer_correct=verdict.answer_correct, reward=verdict.reward, finished_at=time.time(),
                       latency_s=round(time.monotonic() - started, 3))

    async def close(self) -> None:
        await self.client.close()
        await self.http.aclose()
