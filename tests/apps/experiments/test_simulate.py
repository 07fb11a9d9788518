"""Simulated users against a tiny fake OpenAI-compatible server (FastAPI on uvicorn, real HTTP)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from openai import AsyncOpenAI

from apps.config import ExperimentConfig
from apps.experiments.simulate import (MAX_CONSECUTIVE_FAILURES, SimResponse, SimulatedUsers,
                                             measure_style_accuracy)

SCHEDULE = [{"from_rollout": 0, "style": "formal"}, {"from_rollout": 4, "style": "cute"},
            {"from_rollout": 8, "style": "archaic"}]
POOL = [f"How do I make dish {i}?" for i in range(5)]
ARCHAIC = "Hark! Thou shouldst rinse the grains until the water runs clear. Fare thee well."
TERSE = "Rinse the grains until the water runs clear."


@dataclass
class FakeEndpoint:
    """Answers chat completions like serving/ does (plus ``interaction_id``), recording requests."""

    requests: list[dict] = field(default_factory=list)
    fail: set[int] = field(default_factory=set)
    """Indices of requests answered 503."""
    omit_id: bool = False
    in_flight: int = 0
    max_in_flight: int = 0
    exit_at_traffic: bool = False
    """Exit at the first request that is not a held-out measurement (as serving killed mid-run):
    that request is answered 503, every later one finds nobody listening."""
    exited: bool = False
    server: Any = None

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await request.json()
            if self.exit_at_traffic and "session_id" not in body:
                self.exited = self.server.should_exit = True
                return JSONResponse({"error": {"message": "shutting down", "type": "server_error"}}, status_code=503)
            index = len(self.requests)
            self.requests.append(body)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                await asyncio.sleep(0.02)
            finally:
                self.in_flight -= 1
            if index in self.fail:
                return JSONResponse({"error": {"message": "busy", "type": "server_error"}}, status_code=503)
            prompt = body["messages"][-1]["content"]
            answer = ARCHAIC if prompt.endswith("0?") or prompt.endswith("1?") else TERSE
            response = {"id": f"chatcmpl-{index}", "object": "chat.completion", "created": 0,
                        "model": body["model"], "policy_version": index // 3,
                        "choices": [{"index": 0, "message": {"role": "assistant", "content": answer},
                                     "finish_reason": "stop"}]}
            if not self.omit_id:
                response["interaction_id"] = f"iid-{index}"
            return response

        return app


@pytest.fixture
def endpoint(free_port) -> Iterator[tuple[FakeEndpoint, str]]:
    fake = FakeEndpoint()
    server = uvicorn.Server(uvicorn.Config(fake.app(), host="127.0.0.1", port=free_port, log_level="warning"))
    fake.server = server
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    yield fake, f"http://127.0.0.1:{free_port}/v1"
    server.should_exit = True
    thread.join(timeout=10)


def scenario(**fields) -> ExperimentConfig:
    defaults = dict(requests_per_second=200.0, concurrency=3, max_tokens=17, temperature=0.7,
                    rollouts_per_arm=12, schedule=SCHEDULE)
    return ExperimentConfig(**{**defaults, **fields})


def test_users_send_the_pool_in_seeded_groups_within_concurrency(endpoint):
    fake, url = endpoint
    seen: list[SimResponse] = []
    users = SimulatedUsers(url, None, scenario(), POOL, on_response=seen.append, repeats=2)
    stats = asyncio.run(users.run())
    assert (stats.sent, stats.answered, stats.failed) == (12, 12, 0)
    assert sorted(r.interaction_id for r in seen) == sorted(f"iid-{i}" for i in range(12))
    assert all(r.text in (ARCHAIC, TERSE) and r.finish_reason == "stop" for r in seen)
    assert {r.policy_version for r in seen} == {0, 1, 2, 3}
    sent = [r["messages"][-1]["content"] for r in fake.requests]
    assert sorted(sent) == sorted(r.prompt for r in seen)
    order = users.prompt_order()
    expected = [next(order) for _ in range(12)]
    assert sorted(sent) == sorted(expected)  # requests overlap, so arrival order may interleave
    assert expected[::2] == expected[1::2] and set(expected[:10:2]) == set(POOL)  # a shuffled pass, in pairs
    assert all(r["max_tokens"] == 17 and r["temperature"] == 0.7 for r in fake.requests)
    assert 1 < fake.max_in_flight <= 3


def test_prompt_order_is_seeded():
    a = SimulatedUsers("http://unused/v1", None, scenario(prompt_seed=1), POOL)
    b = SimulatedUsers("http://unused/v1", None, scenario(prompt_seed=1), POOL)
    c = SimulatedUsers("http://unused/v1", None, scenario(prompt_seed=2), POOL)
    first = lambda users: [p for p, _ in zip(users.prompt_order(), range(15))]  # noqa: E731
    assert first(a) == first(b) != first(c)


def test_refused_requests_are_counted_and_replaced(endpoint):
    fake, url = endpoint
    fake.fail = {1, 3}
    client = AsyncOpenAI(base_url=url, api_key="k", max_retries=0)
    users = SimulatedUsers(url, None, scenario(concurrency=1), POOL, client=client)
    stats = asyncio.run(users.run(total=5))
    assert (stats.sent, stats.answered, stats.failed) == (7, 5, 2)


def test_an_endpoint_that_keeps_failing_ends_the_run(endpoint):
    fake, url = endpoint
    fake.fail = set(range(1000))
    client = AsyncOpenAI(base_url=url, api_key="k", max_retries=0)
    users = SimulatedUsers(url, None, scenario(concurrency=2), POOL, client=client)
    with pytest.raises(RuntimeError, match="failed in a row"):
        asyncio.run(users.run(total=5))
    assert users.stats.answered == 0 and users.stats.failed >= MAX_CONSECUTIVE_FAILURES


def test_a_response_without_interaction_id_is_an_error(endpoint):
    fake, url = endpoint
    fake.omit_id = True
    users = SimulatedUsers(url, None, scenario(), POOL)
    with pytest.raises(ValueError, match="interaction_id"):
        asyncio.run(users.run(total=2))


def test_style_accuracy_is_measured_on_eval_requests(endpoint, style_classifier):
    fake, url = endpoint

    async def measure():
        async with AsyncOpenAI(base_url=url, api_key="k") as client:
            return await measure_style_accuracy(client, "online-sao", POOL, "archaic", style_classifier, scenario())

    accuracy, version = asyncio.run(measure())
    assert accuracy == pytest.approx(2 / 5)  # prompts 0 and 1 get the archaic answer
    assert version == 1  # the newest of policy versions 0, 0, 0, 1, 1
    assert all(r["session_id"] == "sao-eval" for r in fake.requests)


def test_drive_arm_sends_the_run_and_measures_style_accuracy_on_schedule(endpoint, style_classifier, tmp_path):
    from apps.config import load_app_config
    from apps.experiments.results import read_arm
    from apps.experiments.simulate import drive_arm

    fake, url = endpoint
    cfg = load_app_config(environ={}, overrides={
        "algorithm.name": "grpo", "algorithm.group_size": 2,
        "experiment": {**scenario().model_dump(mode="json"), "rollouts_per_arm": 10, "eval_every": 4,
                       "eval_prompts": 3, "prompt_pool_size": 4}})
    results = tmp_path / "arm.jsonl"
    lines: list[str] = []
    stats = asyncio.run(drive_arm(cfg, url, None, style_classifier, results, lines.append))
    assert stats.answered == 10
    evals = read_arm(results).evals
    assert [(e.rollout, e.preferred, e.prompts) for e in evals] == \
        [(0, "formal", 3), (4, "cute", 3), (8, "archaic", 3), (10, "archaic", 3)]
    assert len(lines) == 4 and all(0 <= e.style_accuracy <= 1 for e in evals)
    eval_requests = [r for r in fake.requests if r.get("session_id") == "sao-eval"]
    traffic = [r["messages"][-1]["content"] for r in fake.requests if "session_id" not in r]
    assert len(eval_requests) == 4 * 3 and len(traffic) == 10
    assert sorted(traffic) == sorted(traffic[::2] * 2)  # grpo: every prompt sent twice


def test_users_of_segments_send_their_drawn_segment_as_the_openai_user_field(endpoint):
    from itertools import islice

    from apps.experiments.scenario import segment_draws

    fake, url = endpoint
    groups = [{"name": "early", "share": 0.5, "schedule": SCHEDULE[:2]},
              {"name": "late", "share": 0.5, "schedule": SCHEDULE[:1]}]
    seen: list[SimResponse] = []
    exp = scenario(concurrency=1, segments=groups)
    stats = asyncio.run(SimulatedUsers(url, None, exp, POOL, on_response=seen.append).run())
    assert stats.answered == 12
    drawn = list(islice(segment_draws(exp), 12))
    assert set(drawn) == {"early", "late"}
    # One request at a time: the endpoint sees them in send order, each with its drawn segment.
    assert [r["user"] for r in fake.requests] == drawn == [r.segment for r in sorted(seen, key=lambda r: r.index)]
    asyncio.run(SimulatedUsers(url, None, scenario(concurrency=1), POOL).run(total=2))
    assert all("user" not in r for r in fake.requests[12:])  # no segments: no user field


def test_drive_arm_stops_the_traffic_when_a_process_of_the_stack_has_exited(endpoint, style_classifier, tmp_path):
    from apps.config import load_app_config
    from apps.experiments.simulate import drive_arm
    from apps.stack import StackError

    fake, url = endpoint
    cfg = load_app_config(environ={}, overrides={
        "experiment": {**scenario(concurrency=1).model_dump(mode="json"), "rollouts_per_arm": 20, "eval_every": 50,
                       "eval_prompts": 2, "prompt_pool_size": 4}})
    checks = []

    def learner_gone_at_the_third_look() -> None:
        checks.append(1)
        if len(checks) == 3:
            raise StackError("learner exited with 1")

    with pytest.raises(StackError, match="learner exited"):
        asyncio.run(drive_arm(cfg, url, None, style_classifier, tmp_path / "arm.jsonl", lambda _: None,
                              check_alive=learner_gone_at_the_third_look))
    traffic = [r for r in fake.requests if "session_id" not in r]
    assert len(checks) == 3 and len(traffic) < 20


def _arm_of(**experiment) -> "AppConfig":
    from apps.config import load_app_config

    return load_app_config(environ={}, overrides={
        "experiment": {**scenario().model_dump(mode="json"), "eval_every": 50, "eval_prompts": 2,
                       "prompt_pool_size": 4, **experiment}})


def test_drive_arm_names_the_exited_process_when_serving_dies_mid_traffic(endpoint, style_classifier, tmp_path):
    """Serving gone mid-run: every request failed, ``check_alive`` ran only after an answer, and the
    run ended with a bare RuntimeError ("20 requests failed in a row") instead of the stack's error
    naming the process and its log."""
    from apps.experiments.simulate import drive_arm
    from apps.stack import StackError

    fake, url = endpoint
    fake.exit_at_traffic = True

    def serving_alive() -> None:
        if fake.exited:
            raise StackError("serving exited with -9; see logs/serving.log")

    with pytest.raises(StackError, match="serving exited with -9"):
        asyncio.run(drive_arm(_arm_of(concurrency=4, rollouts_per_arm=20), url, None, style_classifier,
                              tmp_path / "arm.jsonl", lambda _: None, check_alive=serving_alive))


def test_drive_arm_names_the_exited_process_when_a_measurement_finds_serving_gone(free_port, style_classifier,
                                                                                 tmp_path):
    """The held-out measurement is where a run may first meet a serving that has exited: its
    connection error gives way to the stack's error."""
    from apps.experiments.simulate import drive_arm
    from apps.stack import StackError

    def serving_gone() -> None:
        raise StackError("serving exited with 1; see logs/serving.log")

    with pytest.raises(StackError, match="serving exited with 1"):
        asyncio.run(drive_arm(_arm_of(), f"http://127.0.0.1:{free_port}/v1", None,
                              style_classifier, tmp_path / "arm.jsonl", lambda _: None, check_alive=serving_gone))
