"""One agent episode through the OpenAI API: ask, run the tools the model calls, send their
results back as a continuation of the same trajectory, judge the final answer, send the reward.

The agent is a client like any other: the official ``openai`` package over HTTP, the
continuation linked by the endpoint's ``parent_interaction_id`` extension, the reward
posted to ``/v1/feedback`` for the newest interaction id (it carries the whole
trajectory), from where serving sends it to Kafka's rewards topic.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass
from email.utils import parsedate_to_datetime

import httpx
from openai import AsyncOpenAI

from apps.agent.judge import ToolUse, Verdict, execute_call, judge_episode
from apps.config import AgentConfig
from apps.default_model.calculator import CALCULATOR_TOOL
from apps.default_model.tool_corpus import ToolTask

FEEDBACK_SOURCE = "agent"
"""``source`` of the rewards the agent sends."""
FEEDBACK_ATTEMPTS = 4
"""Most POSTs of one reward to ``/v1/feedback`` (the first and 3 retries) on a 5xx, a 429 or a transport
error, as the openai client retries the chat route (it makes 3). Serving answers 503 ``logging_unavailable``
with ``Retry-After: 5`` when its log could not secure the reward within ``serving.log_ack_timeout_s``
(a briefly slow broker); one more attempt than the chat client gives that broker ~15 s of waits besides
the ack timeouts. Bounded because the task holds one of ``agent.concurrency`` slots meanwhile, and past
that the route is down rather than slow: the task counts as failed (a chat API error does too), and
``apps.agent.run.MAX_CONSECUTIVE_FAILURES`` of those in a row end the run. A retried reward the server
had logged after all reaches the learner twice (serving stamps each POST's record with its own time, so the
join does not take it for a copy): the same value changes nothing under ``reward.aggregation`` ``last``
(the default), ``first`` or ``mean``, and counts twice under ``sum``."""
FEEDBACK_MAX_WAIT_S = 30.0
"""Longest total sleep between one reward's attempts, for the same reason: a ``Retry-After`` that would
take the total past it is not waited out, the task counts as failed at once."""
FEEDBACK_BACKOFF_S = 0.5
"""Wait before the first retry when the server names none (no ``Retry-After``, a transport error);
doubled before each further retry, as the openai client does."""


class FeedbackUnavailable(Exception):
    """The reward was not accepted after :data:`FEEDBACK_ATTEMPTS` (a 5xx, 429 or transport error each
    time, or a ``Retry-After`` beyond :data:`FEEDBACK_MAX_WAIT_S`): the run counts the task as failed."""


class FeedbackRefused(Exception):
    """Serving refused the reward with a 4xx other than 429 (an id it did not sign, a source it does
    not allow, a reward out of range: ``serving/feedback.py``). Not retried, and it ends the run: it is a
    bug or a misconfiguration of the run that every later reward would meet too."""


def _retry_after_s(response: httpx.Response) -> float | None:
    """Seconds ``Retry-After`` asks for (a number or an HTTP date); None without a readable one."""
    value = response.headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError, OverflowError):
        return None


def _server_message(response: httpx.Response) -> str:
    """``HTTP <status> <code>: <message>`` from serving's error body (``{"error": {"code", "message"}}``)."""
    try:
        error = response.json()["error"]
        detail = f"{error.get('code') or error.get('type')}: {error['message']}"
    except (ValueError, KeyError, TypeError, AttributeError):
        detail = response.text[:300] or response.reason_phrase
    return f"HTTP {response.status_code} {detail}"


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
        await self._send_reward(ids[-1], verdict.reward)
        version = _extension(reply, "policy_version")
        return Episode(index=index, question=task.question, expected=task.result, tool_uses=uses,
                       final_answer=final, interaction_ids=ids,
                       policy_version=version if isinstance(version, int) else None,
                       called=verdict.called, call_correct=verdict.call_correct,
                       answer_correct=verdict.answer_correct, reward=verdict.reward, finished_at=time.time(),
                       latency_s=round(time.monotonic() - started, 3))

    async def _send_reward(self, interaction_id: str, reward: float) -> None:
        """POST the reward until accepted: retried on a 5xx, 429 or transport error, after the server's
        ``Retry-After`` or else :data:`FEEDBACK_BACKOFF_S` doubling, within :data:`FEEDBACK_ATTEMPTS` and
        :data:`FEEDBACK_MAX_WAIT_S`; raises :class:`FeedbackUnavailable` past those, :class:`FeedbackRefused`
        on any other refusal."""
        body = {"interaction_id": interaction_id, "reward": reward, "source": FEEDBACK_SOURCE}
        waited = 0.0
        for attempt in range(1, FEEDBACK_ATTEMPTS + 1):
            try:
                response = await self.http.post("/v1/feedback", json=body)
            except httpx.TransportError as exc:
                problem, wait = f"{type(exc).__name__}: {exc}", None
            else:
                if response.is_success:
                    return
                problem = _server_message(response)
                if response.status_code != 429 and response.status_code < 500:
                    raise FeedbackRefused(f"the reward for {interaction_id} was refused: {problem}")
                wait = _retry_after_s(response)
            if wait is None:
                wait = FEEDBACK_BACKOFF_S * 2 ** (attempt - 1)
            if attempt == FEEDBACK_ATTEMPTS or waited + wait > FEEDBACK_MAX_WAIT_S:
                raise FeedbackUnavailable(f"the reward for {interaction_id} was not accepted after {attempt} "
                                          f"attempt(s) and {waited:g} s of waits: {problem}")
            await asyncio.sleep(wait)
            waited += wait

    async def close(self) -> None:
        await self.client.close()
        await self.http.aclose()
