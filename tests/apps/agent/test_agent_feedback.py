"""The agent's reward POST against a scripted /v1/feedback (httpx.MockTransport): a 5xx, 429 or transport
error is retried after Retry-After; a reward that still cannot be posted fails its task, not the run;
any other refusal is not retried and ends the run with the server's message."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from openai import AsyncOpenAI

import apps.agent.episode as episode_module
from apps.agent.episode import Agent
from apps.agent.results import SUMMARY_FILE, write_results
from apps.agent.run import drive
from apps.config import AgentConfig
from apps.default_model.tool_corpus import ToolTask

TASK = ToolTask(question="What is 17 plus 25?", expression="17 + 25", result="42", answer="17 plus 25 is 42.")


def unavailable(status: int = 503, retry_after: str | None = "0") -> httpx.Response:
    headers = {} if retry_after is None else {"Retry-After": retry_after}
    return httpx.Response(status, headers=headers,
                          json={"error": {"code": "logging_unavailable", "message": "log is behind"}})


class FakeServing:
    """Chat answers at once (no tool call), the nth with interaction id ``iid-n``; /v1/feedback answers
    from ``script[interaction_id]`` (a list, used up in order; an exception is raised) and then 200."""

    def __init__(self, script: dict[str, list] | None = None, always: dict[str, httpx.Response] | None = None):
        self.script = script or {}
        self.always = always or {}
        self.chats = 0
        self.feedback: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/chat/completions"):
            iid = f"iid-{self.chats}"
            self.chats += 1
            return httpx.Response(200, json={
                "id": iid, "object": "chat.completion", "created": 0, "model": "online-sao",
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": "17 plus 25 is 42."}}],
                "interaction_id": iid, "policy_version": 3})
        if request.url.path == "/v1/feedback":
            iid = json.loads(request.content)["interaction_id"]
            self.feedback.append(iid)
            if iid in self.always:
                return self.always[iid]
            answers = self.script.get(iid) or []
            if answers:
                answer = answers.pop(0)
                if isinstance(answer, Exception):
                    raise answer
                return answer
            return httpx.Response(200, json={"interaction_id": iid})
        return httpx.Response(404)


async def scripted_agent(serving: FakeServing, settings: AgentConfig) -> Agent:
    agent = Agent("http://serving", "online-sao", settings)
    await agent.close()  # its own clients; the scripted ones replace them
    transport = httpx.MockTransport(serving)
    agent.client = AsyncOpenAI(base_url="http://serving/v1", api_key="x", max_retries=0,
                               http_client=httpx.AsyncClient(transport=transport))
    agent.http = httpx.AsyncClient(base_url="http://serving", transport=transport)
    return agent


@pytest.fixture
def sleeps(monkeypatch) -> list[float]:
    """Every asyncio.sleep's length, each slept as 0 s."""
    waits: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(delay, *args, **kwargs):
        waits.append(delay)
        await real_sleep(0)

    monkeypatch.setattr(asyncio, "sleep", sleep)
    return waits


def run_one(serving: FakeServing):
    async def go():
        agent = await scripted_agent(serving, AgentConfig(max_tokens=64))
        try:
            return await agent.run(0, TASK)
        finally:
            await agent.close()
    return asyncio.run(go())


@pytest.mark.parametrize("status", [503, 429])
def test_a_retryable_refusal_is_waited_out_as_retry_after_says_and_the_reward_posted_again(sleeps, status):
    serving = FakeServing(script={"iid-0": [unavailable(status, retry_after="2")]})
    episode = run_one(serving)
    assert serving.feedback == ["iid-0", "iid-0"]
    assert sleeps == [2.0]
    assert episode.interaction_ids == ["iid-0"] and episode.policy_version == 3


def test_a_transport_error_is_retried_after_the_backoff(sleeps, monkeypatch):
    monkeypatch.setattr(episode_module, "FEEDBACK_BACKOFF_S", 0.25)
    serving = FakeServing(script={"iid-0": [httpx.ConnectError("connection refused"), unavailable(retry_after=None)]})
    episode = run_one(serving)
    assert serving.feedback == ["iid-0"] * 3
    assert sleeps == [0.25, 0.5]  # no Retry-After either time: the backoff, doubled
    assert episode.interaction_ids == ["iid-0"]


def test_a_retry_after_beyond_the_wait_bound_is_not_waited_out(sleeps):
    too_long = str(int(episode_module.FEEDBACK_MAX_WAIT_S) + 1)
    serving = FakeServing(always={"iid-0": unavailable(retry_after=too_long)})
    with pytest.raises(episode_module.FeedbackUnavailable, match="after 1 attempt.*logging_unavailable: log is behind"):
        run_one(serving)
    assert serving.feedback == ["iid-0"] and sleeps == []


def test_a_reward_failing_every_attempt_fails_its_task_and_the_run_goes_on(tmp_path, sleeps):
    serving = FakeServing(always={"iid-2": unavailable()})
    settings = AgentConfig(tasks=6, requests_per_second=1000.0, concurrency=1, progress_every=100, window=3)
    lines: list[str] = []

    async def go():
        agent = await scripted_agent(serving, settings)
        try:
            return await drive(agent, settings, tmp_path / "episodes.jsonl", lines.append)
        finally:
            await agent.close()

    episodes, failed = asyncio.run(go())
    assert failed == 1 and sorted(e.index for e in episodes) == [0, 1, 3, 4, 5]
    assert serving.feedback.count("iid-2") == episode_module.FEEDBACK_ATTEMPTS
    rows = [json.loads(line) for line in (tmp_path / "episodes.jsonl").read_text().splitlines()]
    assert sorted(row["interaction_ids"][0] for row in rows) == ["iid-0", "iid-1", "iid-3", "iid-4", "iid-5"]
    [failure] = [line for line in lines if "failed" in line]
    assert failure.startswith("task 2 failed:") and "HTTP 503 logging_unavailable: log is behind" in failure
    write_results(episodes, settings.window, failed, tmp_path)
    summary = json.loads((tmp_path / SUMMARY_FILE).read_text())
    assert (summary["tasks"], summary["failed_tasks"]) == (5, 1)


def test_a_refused_reward_is_not_retried_and_ends_the_run_with_the_servers_message(tmp_path, sleeps):
    refusal = httpx.Response(403, json={"error": {"code": "invalid_interaction_id",
                                                  "message": "interaction id was not issued here"}})
    serving = FakeServing(always={"iid-1": refusal})
    settings = AgentConfig(tasks=4, requests_per_second=1000.0, concurrency=1, progress_every=100)

    async def go():
        agent = await scripted_agent(serving, settings)
        try:
            return await drive(agent, settings, tmp_path / "episodes.jsonl", lambda _: None)
        finally:
            await agent.close()

    with pytest.raises(episode_module.FeedbackRefused,
                       match="iid-1 was refused: HTTP 403 invalid_interaction_id: interaction id was not issued"):
        asyncio.run(go())
    assert serving.feedback.count("iid-1") == 1


def test_retry_after_as_an_http_date():
    in_past = httpx.Response(503, headers={"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"})
    assert episode_module._retry_after_s(in_past) == 0.0
    assert episode_module._retry_after_s(httpx.Response(503, headers={"Retry-After": "soon"})) is None
    assert episode_module._retry_after_s(httpx.Response(503)) is None
